"""The engine core's front door (engine/core/handlers.py) without a socket: a frame in, the
frames that answer it out, by table; what is due between steps from `tick`; and the side
tables a generation is admitted to and released from in one loop (RequestSideTable).

A real EngineCore on the tiny Llama (CPU)."""

from __future__ import annotations

import pytest
from test_engine_core import greedy

from engine.config import EngineConfig
from engine.core import EngineCore, Tick
from engine.frames import CallFailed, Generate, Invoke, Outputs, Rejected, Reply, Shutdown, invoke
from microserve.backend import RequestRejected
from microserve.messages import (CALLS, AbortRequest, AbortResponse, EngineStats,
                                 RemoteSendRequest, StatsRequest)

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64]


@pytest.fixture
def core(tiny_model_dir):
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    yield core
    core.close()


def test_calls_and_frames_are_answered_by_table(core):
    [reply] = core.handle(invoke(1, StatsRequest()))
    assert isinstance(reply, Reply) and reply.id == 1
    assert isinstance(CALLS["stats"].decode_answer(reply.result), EngineStats)
    [failed] = core.handle(Invoke(2, "nope", reply.result))
    assert isinstance(failed, CallFailed) and (failed.id, failed.status) == (2, 404)
    assert failed.error == "unknown call 'nope'"
    [rejected] = core.handle(Generate("bad", [core.info.vocab_size], greedy()))
    assert isinstance(rejected, Rejected) and rejected.request_id == "bad"
    assert (rejected.status, rejected.param) == (400, "prompt")
    assert core.handle(Generate("a", PROMPT, greedy())) == []
    # an abort answers the generation's last output before the call's reply
    out, answer = core.handle(invoke(3, AbortRequest("a")))
    assert isinstance(out, Outputs) and out.items[0].finish_reason == "abort"
    assert isinstance(answer, Reply) and answer.id == 3
    assert CALLS["abort"].decode_answer(answer.result) == AbortResponse(True)
    # an unknown id: nothing held; said to be for an early send, that send will be refused
    for call_id, early_send, aborted in [(4, False, False), (5, True, True)]:
        [answer] = core.handle(invoke(call_id, AbortRequest("b", early_send)))
        assert CALLS["abort"].decode_answer(answer.result) == AbortResponse(aborted)
    [refused] = core.handle(invoke(6, RemoteSendRequest("b", PROMPT)))
    assert isinstance(refused, CallFailed) and (refused.id, refused.status) == (6, 409)
    assert refused.error == "request 'b' was aborted"
    assert not core.shut_down and core.handle(Shutdown()) == [] and core.shut_down
    core.check_integrity()


def test_tick_refuses_a_generation_past_its_queue_time(core):
    assert core.tick(0.0) == Tick([], False)
    core.add_request("late", PROMPT, greedy(), queue_s=5.0)
    deadline = core.next_deadline()
    frames, progressed = core.tick(deadline + 1)
    assert progressed and [(f.request_id, f.status, f.code) for f in frames] == [
        ("late", 503, "queue_timeout")]
    assert "late" not in core.requests and core.next_deadline() is None
    core.check_integrity()


class Recorder:
    """A side table that holds every generation it is given."""

    what = "recorded requests"

    def __init__(self, refuse: str | None = None):
        self.held: set[str] = set()
        self.refuse = refuse
        self.log: list[tuple[str, str]] = []

    def admit(self, request_id, params) -> None:
        if request_id == self.refuse:
            raise RequestRejected("refused by the recorder", "recorder")
        self.held.add(request_id)
        self.log.append(("admit", request_id))

    def remove(self, request_id) -> None:
        self.held.discard(request_id)
        self.log.append(("remove", request_id))

    def request_ids(self):
        return list(self.held)


def test_side_tables_see_every_admission_and_release(core):
    first, last = Recorder(), Recorder(refuse="refused")
    core.side_tables += [first, last]
    core.add_request("a", PROMPT, greedy(3))
    with pytest.raises(RequestRejected, match="refused by the recorder"):
        core.add_request("refused", PROMPT, greedy(3))
    assert first.log == [("admit", "a"), ("admit", "refused"), ("remove", "refused")]
    core.check_integrity()
    while core.has_work():
        core.step()
    assert first.held == last.held == set() and first.log[-1] == ("remove", "a")
    first.held.add("gone")  # a table that keeps a finished request is caught
    with pytest.raises(Exception, match=r"recorded requests of gone requests: \{'gone'\}"):
        core.check_integrity()
