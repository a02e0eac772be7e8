"""The engine-core process: the step loop, fed by messages from the frontend process.

Why a separate process: the step loop must never wait on HTTP parsing, JSON, tokenization or
detokenization (vLLM once spent 62% of an H100 decode step outside the GPU). The frontend
(engine/frontend/, an asyncio process) does all of that and talks to this loop over one Unix
socket of length-prefixed msgpack frames (microserve/wire.py), each a typed frame of
engine/frames.py, decoded by its "type" tag:

    frontend -> core: Generate, Invoke (one of the calls declared in messages.CALLS, handled
                      by the `on_{name}` method of the core: engine/core/handlers.py), Shutdown
    core -> frontend: Ready | StartFailed (once), Outputs (one frame per step, all requests),
                      Rejected, Reply | CallFailed, Heartbeat (from a thread of its own,
                      every HEARTBEAT_S)

The loop does the I/O only: each frame goes to the core's `handle`, what is due between steps
to its `tick`, and the frames they return are sent. Between steps the loop drains whatever
messages have arrived without blocking; when it has no work it blocks on the socket, the KV
sender's wake-up pipe and the next lease or wait deadline.
With --launch-ahead-layers K, the loop holds the launch after a step with prompt tokens until
K of that step's layers are left on the GPU (its mark fires), taking messages meanwhile: with
async scheduling the next step is otherwise scheduled the moment this one is launched, and a
prompt arriving during a 30-ms prompt step waits for that next step and then its own.
A remote_send call is answered when its transfer completes, several steps later; a prep_recv
that must wait for pages, between the steps once they are free. When the frontend goes away
(EOF), the core exits.

The heartbeat is how the frontend tells a busy core from a dead one (its liveness answer,
GET /microserving/live): a thread sends one every HEARTBEAT_S with the steps run so far and
how long the step in progress has run, so a step that takes a minute still beats, while a
stopped or hung process (SIGSTOP, a machine frozen) does not.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys
import threading
import time
import traceback

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.frames import Frame, Heartbeat, Outputs, Ready, StartFailed, ToCore
from engine.loop_stats import LoopClock, StatsLog
from kvcache.transfer.auth import KEY_ENV
from microserve.heap import freeze_startup_heap
from microserve.wire import FrameDecoder, encode

log = logging.getLogger("microserve.core")

MAX_FAILED_STEPS = 3  # steps in a row that may raise before the engine gives up (and exits)
CHECK_AFTER_IDLE_S = 0.05  # idle this long before the integrity check runs (see run)
MAX_IDLE_WAIT_S = 3600.0  # select() needs a timeout a C time_t holds; leases are shorter anyway
# While a launch is held (--launch-ahead-layers), how often the loop looks at the step in
# flight's mark between messages: a fraction of the host's ~1-3 ms to launch the next step
LAUNCH_HOLD_POLL_S = 0.0002
HEARTBEAT_S = 0.2  # between two heartbeats: well under any liveness timeout a router sets


class CoreLoop:
    """Args:
        core: the engine core it drives.
        sock: the connected socket to the frontend.
        heartbeat_s: send a Heartbeat this often from a thread of its own (None: none).
    """

    def __init__(self, core: EngineCore, sock: socket.socket, heartbeat_s: float | None = None):
        self.core = core
        self.sock = sock
        self.heartbeat_s = heartbeat_s
        self._send_lock = threading.Lock()  # the loop and the heartbeat thread both send frames
        self.step_started: float | None = None  # time.monotonic() in a step; set by run()
        self.decoder = FrameDecoder(ToCore)
        self.running = True  # until the frontend goes away or sends Shutdown
        self.failed_steps = 0  # steps in a row that raised
        self.clock = LoopClock(core.loop)
        self.stats_log = StatsLog(core.config.log_stats_interval_s)

    def send(self, msg: Frame) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def send_all(self, frames: list[Frame]) -> None:
        for frame in frames:
            self.send(frame)

    def run(self) -> None:
        stop = threading.Event()
        beating = None
        if self.heartbeat_s is not None:
            beating = threading.Thread(target=self._beat, args=(stop,), daemon=True,
                                       name="heartbeat")
            beating.start()
        try:
            self._run()
        finally:
            stop.set()
            if beating is not None:
                beating.join()

    def _beat(self, stop: threading.Event) -> None:
        """The heartbeat thread: a Heartbeat every heartbeat_s until `stop` (or the socket
        closes). Reads two fields the loop writes; a torn read is impossible under the GIL."""
        while not stop.wait(self.heartbeat_s):
            started = self.step_started
            in_step = 0.0 if started is None else time.monotonic() - started
            try:
                self.send(Heartbeat(self.core.loop.steps, in_step))
            except OSError:  # the frontend is gone: the loop ends too
                return

    def _run(self) -> None:
        was_busy = check_due = False
        stalled = False  # the last step had work but could schedule none of it (no pages)
        while self.running:
            # First what the last step or messages made due (EngineCore.tick).
            now = time.monotonic()
            frames, progressed = self.core.tick(now)
            self.send_all(frames)
            stalled = stalled and not progressed
            self.clock.charge("message")
            busy = self.core.has_work() and not stalled
            # Once work ends, the KV bookkeeping is checked (it catches a leak right where it
            # starts), but only after CHECK_AFTER_IDLE_S without news: the check walks the
            # whole pool (milliseconds on a GPU's 28,000 pages), and a request that arrives
            # as the last one ends must not wait for it.
            check_due = check_due or (was_busy and not busy)
            was_busy = busy
            timeout = 0 if busy else _earliest(
                self._idle_timeout(), CHECK_AFTER_IDLE_S if check_due else None,
                self.stats_log.wait_at_most(now, self.core.loop))
            # A stalled engine waits, like an idle one, for a message, a finished send or a
            # deadline, instead of spinning on steps that schedule nothing.
            if self._receive(timeout=timeout):
                stalled = False
            elif check_due and not busy:
                self.core.check_integrity()
                check_due = False
            self.clock.charge("message")
            if self.running and self.core.has_work() and not stalled:
                if not self.core.launch_ready():
                    self._hold_launch()
                    if not self.running:
                        continue
                self.step_started = time.monotonic()
                try:
                    outputs = self.core.step()
                except Exception as e:  # our bug: it fails the step's requests, not the engine
                    self._fail_step(e)
                    continue
                finally:
                    self.step_started = None
                    self.clock.charge("step")
                self.failed_steps = 0
                stalled = self.core.stalled
                if outputs:
                    self.send(Outputs(outputs))
                    self.clock.charge("send")
            now = time.monotonic()
            if self.stats_log.due(now):
                self.stats_log.log(now, self.core.loop, self.core.stats())

    def _hold_launch(self) -> None:
        """Take messages until the step in flight has --launch-ahead-layers left on the GPU
        (its mark fired), so that prompts arriving meanwhile make the next step. The time
        counts as step time: the loop waits on the device, not for work."""
        loop, waiting = self.core.loop, len(self.core.scheduler.waiting)
        start = time.perf_counter()
        self.clock.charge("message")
        while self.running and not self.core.launch_ready():
            self._receive(timeout=LAUNCH_HOLD_POLL_S, waiting_as="step")
            self.clock.charge("message")
        loop.launch_holds += 1
        loop.launch_hold_seconds += time.perf_counter() - start
        loop.launch_hold_arrivals += max(0, len(self.core.scheduler.waiting) - waiting)

    def _fail_step(self, error: Exception) -> None:
        """Fail every request in the engine (which of them made the step raise is unknown),
        then check that nothing leaked; if the state is broken after all, the engine exits."""
        log.exception("engine step failed; failing the requests in the engine")
        self.failed_steps += 1
        if self.failed_steps >= MAX_FAILED_STEPS:  # e.g. a sticky CUDA error: let it restart
            raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps in a row failed") from error
        self.send_all(self.core.fail_step(error))
        self.core.check_integrity()

    def _idle_timeout(self) -> float | None:
        deadline = self.core.next_deadline()
        if deadline is None:
            return None
        return min(max(0.0, deadline - time.monotonic()), MAX_IDLE_WAIT_S)

    def _receive(self, timeout: float | None, waiting_as: str = "idle") -> bool:
        """Handle what arrived within `timeout` (the wait charged as `waiting_as`). True if
        anything did: a message, or a wake-up from the KV sender (a send completed or failed),
        so remote_send answers may be due."""
        wakeup = self.core.wakeup_fd
        ready, _, _ = select.select([self.sock, wakeup], [], [], timeout)
        self.clock.charge(waiting_as)
        if wakeup in ready:
            os.read(wakeup, 4096)
        if self.sock in ready:
            data = self.sock.recv(1 << 20)
            if not data:  # the frontend is gone: nobody to serve
                self.running = False
            for msg in self.decoder.feed(data):
                self.send_all(self.core.handle(msg))
            if self.core.shut_down:
                self.running = False
        return bool(ready)


def _earliest(*timeouts: float | None) -> float | None:
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="microserve engine core (started by the frontend)")
    ap.add_argument("--fd", type=int, required=True, help="connected Unix socket to the frontend")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MICROSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s core: %(message)s",
    )
    sock = socket.socket(fileno=args.fd)
    # The key comes through the environment, not the command line (which ps shows to all).
    key = os.environ.pop(KEY_ENV, None)
    try:
        core = EngineCore(EngineConfig(**json.loads(args.config)),
                          transfer_key=bytes.fromhex(key) if key else None)
    except Exception as e:  # report why start-up failed, then exit non-zero
        traceback.print_exc()
        sock.sendall(encode(StartFailed(f"{type(e).__name__}: {e}")))
        return 1
    sock.sendall(encode(Ready(core.info)))
    freeze_startup_heap()  # the model, torch and warm-up: out of every later full collection
    tensor_parallel = core.config.tensor_parallel_size > 1
    code = 0
    try:
        CoreLoop(core, sock, heartbeat_s=HEARTBEAT_S).run()
    except BaseException:
        if not tensor_parallel:
            raise
        traceback.print_exc()
        code = 1
    finally:
        try:
            core.close()
        except BaseException:
            if not tensor_parallel:
                raise
            traceback.print_exc()
            code = 1
        if tensor_parallel:
            # closed in order (workers stopped, KV pools released): the interpreter's own end
            # would destroy the NCCL group, which can wait on its other ranks until a timeout
            # (engine/tp/group.py, `leave`) while the GPUs stay held; end here, as workers do
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
