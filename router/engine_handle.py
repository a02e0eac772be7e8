"""One engine as the router's strategies use it: `EngineHandle`, made and kept by the pool
(router/engines.py).

An engine handle wraps the microserving client (microserve/microserving_client.py) with what
the router needs around each call: it records the engine in `request.touched` (so a failed
request is aborted everywhere it went), counts the calls open on the engine (the load
`least_loaded` reads), keeps the prefix index up to date, and marks the engine down when it
cannot be reached.

A remote_send is watched from both ends: if an engine the request touched (its receiver) goes
down while the sender works, the call is given up at once (BackendUnavailable), and the router's
abort then stops the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from microserve.backend import BackendUnavailable, MicroservingError
from microserve.messages import (
    AbortRequest,
    CommitRequest,
    CommitResponse,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    KVAddr,
    LoadLoraRequest,
    LoadLoraResponse,
    PinRequest,
    UnloadLoraRequest,
    UnloadLoraResponse,
    PinResponse,
    PrepRecvRequest,
    PrepRecvResponse,
    RemoteSendRequest,
    RemoteSendResponse,
    SendToRequest,
    UnpinRequest,
)
from microserve.microserving_client import EngineClient, SlowAnswer
from router.handover import now
from router.stream_watch import StreamWatch

if TYPE_CHECKING:
    from router.engines import EnginePool, EngineSpec
    from router.strategy import Request

ENDS_WINDOW_S = 5.0  # ends_per_s counts the calls that ended this many seconds back


class EngineHandle:
    """One engine as strategies use it. Safe to share between requests."""

    def __init__(self, spec: EngineSpec, client: EngineClient, pool: EnginePool,
                 source: str = "static"):
        self.spec = spec
        self.added_role = spec.role  # the role it joined with (flips change spec.role only)
        self.source = source  # how it joined: "static", "admin" or "dns:NAME"
        self.client = client
        self._pool = pool
        self.info: EngineInfo | None = None  # set by the pool when the engine first answers
        self.load: EngineStats | None = None  # its last stats; set by the pool's poller
        self.up = False  # set by the pool: answered its last poll, no call failed since
        # set by the pool: proved itself alive (and holding the key) in its last liveness
        # probe; the pool sends nothing with the key to an engine that is not
        self.live = False
        self.draining = False  # set by the admin API: finishes its requests, gets no new ones
        self.down_reason = "not polled yet"  # set with up = False
        # Open calls from this router, by kind; written by this handle's methods only (but
        # open_receives: by the sender's send_prompt).
        self.open_sends = 0
        self.open_generations = 0
        # P/D requests and migrations headed here: counted from the moment this engine was
        # picked as their receiver (send_prompt) until their generation opens. Without it, a
        # D picked while P computes looked idle for that second, and the next requests picked
        # it too (2P2D on four H200s: one D took the bursts, TPOT p99 41 ms against 18 on 1P1D)
        self.open_receives = 0
        self.pending_prefill_tokens = 0  # prompt tokens of open calls not yet computed here
        # LoRA adapter -> generations of it open here: fresher than the polled stats' resident
        # adapters (router/affinity.py); an adapter leaves when its count drops to 0
        self.open_adapters: Counter[str] = Counter()
        self._ends: deque[float] = deque()  # when its sends and generations ended, lately

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def open_calls(self) -> int:
        return self.open_sends + self.open_generations + self.open_receives

    @property
    def decoding(self) -> int:
        """Sequences generating here from this router's calls, and those whose KV is on its
        way here (they generate here next)."""
        return self.open_generations + self.open_receives

    @property
    def seats(self) -> int | None:
        """Sequences it runs at once (its --max-num-seqs); None until its info came."""
        return None if self.info is None else self.info.max_num_seqs

    def ends_per_s(self) -> float:
        """Sends and generations from this router that ended here per second, over the
        last ENDS_WINDOW_S: the rate its seats free up."""
        self._forget_ends(time.monotonic())
        return len(self._ends) / ENDS_WINDOW_S

    def _ended(self) -> None:
        now_s = time.monotonic()
        self._ends.append(now_s)
        self._forget_ends(now_s)

    def _forget_ends(self, now_s: float) -> None:
        while self._ends and self._ends[0] < now_s - ENDS_WINDOW_S:
            self._ends.popleft()

    @property
    def routable(self) -> bool:
        return self.up and not self.draining

    def serves(self, role: str | None) -> bool:
        return role is None or self.role in (role, "any")

    @property
    def receives_kv(self) -> bool:
        """Whether it can be the D of P/D: it runs a KV transfer (not `--kv-transfer none`).
        Unknown until its info came: assumed."""
        return self.info is None or self.info.kv_transfer != "none"

    @property
    def sends_kv(self) -> bool:
        """Whether it can be the P of P/D: any engine, but a tensor-parallel one only with a
        KV transfer (its ranks' pools are exported for it)."""
        return (self.info is None or self.info.tensor_parallel_size == 1
                or self.info.kv_transfer != "none")

    def __repr__(self) -> str:
        return f"<engine {self.name} {self.role} {self.url}>"

    # -- microserving calls ---------------------------------------------------------------------

    async def prep_recv(self, request: Request, end: int = -1, lease_s: float | None = None,
                        wait_s: float | None = None, own: int | None = None
                        ) -> PrepRecvResponse:
        """Reserve this engine's slots for `request.prompt[matched:end]` (see EngineClient).
        Waits its turn for free pages up to `wait_s` (default: the pool's queue_timeout_s).
        `own`: positions before it this engine will hold by itself (router/split_migration.py);
        the sender then writes from there on."""
        self._touch(request)
        if wait_s is None:
            wait_s = self._pool.queue_timeout_s
        started = now()
        answer = await self._call(PrepRecvRequest(request.request_id, request.prompt, end,
                                                  lease_s, wait_s, request.adapter, own))
        request.timeline.prep_recv_s = now() - started
        self._pool.prefix_index.forget(request.prompt[:end], self.name, answer.matched,
                                       request.adapter)
        return answer

    async def remote_send(self, request: Request, begin: int, end: int, kv_addr: KVAddr | None,
                          sample: bool = False) -> RemoteSendResponse:
        """Make this engine put the KV of `prompt[begin:end]` into `kv_addr` (another engine's
        reservation); returns once every byte landed there. `sample` (end = len(prompt)):
        it also samples the first output token with the request's params (`first_token`).
        `kv_addr` None (begin 0): the engine computes at once and sends once `send_to` named
        where (the receiver must be in `request.touched` before this is called: it is
        watched). A send this engine has not started computing within the pool's
        queue_timeout_s fails with a 503 (code queue_timeout)."""
        self._touch(request)
        tokens = _span(len(request.prompt), begin, end)
        # The receivers, and this engine itself: a sender cut off mid-send never answers.
        watched = [n for n in request.touched if n != self.name] + [self.name]
        self.open_sends += 1
        self.pending_prefill_tokens += tokens
        started = now()
        try:
            answer = await self._pool.unless_down(
                watched, self._call(RemoteSendRequest(
                    request.request_id, request.prompt, begin, end, kv_addr,
                    request.sampling if sample else None, self._pool.queue_timeout_s,
                    request.priority, request.adapter)),
                f"while engine {self.name} was sending it KV for request {request.request_id}")
        finally:
            self.open_sends -= 1
            self._ended()
            self.pending_prefill_tokens -= tokens
        self._pool.prefix_index.insert(request.prompt[:end], self.name, request.adapter)
        request.settled.add(self.name)  # a sender holds nothing once its send is done
        request.received_tokens += answer.sent
        request.peer_cached_tokens += answer.reused
        request.timeline.sent(now() - started, answer.timing)
        return answer

    async def send_to(self, request: Request, begin: int, kv_addr: KVAddr) -> None:
        """Name where this engine's remote_send of `request`, made without kv_addr, sends
        [begin, end)."""
        self._touch(request)
        await self._call(SendToRequest(request.request_id, begin, kv_addr))

    async def send_prompt(self, request: Request, receiver: EngineHandle, early: bool = True,
                          end: int | None = None) -> tuple[int, int | None]:
        """Put the KV of the prompt (all but its last token, or all of it with the first
        output token sampled here when `request.first_token_travels`) on `receiver`, which
        lacks it, as P/D and context migration do: receiver.prep_recv, then this engine's
        remote_send. Returns (begin, first_token) for `receiver.start_generate`. `end` < the
        prompt's length: only prompt[:end] (balanced P/D's head; nothing sampled here), and
        begin is `end`, sent or found whole in the receiver's cache.

        `early` (the default): this engine starts computing at once, beside the receiver's
        prep_recv, and is told where to send when that answers (remote_send without kv_addr,
        then send_to), so the prep_recv round trip is off the request's path. Only when the
        receiver has pages free now: if it must wait for them, or already holds the whole
        prompt, the early send is dropped and the calls go one after the other."""
        n = len(request.prompt)
        if end is None:
            end = n if request.first_token_travels else n - 1
        elif not 0 < end < n:
            raise ValueError(f"a head of {end} tokens is not within a prompt of {n}")
        receiver.open_receives += 1
        try:
            return await self._send_prompt(request, receiver, early, end)
        finally:
            receiver.open_receives -= 1

    async def _send_prompt(self, request: Request, receiver: EngineHandle, early: bool,
                           end: int) -> tuple[int, int | None]:
        n = len(request.prompt)
        if early and _room_now(receiver, end) and (
                self._pool.prefix_index.match(request.prompt, request.adapter).get(
                    receiver.name, 0) < end):
            sent = await self._send_early(request, receiver, end)
            if sent is not None:
                return sent
        recv = await receiver.prep_recv(request, end=end)
        if recv.matched >= end:  # the receiver holds it all: it computes the last token
            return min(end, n - 1), None
        sent = await self.remote_send(request, recv.matched, end, recv.kv_addr,
                                      sample=end == n)
        return end, sent.first_token

    async def _send_early(self, request: Request, receiver: EngineHandle, end: int
                          ) -> tuple[int, int | None] | None:
        """send_prompt's early start; None if it fell through (nothing held for it then)."""
        n = len(request.prompt)
        receiver._touch(request)  # watched by the send from its start
        sending = asyncio.ensure_future(self.remote_send(request, 0, end, None, sample=end == n))
        try:
            try:
                recv = await receiver.prep_recv(request, end=end, wait_s=0)
            except MicroservingError as e:
                if e.status != 503:
                    raise
                recv = None  # no pages free there now: it waits its turn, this engine idle
            if sending.done():  # refused, or this engine failed: nothing to send to
                sending.result()
            if recv is not None and recv.matched < end:
                await self.send_to(request, recv.matched, recv.kv_addr)
                return end, (await sending).first_token
            await self._drop(request, sending)
            return None if recv is None else (min(end, n - 1), None)
        finally:
            if not sending.done():  # closing the call makes the engine abort the send
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)

    async def _drop(self, request: Request, sending: asyncio.Future) -> None:
        """Abort the early send in flight as `sending`, once, and wait for its answer, so it
        is gone before the request's next call here reuses its id. The abort says it is for
        an early send: if it overtook the send on the way, the engine refuses the send when
        it comes (AbortRequest.early_send)."""
        if not sending.done():
            await self.abort(request, early_send=True)
        with contextlib.suppress(MicroservingError):  # the send's answer to it: a 409
            await sending

    async def start_generate(self, request: Request, begin: int = 0,
                             first_token: int | None = None, emit_first: bool = True
                             ) -> AsyncIterator[GenerateChunk]:
        """Prefill `prompt[begin:]` here and decode: the engine's chunks as they come.
        `first_token`: the first output, sampled by the engine that sent the whole prompt's
        KV (`send_prompt`); the engine emits it at once and decodes on.

        With `emit_first` (the default) a handed-over first token that does not end the
        request is yielded before this engine is called, so the client has it one round trip
        sooner; the engine is told so (`first_token_delivered`) and its stream goes on from the
        next token, so the token travels to the client once. The price: if this engine fails
        before its first chunk, the request has produced output and the router does not try
        it again (it ends with the error, as a failure after any token does).

        A generation this engine has not started computing within the pool's queue_timeout_s
        fails with a 503 (code queue_timeout), as a send does."""
        self._touch(request)
        if not self.live:  # a strategy that picked it before it went down
            raise self._not_live()
        request.generating_on = self.name
        early = emit_first and first_token is not None and not self._stops(request, first_token)
        if early:  # as this engine would report it: it holds prompt[:begin] already
            yield GenerateChunk([first_token], cached_tokens=begin)
        prefill = _span(len(request.prompt), begin, len(request.prompt))
        self.open_generations += 1
        if request.adapter is not None:
            self.open_adapters[request.adapter] += 1
        self.pending_prefill_tokens += prefill
        chunks = self.client.start_generate(request.request_id, request.prompt, begin,
                                            request.sampling, first_token,
                                            self._pool.queue_timeout_s, priority=request.priority,
                                            first_token_delivered=early)
        request.timeline.generate_started = now()
        watch = StreamWatch(self, self._pool.down_event(self.name))
        try:
            async for chunk in watch.chunks(chunks, f"engine {self.name} went down while "
                                                    f"generating {request.request_id}"):
                if request.timeline.first_chunk is None:
                    request.timeline.first_chunk = now()
                self.pending_prefill_tokens -= prefill
                prefill = 0
                if chunk.finish_reason is not None:
                    self._pool.prefix_index.insert(request.prompt, self.name, request.adapter)
                    request.settled.add(self.name)
                yield chunk
        except BackendUnavailable as e:
            # Not when it is down already: then this is the watch's error, and the pool's
            # reason (the probe's) says why.
            if self.up and not isinstance(e, SlowAnswer):
                self._pool.mark_down(self, str(e))
            raise
        finally:
            await watch.aclose()
            await chunks.aclose()
            self.open_generations -= 1
            self._ended()
            if request.adapter is not None:
                self.open_adapters[request.adapter] -= 1
                if not self.open_adapters[request.adapter]:
                    del self.open_adapters[request.adapter]
            self.pending_prefill_tokens -= prefill

    async def commit(self, request: Request, pin: bool = False) -> CommitResponse:
        """Adopt the KV received for `request` into this engine's prefix cache."""
        self._touch(request)
        answer = await self._call(CommitRequest(request.request_id, pin))
        request.settled.add(self.name)
        self._pool.prefix_index.insert(request.prompt[:answer.cached], self.name,
                                       request.adapter)
        return answer

    async def abort(self, request: Request, early_send: bool = False) -> bool:
        """Drop whatever this engine holds for `request`. False if it held nothing.
        `early_send`: the abort is for a remote_send without kv_addr that may not have come
        yet, which the engine then refuses when it does (AbortRequest.early_send)."""
        return (await self._call(AbortRequest(request.request_id, early_send))).aborted

    async def pin(self, prompt: list[int]) -> PinResponse:
        return await self._call(PinRequest(prompt))

    async def unpin(self, prompt: list[int]) -> PinResponse:
        return await self._call(UnpinRequest(prompt))

    async def load_lora(self, name: str, path: str) -> LoadLoraResponse:
        return await self._call(LoadLoraRequest(name, path))

    async def unload_lora(self, name: str) -> UnloadLoraResponse:
        return await self._call(UnloadLoraRequest(name))

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name here: by its last polled stats (before the
        first poll, those it started with)."""
        if self.load is not None:
            return self.load.lora_registered
        return self.info.lora_adapters if self.info is not None else []

    # -- plumbing -------------------------------------------------------------------------------

    def _stops(self, request: Request, token: int) -> bool:
        """Whether `token` ends the request (an eos of this engine's model, a stop token)."""
        eos = self.info.eos_token_ids if self.info is not None else ()
        return request.sampling.stops_on(token, eos)

    def _not_live(self) -> BackendUnavailable:
        return BackendUnavailable(f"engine {self.name} is down ({self.down_reason}): it gets "
                                  "no call until it answers its liveness probe again")

    def _touch(self, request: Request) -> None:
        """A call for `request` goes out: this engine may hold something for it until the
        call finishes."""
        request.touched.add(self.name)
        request.settled.discard(self.name)

    async def _call(self, body):
        """The call whose request `body` is (microserve.messages.CALLS), made on this engine."""
        if not self.live:  # not proved since it went down: nothing goes there with the key
            raise self._not_live()
        try:
            return await self.client.call(body)
        except SlowAnswer:  # busy, or gone: the liveness probe tells which
            raise
        except BackendUnavailable as e:
            self._pool.mark_down(self, str(e))
            raise


def _room_now(receiver: EngineHandle, tokens: int) -> bool:
    """Whether, by its last polled stats, `receiver` can reserve `tokens` at once: no prep_recv
    waits in its line (a new one would queue behind), and enough pages free or evictable."""
    load, info = receiver.load, receiver.info
    if load is None or info is None:
        return True  # not polled yet: prep_recv with wait_s 0 answers the question
    room = (load.kv_pages_free + load.kv_pages_cached) * info.page_size
    return load.kv_recv_waiting == 0 and room >= tokens


def _span(n: int, begin: int, end: int) -> int:
    """len(range(n)[begin:end]) without building it."""
    return len(range(*slice(begin, end).indices(n)))
