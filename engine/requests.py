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
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from kvcache.integrity import IntegrityError
from microserve.messages import SendTiming

if TYPE_CHECKING:
    import torch

    from engine.scheduler import Scheduler
    from engine.sequence import Sequence
    from kvcache.manager import KVCacheManager
    from kvcache.transfer import Window
    from microserve.messages import SamplingParams


class RequestState(enum.Enum):
    RECV_WAITING = "recv_waiting"  # a prep_recv waiting in line for pages; holds nothing
    RESERVED = "reserved"  # pages and an open transfer window, for a peer to write into
    SENDING = "sending"  # a remote_send computing KV as a send-only sequence
    FLUSHING = "flushing"  # a remote_send computed; pages held until the transfer flushed
    PARKED = "parked"  # a remote_send computed before send_to named its destination
    GENERATING = "generating"  # a sequence in the scheduler, waiting or running


# ---- what a transfer state holds (the KV exchange writes them: engine/kv_receiver.py,
# engine/kv_sender.py) -------------------------------------------------------------------------


@dataclass
class Reservation:
    tokens: list[int]  # prompt[:end]: the KV this engine will hold when the peer is done
    matched: int  # leading tokens found in the prefix cache; the peer writes [matched, end)
    window: Window
    digest: bytes  # kv_digest(tokens, sent_from): the seal the window's KV must come with
    lease_s: float  # how long the reservation lives without a renewal from its sender
    deadline: float  # time.monotonic() when the lease is next looked at (see expire_leases)
    namespace: int = 0  # the LoRA adapter (its id; 0: the base) the KV is reserved under
    # [matched, own): positions this engine computes itself meanwhile (BlockLLM's split
    # migration); the peer writes [sent_from, end)
    own: int = 0

    @property
    def sent_from(self) -> int:
        return max(self.matched, self.own)


@dataclass
class WaitingRecv:
    """A prep_recv waiting for pages (nothing held yet)."""

    tokens: list[int]
    lease_s: float
    wait_s: float
    deadline: float  # time.monotonic() when it gives up with a 503
    pages: int  # pages it needs at most (no prefix matched)
    namespace: int = 0  # the LoRA adapter (its id; 0: the base) to reserve under
    own: int = 0  # as Reservation.own


@dataclass
class SendJob:
    tokens: list[int]  # prompt[:end]: what the KV is computed from
    begin: int
    end: int
    # The receiver's slots for positions [begin, end) (int64, CPU); None until send_to names
    # them (a remote_send made without kv_addr: begin is set then too).
    dst_slots: torch.Tensor | None
    reused: int  # tokens of [begin, end) copied from this engine's prefix cache
    computed: int  # tokens this engine prefills for the job
    samples: bool = False  # answers with the first output token, sampled after the prompt
    first_token: int | None = None  # set when sampled (`KVExchange.sampled`)
    matched: int = 0  # leading prompt tokens found in this engine's prefix cache
    # time.monotonic() by which send_to must name the destination; None once it did
    address_by: float | None = None
    # time.monotonic() by which a step must start on it (the call's queue_s); None: no limit
    start_by: float | None = None
    queue_s: float | None = None  # the call's, for the message
    # time.perf_counter() when the engine took the call (its frontend, on this host's clock;
    # else the core), launched its first step, and had its
    # KV computed: its sampled token read back, or (a send that samples nothing) its KV landed
    # at the receiver. The answer's SendTiming; set by Sending.
    received_at: float = field(default_factory=time.perf_counter)
    first_step_at: float | None = None
    last_step_at: float | None = None  # the step with its latest chunk (its last, once computed)
    computed_at: float | None = None

    def timing(self) -> SendTiming:
        done = self.computed_at or time.perf_counter()
        first = self.first_step_at or done  # all cached: nothing computed
        last = self.last_step_at or first
        return SendTiming(queued_s=first - self.received_at, prefill_s=done - first,
                          tail_s=time.perf_counter() - done, chunks_s=last - first)


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


class RequestSideTable(Protocol):
    """Something the core keeps per generation beside its sequence (grammar matchers, the
    penalty pool; later adapters, host pages). The core gives it every generation it adds and
    tells it of every one that leaves (finished, aborted, failed, or refused while added), in
    one loop over its side tables; `RequestTable.check_integrity` checks that it holds only
    GENERATING requests."""

    what: str  # what it holds, for messages: "grammar matchers"

    def admit(self, request_id: str, params: SamplingParams) -> None:
        """Keep what the request needs, if anything. Raises RequestRejected (naming the
        field) if it cannot."""

    def remove(self, request_id: str) -> None:
        """Forget the request (unknown ids are ignored)."""

    def request_ids(self) -> Iterable[str]:
        """The requests it holds something for."""


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
                        grammar_ids: Iterable[str] = (), penalty_ids: Iterable[str] = (),
                        side_tables: Iterable[RequestSideTable] = ()) -> None:
        """The table against itself and against what holds resources for requests: the
        scheduler holds exactly the SENDING and GENERATING sequences (the very objects);
        pages are held by running sequences, waiting ones whose KV was held before admission,
        RESERVED, FLUSHING and PARKED requests, and nobody else; the side tables (and the
        grammar matcher and penalty pool ids given as such) only GENERATING requests. Raises
        IntegrityError."""
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
        held_by = [("grammar matchers", grammar_ids), ("penalty pool entries", penalty_ids),
                   *((table.what, table.request_ids()) for table in side_tables)]
        for what, ids in held_by:
            stale = set(ids) - generating
            if stale:
                raise IntegrityError(f"{what} of gone requests: {stale}")


def _name(state: RequestState | None) -> str:
    return "(none)" if state is None else state.name
