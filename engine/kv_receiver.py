"""The receiving half of the KV exchange (engine D): reservations and their windows.

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

The receiver decides where KV goes and what it must be: the kv_addr it answers names the
window's slots and the digest of prompt[:end] (auth.kv_digest, from `matched` on), and
is signed whole with the deployment's key, so a sender refuses any other slots or tokens before
a byte moves. The sender seals the window with the digest of the tokens it computed or copied;
start_generate and commit adopt received KV only under the digest the window was reserved for,
and otherwise fail the request and free its pages, so nothing of it enters the prefix cache.

`Receiving` is a half of `engine.kv_exchange.KVExchange`, which sets the attributes it uses
(`kv`, `requests`, `headroom`, `backend`, `layout`, `sender`, `lease_s`, `max_lease_s`,
`wait_s`, `max_wait_s`, `counters`, `_answers`) and the `_room_when_tried` it alone writes.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from engine.requests import RequestState, Reservation, WaitingRecv
from engine.validation import check_prompt, resolve_index
from kvcache.transfer.base import slot_tensor
from microserve.backend import MicroservingError
from microserve.messages import CommitResponse, KVAddr, PrepRecvResponse
from kvcache.transfer.auth import grant_mac, kv_digest

log = logging.getLogger(__name__)

_NEVER_TRIED = -(1 << 62)  # below any _room(): the waiting head is tried at the next chance


class Receiving:
    """prep_recv, its wait for pages, its lease, and what ends a reservation (start_generate's
    adoption, commit). Mixed into KVExchange."""

    def prep_recv(self, request_id: str, prompt: list[int], end: int,
                  lease_s: float | None, wait_s: float | None = None, namespace: int = 0,
                  own: int = 0) -> PrepRecvResponse | None:
        """The answer, or None when the call waits for pages: `poll()` answers it later.
        `namespace`: the LoRA adapter's id (0: the base) whose KV this is: matched and later
        cached in that part of the prefix cache only. `own`: positions [matched, own) this
        engine will hold by itself by adoption (BlockLLM's split migration: the caller has it
        compute prompt[:own] as a request of its own meanwhile); the sender writes from there
        on (`_graft_own`)."""
        check_prompt(prompt, self.vocab_size)
        end = resolve_index(end, len(prompt), "end")
        ps = self.kv.page_size
        if own % ps or not 0 <= own < end:
            raise MicroservingError(400, f"own {own} must be a multiple of the page size {ps} "
                                    f"in [0, end {end})", "own")
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
            answer = self._reserve(request_id, tokens, lease_s, namespace, own)
            if answer is not None:
                return answer
        if wait_s == 0:
            raise MicroservingError(503, f"no KV pages free to receive {end} tokens ({need} "
                                    f"pages; {self.kv.pool.num_free} free)")  # fmt: skip
        self.requests.wait_recv(request_id, WaitingRecv(tokens, lease_s, wait_s,
                                                        time.monotonic() + wait_s, need,
                                                        namespace, own))
        self.counters["kv_recv_waited"] += 1
        return None

    def _reserve(self, request_id: str, tokens: list[int], lease_s: float, namespace: int = 0,
                 own: int = 0) -> PrepRecvResponse | None:
        """Reserve pages and a window for receiving `tokens`. The engine's own work comes
        first: a page stays free for each running sequence to grow into (the next decode step
        must not preempt for us), and the pages of the first waiting sequence that must be
        computed from scratch (a preempted one, say). None, holding nothing, if they are not
        there now."""
        matched = self.kv.prep_recv(request_id, tokens, self.headroom(), namespace)
        if matched is None:
            return None
        end, sent_from = len(tokens), max(matched, own)
        ranges = self.kv.slot_ranges(request_id, sent_from, end)
        window = self.backend.open_window(slot_tensor(ranges))
        if window is None:
            self.kv.free(request_id)
            return None
        deadline = time.monotonic() + lease_s
        digest = kv_digest(tokens, sent_from)
        self.requests.reserve(request_id, Reservation(tokens, matched, window, digest, lease_s,
                                                      deadline, namespace, own))
        addr = KVAddr(
            begin=sent_from, end=end, ranges=ranges, layout=self.layout,
            transfer=self.backend.descriptor(), window=(window.index, window.tag),
            digest=digest.hex(),
        )  # fmt: skip
        addr = dataclasses.replace(addr, mac=grant_mac(addr.grant(), self.sender.key))
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
            w = entry.waiting
            answer = self._reserve(rid, w.tokens, w.lease_s, w.namespace, w.own)
            if answer is None:
                self._room_when_tried = self._room()
                return
            self._answers.append((rid, answer))
        self._room_when_tried = _NEVER_TRIED

    def _room(self) -> int:
        return self.kv.pool.num_free + self.kv.cache.num_evictable() - self.headroom()

    def adopt_for_generate(self, request_id: str, prompt: list[int], begin: int,
                           whole: bool = False, namespace: int = 0) -> int:
        """Hold for a new sequence the KV of prompt[:begin]: received under its request_id, or
        already in the prefix cache. Returns how many leading tokens' KV it holds (its initial
        num_computed_tokens). Raises MicroservingError (nothing held) if it is not here.
        `whole`: the prompt's first output token came with its KV (begin = len(prompt)): all
        of it is held, none computed here. `namespace`: the generation's LoRA adapter (its id;
        0: the base): cached KV is matched there, and a reservation must have been made for
        it (a 400 otherwise, nothing held: KV of other weights is never adopted).
        """
        rid, ps = request_id, self.kv.page_size
        self.host_loaded = 0  # of what it holds, tokens loaded from the host tier (its count)
        entry = self.requests.get(rid)
        res = None if entry is None else entry.reservation
        if res is None:  # no transfer: the prefix must be cached here
            held, loaded = self.kv.open_from_tiers(rid, prompt[: len(prompt) - 1], namespace)
            if held < begin:
                self.kv.free(rid)
                raise MicroservingError(
                    400, f"begin {begin} beyond the {held} tokens of this prompt cached on "
                    f"this engine, and no prep_recv was made for request_id {rid!r}", "begin",
                )  # fmt: skip
            self.host_loaded = loaded
            return held
        if res.namespace != namespace:
            raise MicroservingError(
                400, f"request_id {rid!r} was prepared (prep_recv) for KV of "
                f"{_weights(res.namespace)}, but start_generate is for {_weights(namespace)}: "
                "pass the request's LoRA adapter (lora_name) to prep_recv and remote_send too",
                "lora_name")
        self._check_same_prompt(res, prompt, begin)
        # At least the last prompt token is computed here (its logits are sampled), unless its
        # token came with the KV. If the reservation's cached part reaches it, drop the pages
        # from there on: they are shared.
        start = min(max(begin, res.matched), len(prompt) - (not whole))
        sealed = self.backend.close_window(res.window)  # the core makes it GENERATING
        self._check_sealed(rid, res, sealed, start)
        if start > res.matched and not self._graft_own(rid, res):
            start = res.matched  # its own part is not here: computed again from there on
        if start < res.matched:
            start = start // ps * ps
            self.kv.truncate(rid, start // ps)
        self.counters["kv_tokens_received"] += max(0, min(begin, len(res.tokens)) - res.sent_from)
        self.kv.cache_tokens(rid, prompt[:start])
        return start

    def commit(self, request_id: str, pin: bool) -> CommitResponse:
        """Adopt received KV into the prefix cache without generating (context migration)."""
        entry = self.requests.get(request_id)
        if entry is None or entry.state is not RequestState.RESERVED:
            raise MicroservingError(404, f"no prep_recv reservation for request_id {request_id!r}",
                                    "request_id")  # fmt: skip
        res = entry.reservation
        self._check_sealed(request_id, res, self._close(request_id, res), len(res.tokens))
        # without its own part, what was received cannot be cached (no KV before it)
        self.kv.cache_tokens(request_id, res.tokens if self._graft_own(request_id, res)
                             else res.tokens[: res.matched])
        cached = self.kv.num_cached_pages(request_id) * self.kv.page_size
        if pin and cached:
            self.kv.pin(res.tokens[:cached])
        self.kv.free(request_id)
        self.counters["kv_tokens_received"] += len(res.tokens) - res.sent_from
        return CommitResponse(cached, bool(pin and cached))

    def _expire_reservations(self, now: float) -> int:
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
        return len(expired)

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

    def _graft_own(self, request_id: str, res: Reservation) -> bool:
        """Whether the reservation's own part, [matched, own), is held: put in its place the
        pages the prefix cache holds for it now (computed by a request of this engine's own
        while the peer sent the rest). False, changing nothing, if the cache does not hold all
        of it (evicted, or the request computing it has not finished)."""
        if res.own <= res.matched:
            return True
        ps = self.kv.page_size
        match = self.kv.cache.match(res.tokens[: res.own], res.namespace)
        if match.matched_len < res.own:
            return False
        self.kv.graft(request_id, res.matched // ps, match.pages[res.matched // ps : res.own // ps])
        return True

    def _close(self, request_id: str, res: Reservation) -> bytes | None:
        """End a reservation: no more writes (its pages stay with request_id; the caller frees
        or caches them). Returns the window's seal."""
        self.requests.finish(request_id)
        return self.backend.close_window(res.window)

    def _check_sealed(self, request_id: str, res: Reservation, sealed: bytes | None,
                      upto: int) -> None:
        """The KV of prompt[:upto] is about to be adopted: what was received of it, from
        `res.matched` on, must be sealed with the digest the window was reserved for. If not,
        end the request and free its pages (none entered the prefix cache) and raise a 409."""
        if upto <= res.sent_from or sealed == res.digest:
            return
        if request_id in self.requests:
            self.requests.finish(request_id)
        self.kv.free(request_id)
        where = f"positions [{res.sent_from}, {len(res.tokens)}) of request_id {request_id!r}"
        if sealed is None:
            why = (f"no KV arrived for {where}: no remote_send completed into the window "
                   "prep_recv reserved for them")
        else:
            why = (f"the KV received for {where} was computed for other tokens than the "
                   "prompt prep_recv reserved it for (the sender's digest differs)")
        log.warning("refused received KV: %s", why)
        raise MicroservingError(409, f"{why}; refused, and its pages freed", "request_id",
                                code="kv_refused")



def _weights(namespace: int) -> str:
    return "the base model" if namespace == 0 else f"LoRA adapter id {namespace}"
