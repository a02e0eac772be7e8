"""The core's request table (engine/requests.py): every legal transition and no other, one
state per request id, and `check_integrity` catching a table that disagrees with the
scheduler, the KV pages or the grammar matchers. Plain Python: no model, no engine."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from engine.requests import IllegalTransition, RequestState, RequestTable
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from kvcache.integrity import IntegrityError
from kvcache.manager import KVCacheManager
from microserve.messages import SamplingParams

RW, RES, SEND, FLUSH, PARK, GEN = (RequestState.RECV_WAITING, RequestState.RESERVED,
                                   RequestState.SENDING, RequestState.FLUSHING,
                                   RequestState.PARKED, RequestState.GENERATING)  # fmt: skip
LEGAL = {(None, RW), (None, RES), (None, SEND), (None, FLUSH), (None, PARK), (None, GEN),
         (RW, RES), (RES, GEN), (SEND, FLUSH), (SEND, PARK), (PARK, FLUSH)}  # fmt: skip
PAYLOAD = {"waiting": "a WaitingRecv", "reservation": "a Reservation", "job": "a SendJob",
           "generator": "a generator"}  # the table keeps them, never looks inside


def seq(rid: str, send_only: bool = False) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=4), 0, send_only=send_only)


def move(table: RequestTable, rid: str, to: RequestState) -> None:
    """Make the transition into `to`, with what that state holds."""
    match to:
        case RequestState.RECV_WAITING:
            table.wait_recv(rid, PAYLOAD["waiting"])
        case RequestState.RESERVED:
            table.reserve(rid, PAYLOAD["reservation"])
        case RequestState.SENDING:
            table.send(rid, PAYLOAD["job"], seq(rid, send_only=True))
        case RequestState.FLUSHING:
            table.flush(rid, PAYLOAD["job"])
        case RequestState.PARKED:
            table.park(rid, PAYLOAD["job"])
        case RequestState.GENERATING:
            table.generate(rid, seq(rid), PAYLOAD["generator"])


def assert_only(table: RequestTable, rid: str, state: RequestState) -> None:
    """`rid` is in the table once, in `state`, and in no other state's view."""
    assert table.get(rid).state is state and rid in table
    assert [s for s in RequestState if rid in table.in_state(s)] == [state]
    assert sum(table.count(s) for s in RequestState) == len(table) == 1


@pytest.mark.parametrize(("was", "to"), itertools.product([None, *RequestState], RequestState))
def test_each_transition_is_made_or_refused_as_the_diagram_says(was, to):
    table = RequestTable()
    if was is not None:
        move(table, "r", was)
    before = table.get("r")
    if (was, to) in LEGAL:
        move(table, "r", to)
        assert_only(table, "r", to)
        entry = table.get("r")
        held = {f.name for f in dataclasses.fields(entry)
                if f.name not in ("request_id", "state") and getattr(entry, f.name) is not None}
        assert held == {RW: {"waiting"}, RES: {"reservation"}, SEND: {"job", "seq"},
                        FLUSH: {"job"}, PARK: {"job"},
                        GEN: {"seq", "generator"}}[to]  # and nothing else
    else:
        name = "(none)" if was is None else was.name
        with pytest.raises(IllegalTransition, match=re.escape(f"request 'r': {name} -> {to.name}")):
            move(table, "r", to)
        assert table.get("r") is before  # untouched
        if was is not None:
            assert_only(table, "r", was)


@pytest.mark.parametrize("state", RequestState)
def test_any_state_may_leave_the_table_and_only_once(state):
    table = RequestTable()
    move(table, "r", state)
    assert table.finish("r").state is state
    assert "r" not in table and len(table) == 0 and table.count(state) == 0
    with pytest.raises(IllegalTransition, match="request 'r' is not in the table"):
        table.finish("r")


def test_entries_are_written_only_by_the_table():
    table = RequestTable()
    table.reserve("r", PAYLOAD["reservation"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.get("r").state = GEN
    with pytest.raises(TypeError):
        table.in_state(RES)["x"] = table.get("r")  # a read-only view
    assert_only(table, "r", RES)


def test_states_keep_arrival_order_and_ids_are_one_lookup():
    table = RequestTable()
    for rid in ("c", "a", "b"):
        table.wait_recv(rid, PAYLOAD["waiting"])
    table.reserve("a", PAYLOAD["reservation"])  # granted out of line: it leaves the queue
    table.generate("g", seq("g"), None)
    assert list(table.in_state(RW)) == ["c", "b"]  # FIFO among those still waiting
    assert list(table.in_state(RES)) == ["a"] and list(table.in_state(GEN)) == ["g"]
    assert len(table) == 4 and "g" in table and "x" not in table and table.get("x") is None
    assert table.generators([table.get("g").seq]) == [None]


# ---- check_integrity: the table against the scheduler, the pages and the grammars ------------


PS = 4


@pytest.fixture
def engine_parts():
    """A consistent state: a generation running (pages), one waiting (none), a send computing
    (running), a reservation, a flushing and a parked send (pages held outside the scheduler),
    and a prep_recv waiting (nothing)."""
    kv = KVCacheManager(num_pages=32, page_size=PS)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=2)
    table = RequestTable()
    for rid in ("gen", "send", "queued"):
        s = seq(rid, send_only=rid == "send")
        (table.send(rid, PAYLOAD["job"], s) if s.send_only
         else table.generate(rid, s, None))  # fmt: skip
        scheduler.add(s)
    scheduler.schedule()  # "gen" and "send" run (max_num_seqs 2); "queued" waits
    for rid, state in (("res", RES), ("flush", FLUSH), ("park", PARK)):
        kv.open(rid, [])
        assert kv.allocate(rid, 8)
        move(table, rid, state)
    table.wait_recv("line", PAYLOAD["waiting"])
    table.check_integrity(scheduler, kv, ["gen", "queued"])
    assert [s.request_id for s in scheduler.running] == ["gen", "send"]
    return table, scheduler, kv


def test_a_consistent_engine_passes(engine_parts):
    table, scheduler, kv = engine_parts
    table.check_integrity(scheduler, kv, [])
    assert {s: table.count(s) for s in RequestState} == {RW: 1, RES: 1, SEND: 1, FLUSH: 1,
                                                          PARK: 1, GEN: 2}  # fmt: skip


def test_a_generation_the_scheduler_lost_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    scheduler.waiting.clear()  # "queued" gone from the scheduler, still GENERATING
    with pytest.raises(IntegrityError, match=r"lost or stale requests: \{'queued'\}"):
        table.check_integrity(scheduler, kv, [])


def test_a_sequence_the_table_does_not_know_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    scheduler.add(seq("stray"))
    with pytest.raises(IntegrityError, match=r"lost or stale requests: \{'stray'\}"):
        table.check_integrity(scheduler, kv, [])


def test_another_sequence_under_a_known_id_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    scheduler.waiting[0] = seq("queued")  # same id, not the table's sequence
    with pytest.raises(IntegrityError, match=r"other sequences than the table's: \['queued'\]"):
        table.check_integrity(scheduler, kv, [])


def test_pages_held_by_a_request_that_should_hold_none_are_caught(engine_parts):
    table, scheduler, kv = engine_parts
    kv.open("line", [])  # a waiting prep_recv holds nothing
    assert kv.allocate("line", 4)
    with pytest.raises(IntegrityError, match=r"pages held by \{'line'\}"):
        table.check_integrity(scheduler, kv, [])


def test_a_reservation_without_its_pages_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    kv.free("res")
    with pytest.raises(IntegrityError, match=r"pages held by \{'res'\}"):
        table.check_integrity(scheduler, kv, [])


def test_pages_of_a_request_gone_from_the_table_are_caught(engine_parts):
    table, scheduler, kv = engine_parts
    table.finish("flush")  # its pages were not freed
    with pytest.raises(IntegrityError, match=r"pages held by \{'flush'\}"):
        table.check_integrity(scheduler, kv, [])


def test_a_grammar_of_a_gone_request_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    with pytest.raises(IntegrityError, match=r"grammar matchers of gone requests: \{'res'\}"):
        table.check_integrity(scheduler, kv, ["gen", "res"])


def test_a_penalty_entry_of_a_gone_request_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    table.check_integrity(scheduler, kv, [], ["gen", "queued"])
    with pytest.raises(IntegrityError, match=r"penalty pool entries of gone requests: "
                       r"\{'send'\}"):
        table.check_integrity(scheduler, kv, [], ["gen", "send"])


def test_an_id_indexed_under_two_states_is_caught(engine_parts):
    table, scheduler, kv = engine_parts
    table._by_state[RES]["line"] = table.get("line")  # corrupt the index by hand
    with pytest.raises(IntegrityError, match="the requests by state disagree with the request "
                       "table"):
        table.check_integrity(scheduler, kv, [])
