"""The engine-core process: the step loop, fed by messages from the frontend process.

Why a separate process: the step loop must never wait on HTTP parsing, JSON, tokenization or
detokenization (vLLM once spent 62% of an H100 decode step outside the GPU). The frontend
(engine/frontend/, an asyncio process) does all of that and talks to this loop over one Unix
socket of length-prefixed msgpack frames (microserve/wire.py), each a typed message of
microserve/messages.py, decoded by its "type" tag:

    frontend -> core: Generate, Invoke (one of the calls declared in messages.CALLS, handled
                      by the `on_{name}` method of CoreLoop), Shutdown
    core -> frontend: Ready | StartFailed (once), Outputs (one frame per step, all requests),
                      Rejected, Reply | CallFailed, Heartbeat (from a thread of its own,
                      every HEARTBEAT_S)

Between steps the loop drains whatever messages have arrived without blocking; when it has no
work it blocks on the socket, the KV sender's wake-up pipe and the next lease or wait deadline.
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

import msgspec

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loop_stats import LoopClock, StatsLog
from kvcache.integrity import IntegrityError
from microserve.backend import MicroservingError, RequestRejected
from engine.frames import (
    CallFailed,
    Frame,
    Generate,
    Heartbeat,
    Invoke,
    Outputs,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    StartFailed,
    ToCore,
)
from microserve.messages import CALLS, AbortRequest, AbortResponse, PinResponse
from microserve.transfer_auth import KEY_ENV
from microserve.wire import FrameDecoder, encode

log = logging.getLogger("microserve.core")
_encoder = msgspec.msgpack.Encoder()


def _encoded(answer) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(answer))


def _pinned(pin, prompt: list[int]) -> PinResponse:
    try:
        return PinResponse(pin(prompt))
    except ValueError as e:  # unpin of a prefix that is not pinned
        raise MicroservingError(400, str(e), "prompt") from None

MAX_FAILED_STEPS = 3  # steps in a row that may raise before the engine gives up (and exits)
CHECK_AFTER_IDLE_S = 0.05  # idle this long before the integrity check runs (see run)
MAX_IDLE_WAIT_S = 3600.0  # select() needs a timeout a C time_t holds; leases are shorter anyway
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
        self.running = True
        # request id -> (call, id) of the remote_send (or waiting prep_recv) to answer
        self.sends: dict[str, tuple] = {}
        # call name -> (its declaration, its handler): a handler returns the call's answer,
        # or None for one answered later (core.poll)
        self.handlers = {name: (call, getattr(self, f"on_{name}")) for name, call in CALLS.items()}
        self.failed_steps = 0  # steps in a row that raised
        self.clock = LoopClock(core.loop)
        self.stats_log = StatsLog(core.config.log_stats_interval_s)

    def send(self, msg: Frame) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

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
        exchange = self.core.exchange
        while self.running:
            # First what the last step or messages made due: expired leases free pages, freed
            # pages admit waiting prep_recv calls, and every call now settled is answered (a
            # finished send frees pages too).
            now = time.monotonic()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now and self.core.expire(now):
                stalled = False
                for request_id, e in self.core.take_rejected():
                    self.send(Rejected(request_id, str(e), e.param, e.status, e.code))
            exchange.admit_waiting(now)
            if self._answer_sends():
                stalled = False
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

    def _fail_step(self, error: Exception) -> None:
        """Fail every request in the engine (which of them made the step raise is unknown),
        then check that nothing leaked; if the state is broken after all, the engine exits."""
        log.exception("engine step failed; failing the requests in the engine")
        self.failed_steps += 1
        if self.failed_steps >= MAX_FAILED_STEPS:  # e.g. a sticky CUDA error: let it restart
            raise RuntimeError(f"{MAX_FAILED_STEPS} engine steps in a row failed") from error
        why = f"internal error in the engine step: {type(error).__name__}"
        for request_id in self.core.fail_requests(why):
            self.send(Rejected(request_id, why, None, 500))
        self._answer_sends()
        self.core.check_integrity()

    def _idle_timeout(self) -> float | None:
        deadline = self.core.next_deadline()
        if deadline is None:
            return None
        return min(max(0.0, deadline - time.monotonic()), MAX_IDLE_WAIT_S)

    def _receive(self, timeout: float | None) -> bool:
        """Handle what arrived within `timeout`. True if anything did: a message, or a wake-up
        from the KV sender (a send completed or failed), so remote_send answers may be due."""
        wakeup = self.core.wakeup_fd
        ready, _, _ = select.select([self.sock, wakeup], [], [], timeout)
        self.clock.charge("idle")
        if wakeup in ready:
            os.read(wakeup, 4096)
        if self.sock in ready:
            data = self.sock.recv(1 << 20)
            if not data:  # the frontend is gone: nobody to serve
                self.running = False
            for msg in self.decoder.feed(data):
                self._handle(msg)
        return bool(ready)

    def _handle(self, msg: ToCore) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, Invoke):
            self._call(msg)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _generate(self, msg: Generate) -> None:
        try:
            first = self.core.add_request(msg.request_id, msg.prompt, msg.params, msg.begin,
                                         msg.first_token, msg.queue_s, msg.received_at)
        except (RequestRejected, MicroservingError) as e:
            self.send(Rejected(msg.request_id, str(e), e.param, getattr(e, "status", 400),
                               getattr(e, "code", None)))
        except Exception as e:  # our bug: it fails this request, never the engine
            log.exception("request %s failed to start", msg.request_id)
            self.core.abort_request(msg.request_id)
            self.send(Rejected(msg.request_id, f"internal error: {type(e).__name__}", None, 500))
        else:
            if first is not None:  # a first token handed over by the KV's sender: out now
                self.send(Outputs([first]))

    def _call(self, msg: Invoke) -> None:
        if msg.method not in self.handlers:
            self._reply(msg.id, None, MicroservingError(404, f"unknown call {msg.method!r}"))
            return
        call, handler = self.handlers[msg.method]
        try:
            request = call.decode_request(msg.request)
            answer = handler(request, msg.received_at or None)
        except (RequestRejected, MicroservingError) as e:
            self._reply(msg.id, call, e)
        except IntegrityError as e:
            self._reply(msg.id, call, RuntimeError(f"integrity check failed: {e}"))
        except Exception as e:  # our bug: it fails this call, never the engine
            log.exception("%s failed", msg.method)
            self._reply(msg.id, call, RuntimeError(f"internal error: {type(e).__name__}"))
        else:
            if answer is None:  # answered once settled (_answer_sends)
                self.sends[request.request_id] = (call, msg.id)
            else:
                self._reply(msg.id, call, answer)

    # -- the calls' handlers (messages.CALLS): (request, received_at) -> answer | None ---------

    def on_stats(self, request, received_at):
        return self.core.stats()

    def on_check_integrity(self, request, received_at):
        self.core.check_integrity()
        return True

    def on_prep_recv(self, r, received_at):
        return self.core.exchange.prep_recv(r.request_id, r.prompt, r.end, r.lease_s, r.wait_s)

    def on_remote_send(self, r, received_at):
        return self.core.remote_send(r.request_id, r.prompt, r.begin, r.end, r.kv_addr,
                                     r.sampling, received_at, r.queue_s)

    def on_send_to(self, r, received_at):
        return self.core.exchange.send_to(r.request_id, r.begin, r.kv_addr)

    def on_commit(self, r, received_at):
        return self.core.exchange.commit(r.request_id, r.pin)

    def on_abort(self, r: AbortRequest, received_at) -> AbortResponse:
        """Drop the request wherever it is; a generation gets its finishing output."""
        aborted = r.request_id in self.core.requests
        out = self.core.abort_request(r.request_id)
        if out is not None:
            self.send(Outputs([out]))
        return AbortResponse(aborted)

    def on_pin(self, r, received_at) -> PinResponse:
        return _pinned(self.core.kv.pin, r.prompt)

    def on_unpin(self, r, received_at) -> PinResponse:
        return _pinned(self.core.kv.unpin, r.prompt)

    def _reply(self, call_id: int, call, answer=None) -> None:
        """Send `answer` (encoded as `call.answer`), or the failure it is an exception of."""
        if not isinstance(answer, Exception):
            self.send(Reply(call_id, _encoded(answer)))
            return
        ours = isinstance(answer, (RequestRejected, MicroservingError))
        self.send(CallFailed(call_id, str(answer),
                             getattr(answer, "status", 400) if ours else 500,
                             getattr(answer, "param", None), getattr(answer, "code", None)))

    def _answer_sends(self) -> bool:
        """Answer the deferred calls now settled. True if there were any."""
        answers = self.core.poll()
        for rid, outcome in answers:
            waiting = self.sends.pop(rid, None)
            if waiting is not None:
                self._reply(waiting[1], waiting[0], outcome)
        return bool(answers)


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
    try:
        CoreLoop(core, sock, heartbeat_s=HEARTBEAT_S).run()
    finally:
        core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
