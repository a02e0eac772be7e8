"""The engine-core loop (engine/core_proc.py) keeps serving when a request makes our code raise.

A real EngineCore on the tiny Llama runs its CoreLoop on a thread, fed over a socket pair as
the frontend feeds it. Failures are injected where validation cannot reach (the model step, a
request's start, a call): the request or call fails with a 500, the next one is served with
Hugging Face's greedy tokens, and nothing is left held. Steps that keep failing (a broken
device) end the loop, so a supervisor restarts the engine. A step that takes seconds does not
silence the core: its heartbeats go on through it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import time

import pytest
from conftest import hf_greedy
from test_engine_core import greedy

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_proc import MAX_FAILED_STEPS, CoreLoop
from engine.loop_stats import LoopCounters, StatsLog, format_line
from engine.frames import (
    CallFailed,
    FromCore,
    Generate,
    Heartbeat,
    invoke,
    Outputs,
    Rejected,
    Reply,
    Shutdown,
)
from microserve.messages import CALLS, CheckIntegrityRequest, EngineStats, StatsRequest
from microserve.wire import FrameDecoder, encode

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]
N_NEW = 6


class LoopHarness:
    """CoreLoop on a thread; `send` and `receive` speak its wire protocol (typed frames)."""

    def __init__(self, core: EngineCore, heartbeat_s: float | None = None):
        self.core = core
        self.ours, theirs = socket.socketpair()
        self.ours.settimeout(60)
        self.decoder, self.pending = FrameDecoder(FromCore), []
        self.error: BaseException | None = None
        self.loop = CoreLoop(core, theirs, heartbeat_s=heartbeat_s)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # what would end the core process
            self.error = e

    def send(self, msg) -> None:
        self.ours.sendall(encode(msg))

    def receive(self):
        while not self.pending:
            data = self.ours.recv(1 << 20)
            assert data, f"the core loop ended: {self.error!r}"
            self.pending += self.decoder.feed(data)
        return self.pending.pop(0)

    def add(self, request_id: str) -> None:
        self.send(Generate(request_id, PROMPT, greedy(N_NEW), 0))

    def generate(self, request_id: str) -> list[int]:
        self.add(request_id)
        tokens = []
        while True:
            msg = self.receive()
            assert isinstance(msg, Outputs), msg
            for out in msg.items:
                tokens += out.token_ids
                if out.finish_reason is not None:
                    return tokens

    def stop(self) -> None:
        if self.thread.is_alive():
            self.send(Shutdown())
        self.thread.join(30)
        self.ours.close()


@pytest.fixture
def harness(tiny_model_dir):
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    h = LoopHarness(core)
    yield h
    h.stop()
    core.close()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(harness, tiny_model_dir,
                                                                  monkeypatch):
    want = hf_greedy(tiny_model_dir, [PROMPT], N_NEW)[0]
    runner = harness.core.runner
    forward = runner.forward

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "forward", forward)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "forward", fail_once)
    harness.add("doomed")
    assert harness.receive() == Rejected(
        request_id="doomed", status=500, param=None,
        message="internal error in the engine step: RuntimeError")
    assert harness.generate("after") == want
    harness.send(invoke(1, CheckIntegrityRequest()))
    reply = harness.receive()
    assert (reply.id, CALLS["check_integrity"].decode_answer(reply.result)) == (1, True)
    assert harness.core.kv.stats().used_pages == 0 and len(harness.core.requests) == 0


def test_a_request_or_call_that_raises_fails_alone(harness, tiny_model_dir, monkeypatch):
    want = hf_greedy(tiny_model_dir, [PROMPT], N_NEW)[0]
    add_request = harness.core.add_request

    def raise_once(*args, **kwargs):
        monkeypatch.setattr(harness.core, "add_request", add_request)
        raise KeyError("injected")

    monkeypatch.setattr(harness.core, "add_request", raise_once)
    harness.add("doomed")
    assert harness.receive() == Rejected(request_id="doomed", status=500, param=None,
                                         message="internal error: KeyError")
    monkeypatch.setattr(harness.core, "stats", lambda: {}["missing"])
    harness.send(invoke(7, StatsRequest()))
    reply = harness.receive()
    assert reply == CallFailed(id=7, status=500, error="internal error: KeyError")
    assert harness.generate("after") == want


def test_steps_that_keep_failing_end_the_loop(harness, monkeypatch):
    def always(*args, **kwargs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(harness.core.runner, "forward", always)
    for i in range(MAX_FAILED_STEPS):
        harness.add(f"r{i}")
        if i < MAX_FAILED_STEPS - 1:
            assert harness.receive().status == 500
    harness.thread.join(30)
    assert not harness.thread.is_alive()
    assert str(harness.error) == f"{MAX_FAILED_STEPS} engine steps in a row failed"


def test_the_core_counts_its_steps_and_logs_them_while_it_works(tiny_model_dir, caplog):
    """The Stats call carries the core's steps, tokens and time; the line it logs every
    interval counts the same steps, and an idle core logs the last interval's without news."""
    caplog.set_level(logging.INFO, logger="microserve.core")
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64,
                                   log_stats_interval_s=0.2))
    h = LoopHarness(core)
    try:
        assert h.generate("a") == hf_greedy(tiny_model_dir, [PROMPT], N_NEW)[0]
        time.sleep(0.5)  # idle: the line of the interval with the steps is logged all the same
        h.send(invoke(1, StatsRequest()))
        stats = CALLS["stats"].decode_answer(h.receive().result)
    finally:
        h.stop()
        core.close()
    # One step per token (CPU: no async scheduling), the first one over the whole prompt.
    assert (stats.steps, stats.prompt_tokens_computed, stats.tokens_sampled) == (
        N_NEW, len(PROMPT), N_NEW)
    spent = (stats.step_seconds, stats.send_seconds, stats.message_seconds, stats.idle_seconds)
    assert all(t > 0 for t in spent) and stats.idle_seconds > 0.4
    assert 0 < stats.device_wait_seconds < stats.step_seconds
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert sum(int(re.search(r"s: (\d+) steps", line)[1]) for line in lines) == N_NEW, lines
    assert "running 0, waiting 0, preempted 0; KV 0.0% used" in lines[-1]


def test_the_stats_line_reports_the_interval_exactly():
    before = LoopCounters(steps=10, prompt_tokens_computed=1000, tokens_sampled=100,
                          step_seconds=1.0, device_wait_seconds=0.5, send_seconds=0.1,
                          message_seconds=0.1, idle_seconds=0.0)
    after = LoopCounters(steps=110, prompt_tokens_computed=21000, tokens_sampled=6100,
                         step_seconds=1.97, device_wait_seconds=1.2, send_seconds=0.12,
                         message_seconds=0.11, idle_seconds=0.0)
    stats = EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)
                           if f.type in ("int", "float")})
    stats.running, stats.waiting, stats.kv_pages_total = 64, 3, 1000
    stats.kv_pages_used, stats.kv_pages_cached = 500, 25
    stats.prompt_tokens, stats.cached_prompt_tokens = 4000, 1000
    assert format_line(1.0, before, after, stats) == (
        "engine: 1.0 s: 100 steps (9.7 ms), prompt 20,000 tok/s, generation 6,000 tok/s; "
        "running 64, waiting 3, preempted 0; KV 50.0% used, 2.5% cached; prefix cache hits "
        "25.0% of prompt tokens (since start); core time: steps 97.0% (waiting for the device "
        "70.0%), outputs to frontend 2.0%, messages 1.0%, idle 0.0%")
    # On a GPU the device's side follows: its busy share and the host's lead per launch.
    gpu_after = dataclasses.replace(after, device_busy_seconds=0.9, device_steps_ahead=100)
    assert format_line(1.0, before, gpu_after, stats).endswith(
        "idle 0.0%; device busy 90.0% in steps, 1.00 steps ahead at launch")
    gpu_after = dataclasses.replace(gpu_after, device_decode_seconds=0.4,
                                    device_decode_steps=50, device_decode_seqs=1234)
    assert format_line(1.0, before, gpu_after, stats).endswith(
        "1.00 steps ahead at launch; decode-only steps 50 at 8.00 ms (batch 24.7)")
    gpu_after = dataclasses.replace(gpu_after, device_prompt_seconds=0.36,
                                    device_prompt_steps=2, device_prompt_tokens=16_000)
    assert format_line(1.0, before, gpu_after, stats).endswith(
        "(batch 24.7); prompt-only steps 2 at 180.00 ms (8,000 tokens)")
    gpu_after = dataclasses.replace(gpu_after, launch_holds=4, launch_hold_seconds=0.05,
                                    launch_hold_arrivals=3)
    assert format_line(1.0, before, gpu_after, stats).endswith(
        "(8,000 tokens); launches held 4 for 12.50 ms, 3 requests arrived meanwhile")
    log = StatsLog(0.0)
    assert not log.due(1e9) and log.wait_at_most(0.0, after) is None  # 0: never


def test_a_held_launch_takes_the_requests_that_arrive_meanwhile(tiny_model_dir, monkeypatch):
    """While the core says the step in flight is not near its end (launch_ready False, as
    with --launch-ahead-layers on a GPU), the loop launches nothing and takes messages: the
    requests that arrive then all make the next step, one step for the three prompts, and
    each gets Hugging Face's greedy tokens. The hold and its arrivals are counted."""
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    steps = []
    schedule = core.scheduler.schedule

    def spy():
        out = schedule()
        steps.append(sorted(e.seq.request_id for e in out.scheduled))
        return out

    monkeypatch.setattr(core.scheduler, "schedule", spy)
    held, released = [], []  # asked while "a" waits; the step nears its end at 3 waiting

    def launch_ready():
        if not released:
            held.append(len(core.scheduler.waiting))
            if held[-1] >= 3:
                released.append(True)
        return bool(released)

    monkeypatch.setattr(core, "launch_ready", launch_ready)
    prompts = {"a": PROMPT, "b": PROMPT[::-1], "c": PROMPT[1:]}  # (a twin would wait for a)
    h = LoopHarness(core)
    try:
        h.send(Generate("a", prompts["a"], greedy(N_NEW), 0))
        while not held:  # the loop holds a's launch
            time.sleep(0.01)
        h.send(Generate("b", prompts["b"], greedy(N_NEW), 0))
        h.send(Generate("c", prompts["c"], greedy(N_NEW), 0))
        tokens = {}
        while len(tokens) < 3 or any(not done for _, done in tokens.values()):
            msg = h.receive()
            for out in msg.items:
                got, _ = tokens.get(out.request_id, ([], False))
                tokens[out.request_id] = (got + out.token_ids, out.finish_reason is not None)
        h.send(invoke(1, StatsRequest()))
        stats = CALLS["stats"].decode_answer(h.receive().result)
    finally:
        h.stop()
        core.close()
    want = dict(zip(prompts, hf_greedy(tiny_model_dir, list(prompts.values()), N_NEW)))
    assert {r: t for r, (t, _) in tokens.items()} == want
    assert steps == [["a", "b", "c"]] * N_NEW
    assert held[0] == 1 and held[-1] == 3  # asked with a alone, released with all three
    assert (stats.launch_holds, stats.launch_hold_arrivals) == (1, 2)
    assert 0 < stats.launch_hold_seconds < stats.step_seconds


def test_a_long_step_beats_while_the_calls_wait_for_it(tiny_model_dir, monkeypatch):
    """A step of 1.5 s: the heartbeat thread reports it every 0.05 s (the steps run so far,
    and how long this one has run), while a Stats call made during it is answered only after
    it. The frontend's liveness answer is made of these beats: busy, not dead."""
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    h = LoopHarness(core, heartbeat_s=0.05)
    forward = core.runner.forward

    def slow_once(*args, **kwargs):
        monkeypatch.setattr(core.runner, "forward", forward)
        time.sleep(1.5)
        return forward(*args, **kwargs)

    monkeypatch.setattr(core.runner, "forward", slow_once)
    try:
        idle = h.receive()
        assert idle == Heartbeat(steps=0, in_step_s=0.0)  # between steps: in_step_s is 0
        h.add("slow")
        while not isinstance(beat := h.receive(), Heartbeat) or beat.in_step_s == 0:
            pass
        asked = time.monotonic()
        h.send(invoke(1, StatsRequest()))
        beats, tokens = [beat], []
        while not isinstance(msg := h.receive(), Reply):
            if isinstance(msg, Heartbeat):
                beats.append(msg)
            else:
                tokens += [t for out in msg.items for t in out.token_ids]
        answered_s = time.monotonic() - asked
        in_step = [b.in_step_s for b in beats if b.in_step_s > 0]
        assert {b.steps for b in beats if b.in_step_s > 0} == {1}  # the first step, running
        assert in_step == sorted(in_step) and len(in_step) >= 10, in_step
        assert 1.2 < in_step[-1] < 1.6 and 1.0 < answered_s, (in_step, answered_s)
        assert CALLS["stats"].decode_answer(msg.result).steps == 1  # answered once the step was done
    finally:
        h.stop()
        core.close()
