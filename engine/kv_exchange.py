"""The engine side of the microserving calls that move KV between engines (paper §3.4–3.5).

Receiver (engine D):
    prep_recv      match prompt[:end] in the prefix cache, hold it, reserve pages for the rest,
                   open a transfer window over them; answer `matched` and the kv_addr. When the
                   pages are not free, the call waits its turn (FIFO, up to `wait_s`) and is
                   answered between steps once they are; then a 503
    start_generate the reservation becomes a sequence whose first `begin` tokens are computed
    commit         the reservation's pages join the prefix cache; nothing is generated
    (lease)        a reservation lives while its sender renews it (kvcache/transfer/sender.py:
                   every 0.25 s from the moment it takes the job, queued or computing); it is
                   freed `lease_s` after the grant or the last renewal, whichever is later

A P/D request's timeline, with P busy and D's pool full when it arrives:

    router  D.prep_recv ──(waits)──▶ P.remote_send ──(P's queue, compute)──▶ D.start_generate
    D       [ waiting: holds nothing ] grant [ reserved; lease renewed by P ........ ] adopt, decode
    P                                  start [ queued ][ compute + write layers ] flush
                                             renew every 0.25 s ──────────────▶

D holds nothing while the call waits, and holds pages no longer than P holds the job (plus
`lease_s` if P dies, or less: the router aborts the request when it sees P go).

Sender (engine P), for remote_send(prompt, begin, end, kv_addr):

    positions:   0 ........ begin ................................ end
    P's cache:   [ matched_p ──────────────▶ ]                      (case 1: matched_p > begin)
                            [ copy from cache ][ compute and send  ]
    P's cache:   [ matched_p ▶ ]                                    (case 2: matched_p < begin)
                 [ compute, don't send ][ compute and send         ]

Cached KV is written to the receiver at once; computed KV is marked for sending
(`PagedKVCache.mark_send`) and written layer by layer as each step's forward pass runs.
When the last chunk is computed, the job's pages stay held until the transfer stream has
flushed every write; only then does the remote_send call answer.

A remote_send may come before its destination is known (no kv_addr: the router asks P to start
while D's prep_recv runs, so P's compute is not held up by D's round trip). The job computes
prompt[:end] into this engine's pages, sending nothing; `send_to(begin, kv_addr)` then copies
what exists of [begin, end) at once (cached or computed: `write_all_layers`, ordered after the
steps already launched) and the later chunks are sent layer by layer as above. A job computed
before its send_to is PARKED, holding its pages; one whose send_to does not come within the
engine's lease (`--kv-lease-s`, counted from the remote_send) is dropped with a 408.

A request's place is its entry in the core's request table (engine/requests.py): RECV_WAITING
or RESERVED on the receiver, SENDING (a send-only sequence computing) or FLUSHING (computed, its
pages held until the transfer thread flushed) on the sender. The exchange moves requests
through these states and gives their pages and windows back; it never touches the scheduler.
Where a request enters or leaves the scheduler, it returns the sequence (remote_send,
drop_failed_sends, abort, fail_send) and the core adds or removes it. What the scheduler must
keep for its own work it learns through `headroom`, a callable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.requests import IllegalTransition, RequestState, RequestTable
from engine.sequence import Sequence
from engine.validation import check_prompt, resolve_index
from kvcache.forward import KVSend
from kvcache.manager import KVCacheManager
from kvcache.transfer import KVLayout, TransferBackend, TransferError, Window
from kvcache.transfer.sender import KVSender
from microserve.backend import MicroservingError
from microserve.messages import (CommitResponse, KVAddr, PrepRecvResponse, RemoteSendResponse,
                                 SamplingParams, SendToResponse)
from microserve.transfer_auth import TransferAuthError, verify

log = logging.getLogger(__name__)


MAX_EARLY_ADDRESSES = 4096  # send_to calls kept for a remote_send still on its way
# What poll() answers a deferred call with: its response, or its error.
Answer = PrepRecvResponse | RemoteSendResponse | MicroservingError
_NEVER_TRIED = -(1 << 62)  # below any _room(): the waiting head is tried at the next chance


@dataclass
class Reservation:
    tokens: list[int]  # prompt[:end]: the KV this engine will hold when the peer is done
    matched: int  # leading tokens found in the prefix cache; the peer writes [matched, end)
    window: Window
    lease_s: float  # how long the reservation lives without a renewal from its sender
    deadline: float  # time.monotonic() when the lease is next looked at (see expire_leases)


@dataclass
class WaitingRecv:
    """A prep_recv waiting for pages (nothing held yet)."""

    tokens: list[int]
    lease_s: float
    wait_s: float
    deadline: float  # time.monotonic() when it gives up with a 503
    pages: int  # pages it needs at most (no prefix matched)


@dataclass
class SendJob:
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


class KVExchange:
    """Args:
        kv: the engine's KV pages; the exchange holds and frees those of its states.
        requests: the core's request table; the exchange moves only the transfer states.
        headroom: pages the scheduler's own work needs first (`Scheduler.headroom`).
        vocab_size: prompt token ids must be below it.
    """

    def __init__(self, kv: KVCacheManager, requests: RequestTable, headroom: Callable[[], int],
                 vocab_size: int, backend: TransferBackend, sender: KVSender, layout: KVLayout,
                 lease_s: float, max_lease_s: float, wait_s: float = 0.0,
                 max_wait_s: float = 0.0):  # fmt: skip
        self.kv = kv
        self.requests = requests
        self.headroom = headroom
        self.vocab_size = vocab_size
        self.backend = backend
        self.sender = sender
        self.layout = layout
        self.lease_s = lease_s  # when prep_recv names none
        self.max_lease_s = max_lease_s  # the longest prep_recv may name
        self.wait_s = wait_s  # how long prep_recv waits for pages when it names no wait_s
        self.max_wait_s = max_wait_s  # the longest prep_recv may name
        self._room_when_tried = _NEVER_TRIED  # _room() when the head last did not fit
        self._answers: list[tuple[str, Answer]] = []  # given by the next poll()
        # sampling sends whose transfer completed before their token was resolved
        self._flushed: set[str] = set()
        # send_to calls that overtook their remote_send on the way: (begin, kv_addr, deadline)
        self._addresses: dict[str, tuple[int, KVAddr, float]] = {}
        self.counters = {"kv_leases_expired": 0, "kv_tokens_sent": 0, "kv_tokens_received": 0,
                         "kv_recv_waited": 0, "kv_recv_wait_timeouts": 0}

    # ---- receiver ------------------------------------------------------------------------------

    def prep_recv(self, request_id: str, prompt: list[int], end: int,
                  lease_s: float | None, wait_s: float | None = None
                  ) -> PrepRecvResponse | None:
        """The answer, or None when the call waits for pages: `poll()` answers it later."""
        check_prompt(prompt, self.vocab_size)
        end = resolve_index(end, len(prompt), "end")
        if lease_s is not None and not 0 < lease_s <= self.max_lease_s:
            raise MicroservingError(400, f"lease_s {lease_s} must be in (0, {self.max_lease_s}] "
                                    "(this engine's --kv-lease-max-s)", "lease_s")
        if wait_s is not None and not 0 <= wait_s <= self.max_wait_s:
            raise MicroservingError(400, f"wait_s {wait_s} must be in [0, {self.max_wait_s}] "
                                    "(this engine's --kv-recv-wait-max-s)", "wait_s")
        if self.backend.kind == "none":
            raise MicroservingError(400, "this engine cannot receive KV: it runs with "
                                    "--kv-transfer none, or without an engine key (--api-key)")
        self._check_free(request_id)
        tokens = prompt[:end]
        need, total = self.kv.pages_needed(None, end), self.kv.pool.num_pages
        if need > total:  # never fits: a 400, not a retry-later 503
            raise MicroservingError(
                400, f"end {end}: receiving {end} tokens needs {need} KV pages, but this "
                f"engine's pool has {total} pages", "end")  # fmt: skip
        lease_s = lease_s or self.lease_s
        wait_s = self.wait_s if wait_s is None else wait_s
        if not self.requests.count(RequestState.RECV_WAITING):  # FIFO: nobody overtakes
            answer = self._reserve(request_id, tokens, lease_s)
            if answer is not None:
                return answer
        if wait_s == 0:
            raise MicroservingError(503, f"no KV pages free to receive {end} tokens ({need} "
                                    f"pages; {self.kv.pool.num_free} free)")  # fmt: skip
        self.requests.wait_recv(request_id, WaitingRecv(tokens, lease_s, wait_s,
                                                        time.monotonic() + wait_s, need))
        self.counters["kv_recv_waited"] += 1
        return None

    def _reserve(self, request_id: str, tokens: list[int], lease_s: float
                 ) -> PrepRecvResponse | None:
        """Reserve pages and a window for receiving `tokens`. The engine's own work comes
        first: a page stays free for each running sequence to grow into (the next decode step
        must not preempt for us), and the pages of the first waiting sequence that must be
        computed from scratch (a preempted one, say). None, holding nothing, if they are not
        there now."""
        matched = self.kv.prep_recv(request_id, tokens, headroom=self.headroom())
        if matched is None:
            return None
        window = self.backend.open_window()
        if window is None:
            self.kv.free(request_id)
            return None
        deadline = time.monotonic() + lease_s
        self.requests.reserve(request_id, Reservation(tokens, matched, window, lease_s, deadline))
        end = len(tokens)
        addr = KVAddr(
            begin=matched, end=end, ranges=self.kv.slot_ranges(request_id, matched, end),
            layout=self.layout, transfer=self.backend.descriptor(),
            window=(window.index, window.tag),
        )  # fmt: skip
        return PrepRecvResponse(matched, addr)

    def admit_waiting(self, now: float) -> None:
        """Between steps: give up on calls that waited too long (503), then grant pages to the
        waiting calls in order while they fit. Their answers come from poll()."""
        waiting = self.requests.in_state(RequestState.RECV_WAITING)
        if not waiting:
            return
        for rid, entry in list(waiting.items()):
            w = entry.waiting
            if w.deadline <= now:
                self.requests.finish(rid)
                self.counters["kv_recv_wait_timeouts"] += 1
                self._answers.append((rid, MicroservingError(
                    503, f"waited {w.wait_s:g} s for KV pages to receive {len(w.tokens)} tokens "
                    f"({w.pages} pages; {self.kv.pool.num_free} free, {len(waiting)} more "
                    f"calls waiting); retry later", code="kv_wait_timeout")))
                self._room_when_tried = _NEVER_TRIED  # the head may have changed
        # Retry the head only when more pages are free (or evictable) beyond the running
        # sequences' headroom than when it last did not fit: cheap per step.
        room = self._room()
        if room <= self._room_when_tried:
            self._room_when_tried = room
            return
        for rid, entry in list(waiting.items()):
            answer = self._reserve(rid, entry.waiting.tokens, entry.waiting.lease_s)
            if answer is None:
                self._room_when_tried = self._room()
                return
            self._answers.append((rid, answer))
        self._room_when_tried = _NEVER_TRIED

    def _room(self) -> int:
        return self.kv.pool.num_free + self.kv.cache.num_evictable() - self.headroom()

    def adopt_for_generate(self, request_id: str, prompt: list[int], begin: int,
                           whole: bool = False) -> int:
        """Hold for a new sequence the KV of prompt[:begin]: received under its request_id, or
        already in the prefix cache. Returns how many leading tokens' KV it holds (its initial
        num_computed_tokens). Raises MicroservingError (nothing held) if it is not here.
        `whole`: the prompt's first output token came with its KV (begin = len(prompt)): all
        of it is held, none computed here.
        """
        rid, ps = request_id, self.kv.page_size
        entry = self.requests.get(rid)
        res = None if entry is None else entry.reservation
        if res is None:  # no transfer: the prefix must be cached here
            held = self.kv.open(rid, prompt[: len(prompt) - 1])
            if held < begin:
                self.kv.free(rid)
                raise MicroservingError(
                    400, f"begin {begin} beyond the {held} tokens of this prompt cached on "
                    f"this engine, and no prep_recv was made for request_id {rid!r}", "begin",
                )  # fmt: skip
            return held
        self._check_same_prompt(res, prompt, begin)
        self.backend.close_window(res.window)  # the core makes the request GENERATING
        # At least the last prompt token is computed here (its logits are sampled), unless its
        # token came with the KV. If the reservation's cached part reaches it, drop the pages
        # from there on: they are shared.
        start = min(max(begin, res.matched), len(prompt) - (not whole))
        if start < res.matched:
            start = start // ps * ps
            self.kv.truncate(rid, start // ps)
        self.counters["kv_tokens_received"] += max(0, min(begin, len(res.tokens)) - res.matched)
        self.kv.cache_tokens(rid, prompt[:start])
        return start

    def commit(self, request_id: str, pin: bool) -> CommitResponse:
        """Adopt received KV into the prefix cache without generating (context migration)."""
        entry = self.requests.get(request_id)
        if entry is None or entry.state is not RequestState.RESERVED:
            raise MicroservingError(404, f"no prep_recv reservation for request_id {request_id!r}",
                                    "request_id")  # fmt: skip
        res = entry.reservation
        self._close(request_id, res)
        self.kv.cache_tokens(request_id, res.tokens)
        cached = self.kv.num_cached_pages(request_id) * self.kv.page_size
        if pin and cached:
            self.kv.pin(res.tokens[:cached])
        self.kv.free(request_id)
        self.counters["kv_tokens_received"] += len(res.tokens) - res.matched
        return CommitResponse(cached, bool(pin and cached))

    def expire_leases(self, now: float) -> int:
        """Free reservations whose sender has not renewed them for `lease_s` (nor has one
        since the grant). Returns how many."""
        expired = []
        for rid, entry in self.requests.in_state(RequestState.RESERVED).items():
            r = entry.reservation
            if r.deadline > now:
                continue
            renewed = self.backend.renewed_at(r.window)
            if renewed is not None and renewed + r.lease_s > now:
                r.deadline = renewed + r.lease_s  # looked at again then
            else:
                expired.append((rid, r))
        for rid, res in expired:
            log.warning("KV reservation %r expired after its lease; pages freed", rid)
            self._close(rid, res)
            self.kv.free(rid)
        self.counters["kv_leases_expired"] += len(expired)
        return len(expired) + self._expire_parked(now)

    def forget_address(self, request_id: str) -> bool:
        """Drop a send_to kept for a remote_send that has not come (an abort). True if any."""
        return self._addresses.pop(request_id, None) is not None

    def _expire_parked(self, now: float) -> int:
        """Drop parked sends whose send_to did not come in time (their router is gone, say),
        and kept send_to calls whose remote_send did not come."""
        for rid in [r for r, (_, _, deadline) in self._addresses.items() if deadline <= now]:
            del self._addresses[rid]
        late = [rid for rid, e in self.requests.in_state(RequestState.PARKED).items()
                if e.job.address_by <= now]
        for rid in late:
            log.warning("remote_send %r got no send_to within %g s; its KV dropped", rid,
                        self.lease_s)
            self._drop_send(rid)
            self._answers.append((rid, MicroservingError(
                408, f"no send_to named where to send request {rid!r} within {self.lease_s:g} s "
                "of its remote_send (this engine's --kv-lease-s)", "request_id")))
        return len(late)

    def next_deadline(self) -> float | None:
        """When a lease is next due, a parked send's send_to is late, or a waiting prep_recv
        gives up."""
        reserved = self.requests.in_state(RequestState.RESERVED)
        parked = self.requests.in_state(RequestState.PARKED)
        lease = min([*(e.reservation.deadline for e in reserved.values()),
                     *(e.job.address_by for e in parked.values()),
                     *(deadline for _, _, deadline in self._addresses.values())], default=None)
        waiting = self.requests.in_state(RequestState.RECV_WAITING)
        if not waiting:
            return lease
        wait = min(e.waiting.deadline for e in waiting.values())
        return wait if lease is None else min(lease, wait)

    def _check_same_prompt(self, res: Reservation, prompt: list[int], begin: int) -> None:
        held = len(res.tokens)
        if begin > held:
            raise MicroservingError(
                400, f"begin {begin} beyond the {held} tokens prep_recv reserved for this "
                f"request", "begin")  # fmt: skip
        if prompt[:begin] != res.tokens[:begin]:
            at = next(i for i, (a, b) in enumerate(zip(prompt, res.tokens)) if a != b)
            raise MicroservingError(
                400, f"prompt differs at position {at} from the one prep_recv reserved for "
                f"this request", "prompt")  # fmt: skip

    def _close(self, request_id: str, res: Reservation) -> None:
        """End a reservation: no more writes (its pages stay with request_id; the caller frees
        or caches them)."""
        self.requests.finish(request_id)
        self.backend.close_window(res.window)

    # ---- sender --------------------------------------------------------------------------------

    def remote_send(self, request_id: str, prompt: list[int], begin: int, end: int,
                    kv_addr: KVAddr | None, arrival: int,
                    sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None) -> Sequence | None:
        """Start sending KV of prompt[begin:end]; the answer comes from poll(). Returns the
        send-only sequence (made at `arrival`) that computes the KV not cached here, for the
        caller to schedule; None if all of it was cached (the job is flushing already, or
        parked until send_to when `kv_addr` is None: then begin comes with send_to).

        With `sampling` (and its `generator`) the sequence also samples the first output
        token after the prompt, which the answer carries: end must be the prompt's length,
        and at least the last prompt token is computed here (its logits are sampled)."""
        check_prompt(prompt, self.vocab_size)
        n = len(prompt)
        begin, end = resolve_index(begin, n, "begin"), resolve_index(end, n, "end")
        if begin > end:
            raise MicroservingError(400, f"begin {begin} is after end {end}", "begin")
        if kv_addr is None and begin:
            raise MicroservingError(400, f"begin {begin} without kv_addr: a remote_send that "
                                    "does not know its destination yet gets begin with send_to",
                                    "begin")  # fmt: skip
        if kv_addr is None and request_id in self._addresses:  # its send_to came first
            begin, kv_addr, _ = self._addresses.pop(request_id)
            if begin > end:
                raise MicroservingError(400, f"send_to's begin {begin} is after end {end}",
                                        "begin")  # fmt: skip
        if sampling is not None:
            _check_sampling(sampling, n, end)
        if kv_addr is not None:
            self._check_addr(kv_addr, begin, end)
        self._check_free(request_id)
        matched = self.kv.open(request_id, prompt[:end - 1] if sampling else prompt[:end])
        job = SendJob(begin, end, None, 0, computed=end - matched if matched < end else 0,
                      samples=sampling is not None, matched=matched)
        if kv_addr is None:
            job.address_by = time.monotonic() + self.lease_s
        else:
            try:
                self._address(request_id, job, begin, kv_addr, min(matched, end))
            except BaseException:  # nothing may outlive the refused call
                self.kv.free(request_id)
                raise
        if matched >= end:
            if kv_addr is None:
                self.requests.park(request_id, job)
            else:
                self._flush(request_id, job)
            return None
        seq = Sequence(request_id, prompt[:end], sampling or SamplingParams(max_tokens=1),
                       arrival, num_computed_tokens=matched, num_cached_tokens=matched,
                       send_only=True, send_samples=sampling is not None)
        self.requests.send(request_id, job, seq, generator)
        return seq

    def send_to(self, request_id: str, begin: int, kv_addr: KVAddr) -> SendToResponse:
        """Name the destination of a remote_send made without one: [begin, end) goes to
        `kv_addr`. What this engine holds of it already (cached, or computed by the steps
        launched so far) is queued for writing now; a parked job flushes after it. A send_to
        that overtook its remote_send on the way is kept for it (until the lease runs out)."""
        entry = self.requests.get(request_id)
        if entry is None:
            if request_id in self._addresses:
                raise MicroservingError(409, f"send_to for request_id {request_id!r} was made "
                                        "already", "request_id")  # fmt: skip
            if len(self._addresses) >= MAX_EARLY_ADDRESSES:
                raise MicroservingError(503, f"{len(self._addresses)} send_to calls are waiting "
                                        "for their remote_send already")  # fmt: skip
            deadline = time.monotonic() + self.lease_s
            self._addresses[request_id] = (begin, kv_addr, deadline)
            return SendToResponse(copied=0)
        job = entry.job
        if job is None or job.address_by is None:
            raise MicroservingError(
                404, f"no remote_send waiting for its destination under request_id "
                f"{request_id!r}", "request_id")  # fmt: skip
        if begin > job.end:
            raise MicroservingError(400, f"begin {begin} is after the send's end {job.end}",
                                    "begin")  # fmt: skip
        self._check_addr(kv_addr, begin, job.end)
        parked = entry.state is RequestState.PARKED
        have = job.end if parked else min(entry.seq.num_computed_tokens, job.end)
        self._address(request_id, job, begin, kv_addr, have)
        if parked:
            self._flush(request_id, job)
        return SendToResponse(copied=max(0, have - begin))

    def _address(self, request_id: str, job: SendJob, begin: int, kv_addr: KVAddr,
                 have: int) -> None:
        """Give `job` its destination (a checked `kv_addr` for [begin, job.end)): start the
        transfer job and queue the writes of [begin, have), whose KV this engine holds now."""
        try:
            self.sender.start(request_id, kv_addr.transfer, Window(*kv_addr.window))
        except TransferError as e:
            raise MicroservingError(502, f"cannot reach the receiver: {e}") from None
        dst = slot_tensor(kv_addr.ranges)
        if have > begin:
            try:
                src = slot_tensor(self.kv.slot_ranges(request_id, begin, have))
                self.sender.write_all_layers(request_id, src, dst[:have - begin])
            except BaseException:
                self.sender.cancel(request_id)
                raise
        job.begin, job.dst_slots, job.address_by = begin, dst, None
        job.reused = max(0, min(job.matched, job.end) - begin)

    def sends_for(self, seq: Sequence, start: int, num_new: int) -> KVSend | None:
        """The share of a step's chunk [start, start + num_new) that goes to the receiver."""
        job = self.requests.get(seq.request_id).job
        if job.dst_slots is None:  # no destination yet: send_to copies it later
            return None
        lo, hi = max(start, job.begin), min(start + num_new, job.end)
        if lo >= hi:
            return None
        src = slot_tensor(self.kv.slot_ranges(seq.request_id, lo, hi))
        return KVSend(seq.request_id, src, job.dst_slots[lo - job.begin : hi - job.begin])

    def computed(self, seq: Sequence) -> None:
        """A send's last chunk is computed and its sequence out of the scheduler, pages kept:
        they stay held until the transfer is flushed (or parked until send_to)."""
        rid = seq.request_id
        self.kv.cache_tokens(rid, seq.prompt_token_ids)
        job = self.requests.get(rid).job
        if job.dst_slots is None:
            self.requests.park(rid, job)
        else:
            self._flush(rid, job)

    def _flush(self, request_id: str, job: SendJob) -> None:
        """The job is FLUSHING: the sender flushes its writes, then poll() answers it."""
        self.requests.flush(request_id, job)
        self.sender.finish(request_id)

    def sampled(self, request_id: str, token: int) -> None:
        """A sampling send's first output token is resolved: its answer may go out."""
        entry = self.requests.get(request_id)
        if entry is None or entry.state not in _COMPUTED:  # aborted or failed
            return
        entry.job.first_token = token
        if request_id in self._flushed:  # the transfer was done already
            self._flushed.remove(request_id)
            self._settle(request_id, None)

    def unsampled(self) -> list[str]:
        """The sends computed (flushing or parked) whose sampled token is not resolved yet."""
        return [rid for state in _COMPUTED for rid, e in self.requests.in_state(state).items()
                if e.job.samples and e.job.first_token is None]

    def drop_failed_sends(self) -> list[Sequence]:
        """Stop the sends still computing whose transfer failed (e.g. the receiver died); their
        502 answers come from the next poll(). Returns their sequences, for the caller to take
        out of the scheduler."""
        seqs = []
        for rid, error in self.sender.failed():  # only jobs not yet flushing report here
            seqs.append(self._drop_send(rid))
            self._answers.append((rid, MicroservingError(502, f"KV transfer failed: {error}")))
        return seqs

    def poll(self) -> list[tuple[str, Answer]]:
        """Answers for remote_send calls whose transfer has completed, failed or was aborted,
        and for prep_recv calls that waited and were granted, gave up or were aborted."""
        for rid, error in self.sender.completed():
            entry = self.requests.get(rid)
            if entry is None or entry.state is not RequestState.FLUSHING:  # aborted meanwhile
                continue
            if entry.job.samples and entry.job.first_token is None and error is None:
                self._flushed.add(rid)  # answered when its token is resolved (`sampled`)
                continue
            self._settle(rid, error)
        out: list[tuple[str, Answer]] = list(self._answers)
        self._answers.clear()
        return out

    def _settle(self, request_id: str, error: Exception | None) -> None:
        """A flushed send is done: free its pages, answer it (at the next poll)."""
        job = self.requests.finish(request_id).job
        self.kv.free(request_id)
        if error is not None:
            self._answers.append((request_id,
                                  MicroservingError(502, f"KV transfer failed: {error}")))
            return
        sent = job.end - job.begin
        self.counters["kv_tokens_sent"] += sent
        self._answers.append((request_id, RemoteSendResponse(sent, job.computed, job.reused,
                                                             job.first_token)))

    def _check_addr(self, addr: KVAddr, begin: int, end: int) -> None:
        try:  # first: nothing of an unsigned descriptor is looked at
            transfer = verify(addr.transfer, self.sender.key)
        except TransferAuthError as e:
            raise MicroservingError(400, f"refusing to send: {e}", "kv_addr.transfer") from None
        if addr.num_slots != end - begin:
            raise MicroservingError(
                400, f"kv_addr holds {addr.num_slots} slots but end - begin = {end - begin} "
                f"(begin {begin}, end {end})", "kv_addr")  # fmt: skip
        if (why := self.layout.mismatch(addr.layout)) is not None:
            raise MicroservingError(400, f"refusing to send: {why}", "kv_addr.layout")
        capacity = transfer["num_pages"] * self.layout.page_size
        bad = next(((s, n) for s, n in addr.ranges if s < 0 or n < 1 or s + n > capacity), None)
        if bad is not None:
            raise MicroservingError(
                400, f"kv_addr range {list(bad)} outside the receiver's {capacity} slots",
                "kv_addr.ranges")  # fmt: skip

    # ---- both ----------------------------------------------------------------------------------

    def _check_free(self, request_id: str) -> None:
        if request_id in self.requests:
            raise MicroservingError(409, f"request_id {request_id!r} is already in use",
                                    "request_id")  # fmt: skip

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a waiting prep_recv, a reservation or a send under request_id (GENERATING is
        the core's to abort). Returns the sequence of a send still computing, for the caller
        to take out of the scheduler."""
        entry = self.requests.get(request_id)
        state = None if entry is None else entry.state
        if state is RequestState.RESERVED:
            self._close(request_id, entry.reservation)
            self.kv.free(request_id)
            return None
        if state is RequestState.RECV_WAITING:
            self.requests.finish(request_id)
            self._room_when_tried = _NEVER_TRIED  # the head may have changed
            seq = None
        elif state in (RequestState.SENDING, *_COMPUTED):
            seq = self._drop_send(request_id)
        else:
            raise IllegalTransition(f"request {request_id!r} ({state}) is not the exchange's")
        self._answers.append(
            (request_id, MicroservingError(409, f"request {request_id!r} was aborted"))
        )
        return seq

    def fail_send(self, request_id: str, error: MicroservingError) -> Sequence | None:
        """End a send in flight with `error` (its remote_send answer, at the next poll).
        Returns its sequence if still computing, for the caller to take out of the scheduler."""
        seq = self._drop_send(request_id)
        self._answers.append((request_id, error))
        return seq

    def _drop_send(self, request_id: str) -> Sequence | None:
        """End a send job wherever it is. Frees a flushing job's pages; a computing job's
        sequence is returned (its pages go when it leaves the scheduler)."""
        entry = self.requests.finish(request_id)
        self._flushed.discard(request_id)
        self.sender.cancel(request_id)  # returns once no write reads the pages
        if entry.state in _COMPUTED:
            self.kv.free(request_id)
        return entry.seq

    def stats(self) -> dict:
        return {
            "kv_reservations": self.requests.count(RequestState.RESERVED),
            "kv_recv_waiting": self.requests.count(RequestState.RECV_WAITING),
            "kv_send_jobs": sum(self.requests.count(s) for s in (RequestState.SENDING,
                                                                 *_COMPUTED)),
            **self.counters,
        }


# A send's states once its sequence is done: its pages held by the request, not a sequence.
_COMPUTED = (RequestState.FLUSHING, RequestState.PARKED)


def _check_sampling(sampling: SamplingParams, n: int, end: int) -> None:
    """What a remote_send can sample: the token after the whole prompt, without the options
    that need the generating engine's state (a grammar, logprobs to return, the token history
    behind logit_bias, min_tokens and the penalties)."""
    if end != n:
        raise MicroservingError(
            400, f"a remote_send that samples sends the whole prompt: end must be the prompt "
            f"length {n}, got {end}", "end")  # fmt: skip
    if sampling.grammar is not None or sampling.logprobs is not None:
        raise MicroservingError(
            400, "a remote_send samples no token under a grammar or with logprobs: leave the "
            "last prompt token to the generating engine", "sampling")  # fmt: skip
    if sampling.adjusts_logits:
        raise MicroservingError(
            400, "a remote_send samples no token with logit_bias, min_tokens or penalties: "
            "leave the last prompt token to the generating engine", "sampling")  # fmt: skip


def slot_tensor(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The flat slots of run-length `ranges` [(first slot, count), ...] as an int64 CPU tensor,
    built without a Python int per slot (a 5,000-token send names 5,000 slots). In numpy:
    torch's CPU `repeat_interleave` took ~1.4 ms a call inside the engine on the H100's host
    (py-spy, 2026-11-24; why was not isolated), where numpy's `repeat` takes microseconds."""
    if not ranges:
        return torch.empty(0, dtype=torch.long)
    runs = np.asarray(ranges, dtype=np.int64)
    starts, counts = runs[:, 0], runs[:, 1]
    index_of_first = np.cumsum(counts) - counts  # where each run starts in the output
    slots = np.repeat(starts - index_of_first, counts) + np.arange(int(counts.sum()))
    return torch.from_numpy(slots)
