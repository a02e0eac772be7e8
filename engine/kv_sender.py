"""The sending half of the KV exchange (engine P): remote_send, send_to and their transfer jobs.

For remote_send(prompt, begin, end, kv_addr):

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

Its abort can overtake it too: the router drops an early send whose receiver has no room
after all, and the abort and the send travel on two connections. An abort that says it is for
an early send (`AbortRequest.early_send`) and finds nothing here is kept (`refuse_ahead`, for
the lease at most): the early remote_send of that id is refused with a 409 when it comes,
holding nothing, and the record goes with it. Only that send is refused: the router's next
calls under the same id (a remote_send with kv_addr, a generation) go through; such a
remote_send clears a record left by an abort that came after its early send had already been
answered (it could not have come before: the router waits for that answer).

A remote_send may bound its wait in this engine's queue (`queue_s`, the router's queue
timeout): one that no step has started on within `queue_s` of the frontend taking the call
(behind other prefills, or behind a long step) fails with a 503, code queue_timeout, its
sequence out of the scheduler and its pages freed (`expire_unstarted`); one the core takes up
only after that is refused at once, holding nothing.

The receiver decides where the KV goes and what it must be: a kv_addr is signed whole by its
receiver (the window, [begin, end), the slots, the digest of the tokens), and a send is refused
with a 400 before anything is opened or computed unless the signature verifies, begin and end
are the kv_addr's and the digest is that of prompt[:end] from begin on. The transfer job then
writes nowhere but the signed slots and seals the window with that digest (`KVSender.start`).

`Sending` is a half of `engine.kv_exchange.KVExchange`, which sets the attributes it uses
(`kv`, `requests`, `vocab_size`, `sender`, `layout`, `lease_s`, `counters`, `_answers`) and
the `_flushed`, `_addresses` and `_refused` it alone writes.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.requests import RequestState, SendJob
from engine.sequence import Sequence
from engine.validation import check_prompt, resolve_index
from kvcache.forward import KVSend
from kvcache.transfer import TransferError, Window
from kvcache.transfer.base import slot_tensor
from microserve.backend import MicroservingError
from microserve.messages import (KVAddr, RemoteSendResponse, SamplingParams,
                                 SendToResponse)
from kvcache.transfer.auth import TransferAuthError, kv_digest, verify, verify_grant

log = logging.getLogger(__name__)

MAX_EARLY_ADDRESSES = 4096  # send_to calls (and aborts) kept for a remote_send on its way
# A send's states once its sequence is done: its pages held by the request, not a sequence.
COMPUTED = (RequestState.FLUSHING, RequestState.PARKED)


class Sending:
    """remote_send, send_to and the life of their transfer jobs up to the answer. Mixed into
    KVExchange."""

    def remote_send(self, request_id: str, prompt: list[int], begin: int, end: int,
                    kv_addr: KVAddr | None, arrival: int,
                    sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None,
                    received_at: float | None = None,
                    queue_s: float | None = None, priority: int = 0,
                    lora_id: int = 0) -> Sequence | None:
        """Start sending KV of prompt[begin:end]; the answer comes from poll(). Returns the
        send-only sequence (made at `arrival`) that computes the KV not cached here, for the
        caller to schedule; None if all of it was cached (the job is flushing already, or
        parked until send_to when `kv_addr` is None: then begin comes with send_to).

        With `sampling` (and its `generator`) the sequence also samples the first output
        token after the prompt, which the answer carries: end must be the prompt's length,
        and at least the last prompt token is computed here (its logits are sampled).
        `queue_s`: a step must start on it within this long of `received_at` (the caller's
        time.perf_counter() when the call came; default now), else a 503 (queue_timeout);
        raised here, holding nothing, if that time has passed already. `lora_id`: the LoRA
        adapter (0: the base) the KV is computed with, and reused from the cache under."""
        # An abort kept for an early send is that send's. Any other remote_send of the id
        # comes after it (the router waits for the early send's answer first): the early send
        # came before the abort, and the record is stale.
        if self._refused.pop(request_id, None) is not None and kv_addr is None:
            raise MicroservingError(409, f"request {request_id!r} was aborted")
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
        tokens = prompt[:end]
        digest = None if kv_addr is None else self._check_addr(kv_addr, begin, tokens)
        self._check_free(request_id)
        waited = 0.0 if received_at is None else time.perf_counter() - received_at
        if queue_s is not None and waited > queue_s:  # the core took it up too late
            self.counters["kv_send_queue_timeouts"] += 1
            raise queue_timeout(request_id, queue_s)
        # a prefix on the host tier is loaded too; the transfer thread reads the pages
        matched, loaded = self.kv.open_from_tiers(request_id, tokens[:-1] if sampling else tokens,
                                                  lora_id)
        if loaded:
            self.kv.settle_copies()
        job = SendJob(tokens, begin, end, None, 0, computed=end - matched if matched < end else 0,
                      samples=sampling is not None, matched=matched)
        if received_at is not None:
            job.received_at = received_at
        if queue_s is not None:
            job.start_by, job.queue_s = time.monotonic() + queue_s - waited, queue_s
        if kv_addr is None:
            job.address_by = time.monotonic() + self.lease_s
        else:
            try:
                self._address(request_id, job, begin, kv_addr, digest, min(matched, end))
            except BaseException:  # nothing may outlive the refused call
                self.kv.free(request_id)
                raise
        if matched >= end:
            if kv_addr is None:
                self.requests.park(request_id, job)
            else:
                self._flush(request_id, job)
            return None
        seq = Sequence(request_id, tokens, sampling or SamplingParams(max_tokens=1),
                       arrival, priority, num_computed_tokens=matched, num_cached_tokens=matched,
                       send_only=True, send_samples=sampling is not None, lora_id=lora_id,
                       num_host_cached_tokens=loaded)
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
        digest = self._check_addr(kv_addr, begin, job.tokens)
        parked = entry.state is RequestState.PARKED
        have = job.end if parked else min(entry.seq.num_computed_tokens, job.end)
        self._address(request_id, job, begin, kv_addr, digest, have)
        if parked:
            self._flush(request_id, job)
        return SendToResponse(copied=max(0, have - begin))

    def _address(self, request_id: str, job: SendJob, begin: int, kv_addr: KVAddr,
                 digest: bytes, have: int) -> None:
        """Give `job` its destination (a checked `kv_addr` for [begin, job.end), whose KV is of
        `digest`): start the transfer job, which writes nowhere but the kv_addr's slots, and
        queue the writes of [begin, have), whose KV this engine holds now."""
        dst = slot_tensor(kv_addr.ranges)
        try:
            self.sender.start(request_id, kv_addr.transfer, Window(*kv_addr.window), dst, digest)
        except TransferError as e:
            raise MicroservingError(502, f"cannot reach the receiver: {e}") from None
        if have > begin:
            try:
                src = torch.from_numpy(self.kv.slots(request_id, begin, have))
                self.sender.write_all_layers(request_id, src, dst[:have - begin])
            except BaseException:
                self.sender.cancel(request_id)
                raise
        job.begin, job.dst_slots, job.address_by = begin, dst, None
        job.reused = max(0, min(job.matched, job.end) - begin)

    def sends_for(self, seq: Sequence, start: int, num_new: int) -> KVSend | None:
        """The share of a step's chunk [start, start + num_new) that goes to the receiver."""
        job = self.requests.get(seq.request_id).job
        job.last_step_at = time.perf_counter()
        if job.first_step_at is None:
            job.first_step_at = job.last_step_at
        if job.dst_slots is None:  # no destination yet: send_to copies it later
            return None
        lo, hi = max(start, job.begin), min(start + num_new, job.end)
        if lo >= hi:
            return None
        src = torch.from_numpy(self.kv.slots(seq.request_id, lo, hi))
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
        if entry is None or entry.state not in COMPUTED:  # aborted or failed
            return
        entry.job.first_token = token
        entry.job.computed_at = time.perf_counter()
        if request_id in self._flushed:  # the transfer was done already
            self._flushed.remove(request_id)
            self._settle(request_id, None)

    def unsampled(self) -> list[str]:
        """The sends computed (flushing or parked) whose sampled token is not resolved yet."""
        return [rid for state in COMPUTED for rid, e in self.requests.in_state(state).items()
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

    def await_flushes(self, request_ids: list[str], timeout_s: float) -> None:
        """Wait up to `timeout_s` for the transfers of those sends of `request_ids` whose last
        step has run (they are flushing; their token, if they sample one, read back), so that
        the next poll() answers them. Called by an asynchronous core after a step's outputs,
        the next step running on the device meanwhile: without it an answer waits for that
        step too, as the step's copy lands a few ms after the step."""
        ready = []
        for rid in request_ids:
            entry = self.requests.get(rid)
            if (entry is not None and entry.state is RequestState.FLUSHING
                    and (not entry.job.samples or entry.job.first_token is not None)):
                ready.append(rid)
        if ready:
            self.sender.wait_flushed(ready, timeout_s)

    def _settle_completed(self) -> None:
        """Settle the sends whose transfer completed or failed since the last call."""
        for rid, error in self.sender.completed():
            entry = self.requests.get(rid)
            if entry is None or entry.state is not RequestState.FLUSHING:  # aborted meanwhile
                continue
            if entry.job.samples and entry.job.first_token is None and error is None:
                self._flushed.add(rid)  # answered when its token is resolved (`sampled`)
                continue
            if not entry.job.samples:
                entry.job.computed_at = time.perf_counter()  # its KV has landed
            self._settle(rid, error)

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
        self._answers.append((request_id, RemoteSendResponse(
            sent, job.computed, job.reused, job.first_token, job.timing())))

    def _check_addr(self, addr: KVAddr, begin: int, tokens: list[int]) -> bytes:
        """Refuse (400) a kv_addr this engine may not write: not signed by a receiver of the
        deployment (the descriptor, then the grant: nothing of an unsigned kv_addr is looked
        at), for other positions than [begin, len(tokens)), another layout, or KV of other
        tokens. Returns the digest the transfer job seals the window with."""
        try:
            transfer = verify(addr.transfer, self.sender.key)
        except TransferAuthError as e:
            raise MicroservingError(400, f"refusing to send: {e}", "kv_addr.transfer") from None
        if not verify_grant(addr.grant(), addr.mac, self.sender.key):
            raise MicroservingError(
                400, f"refusing to send: kv_addr's ranges {_ranges_text(addr.ranges)} for "
                f"window {addr.window[0]} are not what its receiver reserved (the receiver's "
                "signature over begin, end, ranges, window and digest does not verify): pass "
                "the prep_recv answer's kv_addr unchanged", "kv_addr.ranges")  # fmt: skip
        end = len(tokens)
        if (addr.begin, addr.end) != (begin, end):
            raise MicroservingError(
                400, f"kv_addr reserves positions [{addr.begin}, {addr.end}) but the send "
                f"covers [{begin}, {end}) (begin {begin}, end {end})", "kv_addr")  # fmt: skip
        if (why := self.layout.mismatch(addr.layout)) is not None:
            raise MicroservingError(400, f"refusing to send: {why}", "kv_addr.layout")
        capacity = transfer["num_pages"] * self.layout.page_size
        bad = next(((s, n) for s, n in addr.ranges if s < 0 or n < 1 or s + n > capacity), None)
        if bad is not None:
            raise MicroservingError(
                400, f"kv_addr range {list(bad)} outside the receiver's {capacity} slots",
                "kv_addr.ranges")  # fmt: skip
        digest = kv_digest(tokens, begin)
        if digest.hex() != addr.digest:
            raise MicroservingError(
                400, f"refusing to send: kv_addr's window {addr.window[0]} was reserved for "
                f"another prompt (the digest of prompt[:{end}] differs from the one its "
                "receiver signed): its KV would be served for tokens it was not computed "
                "from", "prompt")  # fmt: skip
        return digest

    def expire_unstarted(self, now: float) -> list[Sequence]:
        """Fail the sends no step has started on by their queue time (their 503 answers come
        from the next poll()). Returns their sequences, for the caller to take out of the
        scheduler; their pages go with them."""
        late = [rid for rid, e in self.requests.in_state(RequestState.SENDING).items()
                if e.job.start_by is not None and e.job.first_step_at is None
                and e.job.start_by <= now]
        self.counters["kv_send_queue_timeouts"] += len(late)
        return [self.fail_send(rid, queue_timeout(rid, self.requests.get(rid).job.queue_s))
                for rid in late]

    def _start_deadlines(self) -> list[float]:
        """The queue-time deadlines of the sends no step has started on."""
        return [e.job.start_by for e in self.requests.in_state(RequestState.SENDING).values()
                if e.job.start_by is not None and e.job.first_step_at is None]

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
        if entry.state in COMPUTED:
            self.kv.free(request_id)
        return entry.seq

    def forget_address(self, request_id: str) -> bool:
        """Drop a send_to kept for a remote_send that has not come (an abort). True if any."""
        return self._addresses.pop(request_id, None) is not None

    def refuse_ahead(self, request_id: str) -> None:
        """An abort for an early remote_send (no kv_addr) that has not come, under an id
        unknown here: keep it, so that the send is refused when it comes (until the lease
        runs out; a 503 if too many are kept)."""
        if len(self._refused) >= MAX_EARLY_ADDRESSES:
            raise MicroservingError(503, f"{len(self._refused)} aborts are waiting for their "
                                    "remote_send already")  # fmt: skip
        self._refused[request_id] = time.monotonic() + self.lease_s

    def _expire_parked(self, now: float) -> int:
        """Drop parked sends whose send_to did not come in time (their router is gone, say),
        and kept send_to calls and aborts whose remote_send did not come."""
        for rid in [r for r, (_, _, deadline) in self._addresses.items() if deadline <= now]:
            del self._addresses[rid]
        for rid in [r for r, deadline in self._refused.items() if deadline <= now]:
            del self._refused[rid]
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


def queue_timeout(request_id: str, queue_s: float) -> MicroservingError:
    """The 503 of a call no step started on within its queue_s (a send's, a generation's)."""
    return MicroservingError(
        503, f"waited {queue_s:g} s for this engine to start computing request {request_id!r} "
        "(its queue_s): it is busy; retry later", code="queue_timeout")  # fmt: skip


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    """`ranges` for a message: the first four, and how many there are if more."""
    shown = [[slot, count] for slot, count in ranges[:4]]
    return str(shown) if len(ranges) <= 4 else f"{str(shown)[:-1]}, ...] ({len(ranges)} ranges)"


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
