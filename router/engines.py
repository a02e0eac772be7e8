"""The router's engines: one handle per engine, and the pool strategies pick them from.

    engine = engines.round_robin()                 # any role, skipping engines down or draining
    d = engines.least_loaded("decode")             # fewest calls open from this router, then
                                                   # the engine's own running + waiting
    p = engines.pick("prefill", exclude=(d.name,)) # the same, or None if no such engine is up
    p, d = engines.prefill_decode()                # a P/D pair, degrading when a role is down
    p = engines["p0"]                              # by name
    engines.prefix_index.match(request.prompt)     # which engine holds how much of the prompt

An engine handle wraps the microserving client (microserve/microserving_client.py) with what
the router needs around each call: it records the engine in `request.touched` (so a failed
request is aborted everywhere it went), counts the calls open on the engine (the load
`least_loaded` reads), keeps the prefix index up to date, and marks the engine down when it
cannot be reached.

Health and load are two probes, each `poll_interval_s`, each engine's on its own (a slow
answer from one holds up no other):

    liveness  GET /microserving/live?challenge=R   no key sent; answered by the engine's event
              loop at once, whatever its core does    -> down if no answer within
              `liveness_timeout_s`, no proof that it holds the engine key, or its core silent
              (no heartbeat) that long: a dead, stopped or hung engine, found in seconds
    stats     GET /microserving/stats (with the key) -> `handle.load`; answered between the
              core's steps, so a busy core answers late: that is load, never a reason to be down

An engine marked down (by the probe, or by a call that could not reach it) comes back when it
proves itself alive again and then answers its stats. The engine key goes only to engines that
proved they hold it, in their last probe: `add` checks the proof before its first keyed call,
and an engine that went down gets no keyed call (a stats poll, a strategy's or the admin API's
call) until it proved it again.

Roles: "prefill", "decode", or "any" (both). Asking for a role gives the engines of that role
and the "any" ones. A role is a routing preference, not a limit: every engine can prefill and
decode, so `prefill_decode` lets a decode engine serve a whole request when no prefill engine is
up, and any engine serve it when no decode engine is (counted in
microserve_router_pd_fallbacks_total).

A remote_send is watched from both ends: if an engine the request touched (its receiver) goes
down while the sender works, the call is given up at once (BackendUnavailable), and the router's
abort then stops the sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgspec

from microserve.backend import BackendUnavailable, MicroservingError
from microserve.messages import (
    AbortRequest,
    CommitRequest,
    CommitResponse,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    KVAddr,
    PinRequest,
    PinResponse,
    PrepRecvRequest,
    PrepRecvResponse,
    RemoteSendRequest,
    RemoteSendResponse,
    SendToRequest,
    UnpinRequest,
)
from microserve.auth import proves_key
from microserve.metrics import Registry
from microserve.microserving_client import EngineClient, SlowAnswer
from router.handover import now
from router.prefix_index import PrefixIndex
from router.stream_watch import StreamWatch

if TYPE_CHECKING:
    from router.strategy import Request

log = logging.getLogger("microserve.router")

ROLES = ("any", "prefill", "decode")
LIVENESS_TIMEOUT_S = 5.0  # the default: an engine silent this long is down
# Facts every engine of one pool must share: one model, one token space, one KV page size.
SAME_IN_POOL = ("model_name", "vocab_size", "page_size", "dtype")


class NotVerified(ValueError):
    """What answers at an engine's URL did not prove it is an engine holding the deployment's
    engine key (a 400 in the admin API): it gets nothing sent with the key."""


class UnknownEngine(KeyError):
    """No engine of that name in the pool: a 404 in the admin API."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class EngineSpec:
    name: str
    url: str
    role: str = "any"

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"engine name {self.name!r} must be non-empty and have no '/'")
        if self.role not in ROLES:
            raise ValueError(f"engine {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine {self.name!r}: url {self.url!r} must start with http://")


class EngineHandle:
    """One engine as strategies use it. Safe to share between requests."""

    def __init__(self, spec: EngineSpec, client: EngineClient, pool: EnginePool,
                 source: str = "static"):
        self.spec = spec
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
        # Open calls from this router, by kind; written by this handle's methods only.
        self.open_sends = 0
        self.open_generations = 0
        self.pending_prefill_tokens = 0  # prompt tokens of open calls not yet computed here

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
        return self.open_sends + self.open_generations

    @property
    def routable(self) -> bool:
        return self.up and not self.draining

    def serves(self, role: str | None) -> bool:
        return role is None or self.role in (role, "any")

    def __repr__(self) -> str:
        return f"<engine {self.name} {self.role} {self.url}>"

    # -- microserving calls ---------------------------------------------------------------------

    async def prep_recv(self, request: Request, end: int = -1, lease_s: float | None = None,
                        wait_s: float | None = None) -> PrepRecvResponse:
        """Reserve this engine's slots for `request.prompt[matched:end]` (see EngineClient).
        Waits its turn for free pages up to `wait_s` (default: the pool's queue_timeout_s)."""
        self._touch(request)
        if wait_s is None:
            wait_s = self._pool.queue_timeout_s
        started = now()
        answer = await self._call(PrepRecvRequest(request.request_id, request.prompt, end,
                                                  lease_s, wait_s))
        request.timeline.prep_recv_s = now() - started
        self._pool.prefix_index.forget(request.prompt[:end], self.name, answer.matched)
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
                    request.sampling if sample else None, self._pool.queue_timeout_s)),
                f"while engine {self.name} was sending it KV for request {request.request_id}")
        finally:
            self.open_sends -= 1
            self.pending_prefill_tokens -= tokens
        self._pool.prefix_index.insert(request.prompt[:end], self.name)
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

    async def send_prompt(self, request: Request, receiver: EngineHandle, early: bool = True
                          ) -> tuple[int, int | None]:
        """Put the KV of the prompt (all but its last token, or all of it with the first
        output token sampled here when `request.first_token_travels`) on `receiver`, which
        lacks it, as P/D and context migration do: receiver.prep_recv, then this engine's
        remote_send. Returns (begin, first_token) for `receiver.start_generate`.

        `early` (the default): this engine starts computing at once, beside the receiver's
        prep_recv, and is told where to send when that answers (remote_send without kv_addr,
        then send_to), so the prep_recv round trip is off the request's path. Only when the
        receiver has pages free now: if it must wait for them, or already holds the whole
        prompt, the early send is dropped and the calls go one after the other."""
        n = len(request.prompt)
        end = n if request.first_token_travels else n - 1
        if early and _room_now(receiver, end) and (
                self._pool.prefix_index.match(request.prompt).get(receiver.name, 0) < end):
            sent = await self._send_early(request, receiver, end)
            if sent is not None:
                return sent
        recv = await receiver.prep_recv(request, end=end)
        if recv.matched >= end:  # the receiver holds it all: it computes the last token
            return n - 1, None
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
            return None if recv is None else (n - 1, None)
        finally:
            if not sending.done():  # closing the call makes the engine abort the send
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)

    async def _drop(self, request: Request, sending: asyncio.Future) -> None:
        """Abort the early send in flight as `sending`, and be sure it is gone before the
        request's next call here reuses its id: an abort that overtook the send on the way
        (its answer: aborted False) is made again until one finds it."""
        while not sending.done() and not await self.abort(request):
            await asyncio.sleep(0.001)
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
        sooner; the engine's own copy of it is left out of its first chunk. The price: if this
        engine fails before its first chunk, the request has produced output and the router
        does not try it again (it ends with the error, as a failure after any token does).

        A generation this engine has not started computing within the pool's queue_timeout_s
        fails with a 503 (code queue_timeout), as a send does."""
        self._touch(request)
        if not self.live:  # a strategy that picked it before it went down
            raise self._not_live()
        early = emit_first and first_token is not None and not self._stops(request, first_token)
        if early:  # as this engine would report it: it holds prompt[:begin] already
            yield GenerateChunk([first_token], cached_tokens=begin)
        prefill = _span(len(request.prompt), begin, len(request.prompt))
        self.open_generations += 1
        self.pending_prefill_tokens += prefill
        chunks = self.client.start_generate(request.request_id, request.prompt, begin,
                                            request.sampling, first_token,
                                            self._pool.queue_timeout_s)
        request.timeline.generate_started = now()
        watch = StreamWatch(self, self._pool.down_event(self.name))
        try:
            async for chunk in watch.chunks(chunks, f"engine {self.name} went down while "
                                                    f"generating {request.request_id}"):
                if request.timeline.first_chunk is None:
                    request.timeline.first_chunk = now()
                self.pending_prefill_tokens -= prefill
                prefill = 0
                if early:
                    early = False
                    chunk = _without_first(chunk, first_token, self.name)
                    if chunk is None:
                        continue
                if chunk.finish_reason is not None:
                    self._pool.prefix_index.insert(request.prompt, self.name)
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
            self.pending_prefill_tokens -= prefill

    async def commit(self, request: Request, pin: bool = False) -> CommitResponse:
        """Adopt the KV received for `request` into this engine's prefix cache."""
        self._touch(request)
        answer = await self._call(CommitRequest(request.request_id, pin))
        request.settled.add(self.name)
        self._pool.prefix_index.insert(request.prompt[:answer.cached], self.name)
        return answer

    async def abort(self, request: Request) -> bool:
        """Drop whatever this engine holds for `request`. False if it held nothing."""
        return (await self._call(AbortRequest(request.request_id))).aborted

    async def pin(self, prompt: list[int]) -> PinResponse:
        return await self._call(PinRequest(prompt))

    async def unpin(self, prompt: list[int]) -> PinResponse:
        return await self._call(UnpinRequest(prompt))

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


def _without_first(chunk: GenerateChunk, token: int, engine: str) -> GenerateChunk | None:
    """An engine's first chunk less the handed-over first token, already yielded; None if
    nothing is left of it."""
    if not chunk.token_ids or chunk.token_ids[0] != token:
        raise MicroservingError(500, f"engine {engine} began its stream with {chunk.token_ids[:1]}"
                                f", not the handed-over first token {token}")
    if len(chunk.token_ids) == 1 and chunk.finish_reason is None and chunk.usage is None:
        return None
    logprobs = chunk.logprobs[1:] if chunk.logprobs else chunk.logprobs
    return replace(chunk, token_ids=chunk.token_ids[1:], logprobs=logprobs, cached_tokens=None)


def _span(n: int, begin: int, end: int) -> int:
    """len(range(n)[begin:end]) without building it."""
    return len(range(*slice(begin, end).indices(n)))


class EnginePool:
    """The engines a router routes to; what `Strategy.generate` gets as `engines`."""

    def __init__(self, *, api_key: str | None = None, poll_interval_s: float = 0.5,
                 timeout_s: float = 30.0, queue_timeout_s: float = 60.0,
                 registry: Registry | None = None, deployment: str | None = None,
                 health_timeout_s: float | None = None,
                 liveness_timeout_s: float = LIVENESS_TIMEOUT_S):
        """
        Args:
            api_key: the engines' bearer token (their --api-key), sent on every call to an
                engine that proved it holds it (see the module's docstring).
            poll_interval_s: how often each engine's liveness and stats are read.
            timeout_s: limit on connecting to an engine and on its short answers.
            queue_timeout_s: how long a prep_recv waits for KV pages on its engine, and a
                remote_send for its engine to start computing it (each a 503 past it).
            registry: where the pool's counters live (a fresh one if None).
            deployment: adopt only engines whose stats report this deployment (None: any).
            health_timeout_s: how long a stats read may take (default timeout_s); a slower one
                leaves the load as last read, and the engine up.
            liveness_timeout_s: an engine whose liveness answer takes longer, or whose core
                has been silent longer, is marked down: its open streams and sends are given
                up at once. What bounds the wait on an engine that hangs, stops or is cut off.
        """
        self.health_timeout_s = timeout_s if health_timeout_s is None else health_timeout_s
        self.liveness_timeout_s = liveness_timeout_s
        self.deployment = deployment
        self.api_key = api_key
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.queue_timeout_s = queue_timeout_s
        self._down: dict[str, asyncio.Event] = {}  # set when the engine is marked down
        registry = registry or Registry()
        self._fallbacks = registry.counter(
            "microserve_router_pd_fallbacks_total",
            "P/D requests served without a prefill or a decode engine, by which was missing.",
            ["missing"])
        self._aborts = registry.counter(
            "microserve_router_engine_aborts_total", "Abort calls sent to engines.")
        self.prefix_index = PrefixIndex()  # page size set from the first engine's info
        self._engines: dict[str, EngineHandle] = {}
        self._rr = itertools.count()
        self._poller: asyncio.Task | None = None
        # (probe, engine) -> its probe in flight; started and cancelled by the poller alone
        self._probes: dict[tuple[str, str], asyncio.Task] = {}
        self.marked_down = 0  # times an engine went down (poll or failed call)
        self.stats_missed = 0  # stats reads that failed or came late (the engine stayed up)

    # -- lookup and picking ---------------------------------------------------------------------

    def __getitem__(self, name: str) -> EngineHandle:
        try:
            return self._engines[name]
        except KeyError:
            raise UnknownEngine(f"no engine named {name!r} (engines: "
                                f"{', '.join(self._engines) or 'none'})") from None

    def get(self, name: str) -> EngineHandle | None:
        return self._engines.get(name)

    def __iter__(self) -> Iterator[EngineHandle]:
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def routable(self, role: str | None = None) -> list[EngineHandle]:
        """Engines up, not draining, serving `role` (None: any role), in the order added."""
        return [e for e in self._engines.values() if e.routable and e.serves(role)]

    def round_robin(self, role: str | None = None) -> EngineHandle:
        """The next routable engine of `role` in turn. Raises BackendUnavailable if none."""
        engines = self._need(role)
        return engines[next(self._rr) % len(engines)]

    def least_loaded(self, role: str | None = None, exclude: tuple[str, ...] = ()
                     ) -> EngineHandle:
        """The routable engine of `role` with the fewest calls open from this router (then the
        fewest requests running and waiting when last polled; then the first added)."""
        engines = [e for e in self._need(role) if e.name not in exclude] or self._need(role)
        return min(engines, key=lambda e: (e.open_calls, _queued(e)))

    def pick(self, role: str | None = None, exclude: tuple[str, ...] = ()
             ) -> EngineHandle | None:
        """`least_loaded(role)` among the engines not in `exclude`, or None if none is up."""
        engines = [e for e in self.routable(role) if e.name not in exclude]
        return min(engines, key=lambda e: (e.open_calls, _queued(e))) if engines else None

    def prefill_decode(self) -> tuple[EngineHandle | None, EngineHandle]:
        """The (prefill, decode) pair for a P/D request, least loaded first, degrading rather
        than failing: with no decode engine up, any engine serves the whole request; with no
        prefill engine up besides the decode one, the decode engine does (prefill None
        either way). Raises BackendUnavailable only if no engine is up at all."""
        decode = self.pick("decode")
        if decode is None:
            decode = self.least_loaded()
            if self.routable("prefill"):
                self._fallbacks.inc(missing="decode")
            return None, decode
        prefill = self.pick("prefill", exclude=(decode.name,))
        if prefill is None and self._prefill_engines_down(decode):
            self._fallbacks.inc(missing="prefill")
        return prefill, decode

    def _prefill_engines_down(self, decode: EngineHandle) -> bool:
        """Whether the pool has a prefill-capable engine other than `decode` (down now)."""
        return any(e is not decode and e.serves("prefill") for e in self._engines.values())

    async def unless_down(self, names: list[str], call, during: str):
        """Await `call`, giving it up with BackendUnavailable as soon as one of the engines
        `names` is marked down (poll or failed call)."""
        events = [self._down[n] for n in names if n in self._down]
        if not events:
            return await call
        task = asyncio.ensure_future(call)
        watchers = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            done, _ = await asyncio.wait([task, *watchers], return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            down = [n for n in names if n in self._down and self._down[n].is_set()]
            raise BackendUnavailable(f"engine {', '.join(down)} went down {during}")
        finally:
            for w in watchers:
                w.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def release(self, request: Request) -> None:
        """End `request` on the engines: abort it, once, on every engine it touched that may
        still hold something for it (and is still in the pool and up). The one place a
        request's engine state is released, by the owner of its stream (the router's backend
        when its iterator closes unfinished, the admin API's migrate when it fails); calling
        it again finds nothing left to do."""
        names = sorted(request.touched - request.settled)
        request.settled.update(names)
        engines = [e for e in map(self._engines.get, names) if e is not None and e.up]
        self._aborts.inc(len(engines))
        results = await asyncio.gather(*(e.abort(request) for e in engines),
                                       return_exceptions=True)
        for engine, result in zip(engines, results):
            if isinstance(result, Exception):
                log.warning("abort of %s on engine %s failed: %s", request.request_id,
                            engine.name, result)

    def down_event(self, name: str) -> asyncio.Event | None:
        """Set when engine `name` is marked down or leaves the pool (None: not in it)."""
        return self._down.get(name)

    def _need(self, role: str | None) -> list[EngineHandle]:
        engines = self.routable(role)
        if not engines:
            what = f"engine with role {role!r}" if role else "engine"
            raise BackendUnavailable(f"no {what} is up ({self._states()})")
        return engines

    def _states(self) -> str:
        return ", ".join(f"{e.name}: {_state(e)}" for e in self._engines.values()) or "no engines"

    @property
    def max_model_len(self) -> int:
        lens = [e.info.max_model_len for e in self._engines.values() if e.info]
        return min(lens) if lens else 0

    # -- membership -----------------------------------------------------------------------------

    async def add(self, spec: EngineSpec, source: str = "static") -> EngineHandle:
        """Add an engine; it must answer and serve the same model as the engines already here.
        `source` says how it came (shown by describe): "static", "admin", "dns:NAME".

        Raises ValueError (a 400) on a duplicate name or a different model/layout, and
        BackendUnavailable if it does not answer."""
        if spec.name in self._engines:
            raise ValueError(f"an engine named {spec.name!r} is already in the pool")
        client = EngineClient(spec.url, api_key=self.api_key, timeout_s=self.timeout_s)
        handle = EngineHandle(spec, client, self, source)
        try:
            await self._check_live(client)  # before anything goes there with the key
            info, load = await self._stats(client)
            self._check_same_model(spec.name, info)
            if spec.name in self._engines:  # added by someone else while we waited
                raise ValueError(f"an engine named {spec.name!r} is already in the pool")
        except BaseException:
            client.close()
            raise
        if not self._engines:
            self.prefix_index = PrefixIndex(page_size=info.page_size)
        handle.info, handle.load = info, load
        handle.live, handle.up, handle.down_reason = True, True, ""
        self._engines[spec.name] = handle
        self._down[spec.name] = asyncio.Event()
        log.info("engine %s added: %s, role %s", spec.name, spec.url, spec.role)
        return handle

    def _check_same_model(self, name: str, info: EngineInfo) -> None:
        theirs = info.deployment
        if self.deployment is not None and theirs != self.deployment:
            raise ValueError(f"engine {name!r} belongs to deployment {theirs!r}, not to this "
                             f"one ({self.deployment!r}): another deployment's engine answers "
                             "on its port")
        other = next((e for e in self._engines.values() if e.name != name and e.info), None)
        if other is None:
            return
        theirs = {k: getattr(other.info, k) for k in SAME_IN_POOL}
        ours = {k: getattr(info, k) for k in SAME_IN_POOL}
        if theirs != ours:
            raise ValueError(f"engine {name!r} serves {ours}, but engine {other.name!r} serves "
                             f"{theirs}: one pool serves one model")

    def drain(self, name: str) -> EngineHandle:
        """Stop routing new requests to the engine; the ones it has finish."""
        handle = self[name]
        handle.draining = True
        return handle

    def undrain(self, name: str) -> EngineHandle:
        handle = self[name]
        handle.draining = False
        return handle

    def remove(self, name: str) -> EngineHandle:
        """Take the engine out of the pool. Requests on it go on (their calls hold the handle);
        strategies can no longer pick it."""
        handle = self[name]
        del self._engines[name]
        self._down.pop(name).set()  # calls watching it give up: it is gone for them too
        handle.client.retire()  # its requests' calls go on; their connections then close
        self.prefix_index.remove_engine(name)
        log.info("engine %s removed", name)
        return handle

    # -- health ---------------------------------------------------------------------------------

    def mark_down(self, handle: EngineHandle, reason: str) -> None:
        """Down until it proves itself alive again (which ends what is open on it now)."""
        if handle.up:
            log.warning("engine %s is down: %s", handle.name, reason)
            self.marked_down += 1
            # Its cache is gone if it restarts: forget what it held.
            self.prefix_index.remove_engine(handle.name)
            if (event := self._down.get(handle.name)) is not None:
                event.set()
        handle.live, handle.up, handle.down_reason = False, False, reason

    async def _probe(self, handle: EngineHandle) -> None:
        """The liveness probe: down unless the engine proves itself alive now."""
        try:
            await self._check_live(handle.client)
        except (BackendUnavailable, NotVerified) as e:
            self.mark_down(handle, str(e))
            return
        handle.live = True

    async def _check_live(self, client: EngineClient) -> None:
        """Raise unless the engine at `client` answers its liveness within the liveness
        timeout, its core has sent a heartbeat within it, and it proves it holds the engine
        key (when the pool has one): BackendUnavailable if it does not answer in time or its
        core is silent, NotVerified if what answers is not an engine holding the key."""
        challenge = secrets.token_hex(16)
        where = f"engine {client.base_url}"
        try:
            async with asyncio.timeout(self.liveness_timeout_s):
                live = await client.live(challenge)
        except TimeoutError:
            raise BackendUnavailable(f"{where}: no liveness answer within "
                                     f"{self.liveness_timeout_s:g} s") from None
        except MicroservingError as e:
            if e.status == 503:  # its core has exited: it restarts, or its supervisor does
                raise BackendUnavailable(f"{where}: {e}") from None
            raise NotVerified(f"{where} answered its liveness probe with {e.status} ({e}): "
                              "not an engine of this version") from None
        except ValueError:  # an answer, but not an engine's
            raise NotVerified(f"{where} answered its liveness probe with something that is "
                              "not an engine's answer") from None
        if self.api_key is not None and not proves_key(self.api_key, challenge, live.proof):
            raise NotVerified(
                f"{where} did not prove it holds the engine key (its liveness answer has "
                f"{'a wrong' if live.proof else 'no'} proof): it is not an engine of this "
                "deployment, or its --api-key is not the router's --engine-api-key; nothing "
                "was sent to it with the key")
        if live.core_silent_s > self.liveness_timeout_s:
            raise BackendUnavailable(
                f"{where}: its engine core has sent no heartbeat for {live.core_silent_s:.1f} s "
                f"(stopped or hung; steps begun: {live.steps})")

    async def _poll(self, handle: EngineHandle) -> None:
        """The stats poll of an engine that proved itself alive: its load, and, if it was
        down, back up. A failed or late answer changes nothing: liveness decides health."""
        try:
            info, load = await self._stats(handle.client)
        except Exception as e:  # busy (a long step), or going: the liveness probe says which
            self.stats_missed += 1
            log.debug("engine %s: stats poll failed: %s", handle.name, e)
            return
        handle.load = load
        if not handle.up and handle.live:
            try:  # it may have come back as another model
                self._check_same_model(handle.name, info)
            except ValueError as e:
                handle.down_reason = str(e)
                return
            log.info("engine %s is up", handle.name)
            handle.info, handle.up, handle.down_reason = info, True, ""
            if self._down[handle.name].is_set():  # calls watch it afresh
                self._down[handle.name] = asyncio.Event()

    async def _stats(self, client: EngineClient) -> tuple[EngineInfo, EngineStats]:
        """The engine's /microserving/stats, within the health timeout. Raises ValueError
        (msgspec.ValidationError) if it is not an engine's answer."""
        try:
            async with asyncio.timeout(self.health_timeout_s):
                answer = await client.stats()
        except TimeoutError:
            raise BackendUnavailable(f"engine {client.base_url}: no stats within "
                                     f"{self.health_timeout_s:g} s") from None
        return answer.info, answer.stats

    async def start(self) -> None:
        """Begin polling (call once the event loop runs)."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        """Each poll_interval_s, probe every engine's liveness, and read the stats of each
        one that proved itself alive; an engine whose last probe or read still runs is
        skipped (a slow answer holds up no other engine, nor the next probe of its kind)."""
        while True:
            for handle in self:
                self._start_probe("liveness", handle, self._probe)
                if handle.live:
                    self._start_probe("stats", handle, self._poll)
            await asyncio.sleep(self.poll_interval_s)

    def _start_probe(self, kind: str, handle: EngineHandle, probe) -> None:
        key = (kind, handle.name)
        if key in self._probes:
            return
        task = self._probes[key] = asyncio.create_task(probe(handle))
        task.add_done_callback(lambda done: self._probes.pop(key, None)
                               if self._probes.get(key) is done else None)

    async def close(self) -> None:
        probes = [self._poller] if self._poller is not None else []
        probes += self._probes.values()
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        self._poller = None
        self._probes.clear()
        for handle in self:
            handle.client.close()

    def metrics_text(self) -> str:
        """Prometheus text of the pool's state, rendered when /metrics is read."""
        registry = Registry()
        up = registry.gauge("microserve_router_engine_up",
                            "1 if the engine is routable (up and not draining).", ["engine"])
        sends = registry.gauge("microserve_router_engine_open_sends",
                               "remote_send calls open on the engine.", ["engine"])
        gens = registry.gauge("microserve_router_engine_open_generations",
                              "start_generate streams open on the engine.", ["engine"])
        for e in self:
            up.set(float(e.routable), engine=e.name)
            sends.set(e.open_sends, engine=e.name)
            gens.set(e.open_generations, engine=e.name)
        down = registry.counter("microserve_router_engine_down_total",
                                "Times an engine was found down (liveness probe or failed "
                                "call).")
        down.inc(self.marked_down)
        missed = registry.counter("microserve_router_engine_stats_missed_total",
                                  "Stats polls that failed or came later than the health "
                                  "timeout (load left as last read; the engine stays up).")
        missed.inc(self.stats_missed)
        return registry.render()

    def describe(self) -> list[dict]:
        """What GET /admin/engines shows."""
        return [{"name": e.name, "url": e.url, "role": e.role, "source": e.source,
                 "state": _state(e),
                 "down_reason": e.down_reason or None, "open_sends": e.open_sends,
                 "open_generations": e.open_generations,
                 "pending_prefill_tokens": e.pending_prefill_tokens,
                 "load": msgspec.to_builtins(e.load) if e.load else {},
                 "kv_capacity_tokens": e.info.kv_capacity_tokens if e.info else None}
                for e in self]


def _queued(engine: EngineHandle) -> int:
    return 0 if engine.load is None else engine.load.running + engine.load.waiting


def _state(engine: EngineHandle) -> str:
    if not engine.up:
        return "down"
    return "draining" if engine.draining else "up"
