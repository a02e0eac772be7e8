"""The engine-core loop (engine/core_proc.py) keeps serving when a request makes our code raise.

A real EngineCore on the tiny Llama runs its CoreLoop on a thread, fed over a socket pair as
the frontend feeds it. Failures are injected where validation cannot reach (the model step, a
request's start, a call): the request or call fails with a 500, the next one is served with
Hugging Face's greedy tokens, and nothing is left held. Steps that keep failing (a broken
device) end the loop, so a supervisor restarts the engine.
"""

from __future__ import annotations

import socket
import threading

import pytest
from conftest import hf_greedy
from test_engine_core import greedy

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.core_proc import MAX_FAILED_STEPS, CoreLoop
from microserve.messages import (CheckIntegrity, FromCore, Generate, Invoke, Outputs, Rejected,
                                 Reply, Shutdown, Stats)
from microserve.wire import FrameDecoder, encode

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]
N_NEW = 6


class LoopHarness:
    """CoreLoop on a thread; `send` and `receive` speak its wire protocol (typed frames)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.ours, theirs = socket.socketpair()
        self.ours.settimeout(60)
        self.decoder, self.pending = FrameDecoder(FromCore), []
        self.error: BaseException | None = None
        self.loop = CoreLoop(core, theirs)
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
    harness.send(Invoke(1, CheckIntegrity()))
    assert harness.receive() == Reply(id=1, result=True, error=None)
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
    harness.send(Invoke(7, Stats()))
    reply = harness.receive()
    assert (reply.id, reply.status, reply.error) == (7, 500, "internal error: KeyError")
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
