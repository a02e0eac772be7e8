"""The core's one table of requests: each request id in exactly one state, with what it holds.

    new ─prep_recv─▶ RECV_WAITING ─pages free─▶ RESERVED ─start_generate─▶ GENERATING
    new ─prep_recv, pages free now─────────────▶ RESERVED
    new ─remote_send─▶ SENDING ─last chunk computed─▶ FLUSHING
    new ─remote_send, all of it cached here─────────▶ FLUSHING
    new ─remote_send, no kv_addr─▶ SENDING ─computed, no send_to yet─▶ PARKED
    new ─remote_send, no kv_addr, all of it cached here─────────────▶ PARKED ─send_to─▶ FLUSHING
    (a send_to for a send still computing leaves it SENDING: it sends from then on)
    new ─generate─▶ GENERATING
    any state ─▶ gone: finished, flushed, committed, aborted, failed, its wait or lease over

    state         holds                                 pages held by
    RECV_WAITING  WaitingRecv (a prep_recv in line)     nobody
    RESERVED      Reservation (an open window)          the request (KVCacheManager)
    SENDING       SendJob + its send-only Sequence      the sequence (in the scheduler)
    FLUSHING      SendJob                               the request, until the flush ran
    PARKED        SendJob (no destination yet)          the request, until send_to names one
    GENERATING    Sequence + its sampling generator     the sequence (in the scheduler)

An entry is immutable: a transition replaces it, through one of the table's methods, which
refuses any transition not drawn above with IllegalTransition. So "already in use" is one
lookup, and what the scheduler, the KV manager and the grammar matchers hold is checked
against one table (`check_integrity`) instead of reconciled across registries.

Who moves what: the KV exchange moves requests through the states of a transfer (all but
GENERATING: they hold pages and windows that are the exchange's to give back); the core moves
GENERATING. What crosses into the scheduler (a send-only sequence to schedule, or to take out)
the exchange returns to the core, which alone adds to and removes from the scheduler.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvcache.integrity import IntegrityError

if TYPE_CHECKING:
    import torch

    from engine.kv_receiver import Reservation, WaitingRecv
    from engine.kv_sender import SendJob
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from kvcache.manager import KVCacheManager


class RequestState(enum.Enum):
    RECV_WAITING = "recv_waiting"  # a prep_recv waiting in line for pages; holds nothing
    RESERVED = "reserved"  # pages and an open transfer window, for a peer to write into
    SENDING = "sending"  # a remote_send computing KV as a send-only sequence
    FLUSHING = "flushing"  # a remote_send computed; pages held until the transfer flushed
    PARKED = "parked"  # a remote_send computed before send_to named its destination
    GENERATING = "generating"  # a sequence in the scheduler, waiting or running


# Where a request may go from each state (None: not in the table). Any state may leave it.
_NEXT: dict[RequestState | None, frozenset[RequestState]] = {
    None: frozenset(RequestState),
    RequestState.RECV_WAITING: frozenset({RequestState.RESERVED}),
    RequestState.RESERVED: frozenset({RequestState.GENERATING}),
    RequestState.SENDING: frozenset({RequestState.FLUSHING, RequestState.PARKED}),
    RequestState.FLUSHING: frozenset(),
    RequestState.PARKED: frozenset({RequestState.FLUSHING}),
    RequestState.GENERATING: frozenset(),
}


class IllegalTransition(IntegrityError):
    """A request was moved along an edge the state diagram does not have (a bug)."""


@dataclass(frozen=True, slots=True)
class Request:
    """A request id's entry: its state, and only what that state holds (the rest is None)."""

    request_id: str
    state: RequestState
    waiting: WaitingRecv | None = None  # RECV_WAITING
    reservation: Reservation | None = None  # RESERVED
    job: SendJob | None = None  # SENDING, FLUSHING, PARKED
    seq: Sequence | None = None  # SENDING, GENERATING
    # GENERATING, and SENDING when the send samples (both when the request has a seed)
    generator: torch.Generator | None = None


class RequestTable:
    def __init__(self) -> None:
        self._entries: dict[str, Request] = {}
        # The same entries by state, in the order they entered it (RECV_WAITING is a FIFO).
        self._by_state: dict[RequestState, dict[str, Request]] = {s: {} for s in RequestState}
        self._views = {s: MappingProxyType(d) for s, d in self._by_state.items()}

    # ---- reading ------------------------------------------------------------------------------

    def get(self, request_id: str) -> Request | None:
        return self._entries.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def in_state(self, state: RequestState) -> Mapping[str, Request]:
        """The entries in `state`, oldest first (a live read-only view: copy it to iterate
        while moving requests)."""
        return self._views[state]

    def count(self, state: RequestState) -> int:
        return len(self._by_state[state])

    def generators(self, seqs: Iterable[Sequence]) -> list[torch.Generator | None]:
        """The sampling generators of sampled sequences (once per step: kept cheap)."""
        entries = self._entries
        return [entries[seq.request_id].generator for seq in seqs]

    # ---- transitions: the only writers --------------------------------------------------------

    def wait_recv(self, request_id: str, waiting: WaitingRecv) -> None:
        self._move(Request(request_id, RequestState.RECV_WAITING, waiting=waiting))

    def reserve(self, request_id: str, reservation: Reservation) -> None:
        self._move(Request(request_id, RequestState.RESERVED, reservation=reservation))

    def send(self, request_id: str, job: SendJob, seq: Sequence,
             generator: torch.Generator | None = None) -> None:
        self._move(Request(request_id, RequestState.SENDING, job=job, seq=seq,
                           generator=generator))

    def flush(self, request_id: str, job: SendJob) -> None:
        self._move(Request(request_id, RequestState.FLUSHING, job=job))

    def park(self, request_id: str, job: SendJob) -> None:
        self._move(Request(request_id, RequestState.PARKED, job=job))

    def generate(self, request_id: str, seq: Sequence, generator: torch.Generator | None) -> None:
        self._move(Request(request_id, RequestState.GENERATING, seq=seq, generator=generator))

    def finish(self, request_id: str) -> Request:
        """Take a request out of the table, whatever its state; returns its last entry."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            raise IllegalTransition(f"request {request_id!r} is not in the table")
        del self._by_state[entry.state][request_id]
        return entry

    def _move(self, entry: Request) -> None:
        rid = entry.request_id
        old = self._entries.get(rid)
        was = None if old is None else old.state
        if entry.state not in _NEXT[was]:
            raise IllegalTransition(f"request {rid!r}: {_name(was)} -> {_name(entry.state)}")
        if old is not None:
            del self._by_state[was][rid]
        self._entries[rid] = self._by_state[entry.state][rid] = entry

    # ---- checks -------------------------------------------------------------------------------

    def check_integrity(self, scheduler: Scheduler, kv: KVCacheManager,
                        grammar_ids: Iterable[str], penalty_ids: Iterable[str] = ()) -> None:
        """The table against itself and against what holds resources for requests: the
        scheduler holds exactly the SENDING and GENERATING sequences (the very objects);
        pages are held by running sequences, waiting ones whose KV was held before admission,
        RESERVED, FLUSHING and PARKED requests, and nobody else; grammar matchers and
        penalty pool entries only by GENERATING requests. Raises IntegrityError."""
        if sum(map(len, self._by_state.values())) != len(self._entries) or any(
            self._entries.get(rid) is not e or e.state is not state
            for state, entries in self._by_state.items() for rid, e in entries.items()
        ):
            raise IntegrityError("the requests by state disagree with the request table")
        running = {s.request_id for s in scheduler.running}
        waiting = {s.request_id for s in scheduler.waiting}
        scheduled = {**self._by_state[RequestState.SENDING],
                     **self._by_state[RequestState.GENERATING]}
        if running | waiting != scheduled.keys():
            lost = (running | waiting) ^ scheduled.keys()
            raise IntegrityError(f"lost or stale requests: {lost}")
        stray = [s.request_id for s in (*scheduler.running, *scheduler.waiting)
                 if scheduled[s.request_id].seq is not s]  # fmt: skip
        if stray:
            raise IntegrityError(f"the scheduler runs other sequences than the table's: {stray}")
        held = kv.seq_ids()
        holders = (running | (waiting & held) | self._by_state[RequestState.RESERVED].keys()
                   | self._by_state[RequestState.FLUSHING].keys()
                   | self._by_state[RequestState.PARKED].keys())  # fmt: skip
        if held != holders:
            raise IntegrityError(f"pages held by {held ^ holders}")
        generating = self._by_state[RequestState.GENERATING].keys()
        stale = set(grammar_ids) - generating
        if stale:
            raise IntegrityError(f"grammar matchers of gone requests: {stale}")
        stale = set(penalty_ids) - generating
        if stale:
            raise IntegrityError(f"penalty pool entries of gone requests: {stale}")


def _name(state: RequestState | None) -> str:
    return "(none)" if state is None else state.name
