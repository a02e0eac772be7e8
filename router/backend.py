"""The router as a GenerateBackend: the OpenAI frontend (microserve/openai/app.py) over strategies.

For each client request the frontend tokenizes, then iterates `generate`, which runs the active
strategy's `generate(request, engines)` and relays its chunks (cached_tokens made the client's):

    client ─▶ frontend ─▶ RouterBackend.generate ─▶ strategy.generate ─▶ engine handles ─▶ engines
                    ◀── text ◀────────────── GenerateChunk ◀──────────────┘

Cleanup is the router's, not the strategy's, and a request lives as long as its iterator:
whenever `generate` ends without a finish reason (the strategy raised, an engine failed, the
frontend closed it because the client went away or a stop string matched), every engine the
request touched that may still hold something for it is told to abort it, once, from here
(EnginePool.release; an engine whose send or generation finished holds nothing). Nobody else
sends the request's aborts: the frontend just closes the iterator. A request that fails before its first token
because an engine is unreachable or a KV transfer failed is tried again (up to `max_retries`
times, after 0.1 s, then 0.2 s, ...) if some engine is still up; the strategy then picks again,
and an engine that could not be reached is marked down, so it is not picked until it answers a
poll. A request that waited its queue time for KV pages (code kv_wait_timeout) or for a
prefill engine to start on it (queue_timeout) is not tried again: the client gets the 503
with a Retry-After header, as when no engine is up at all.

Errors reach the client as: the engine's own status and message (MicroservingError: a 400 the
engine refused stays that 400), 503 for engines that cannot be reached, 500 naming the strategy
for a bug in it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from microserve.backend import (CLIENT, RETRY_AFTER_S, BackendError, BackendUnavailable,
                                GenerateBackend, MicroservingError)
from microserve.messages import GenerateChunk, SamplingParams
from microserve.metrics import Registry
from router.arms import ArmMetrics
from router.engines import EnginePool
from router.forks import ChoiceForks, Fork
from router.handover import StageMetrics, now
from router.host import LoadedStrategy, StrategyHost
from router.strategy import Request

log = logging.getLogger("microserve.router")

RETRY_STATUSES = (502, 503)  # transfer failed / no KV space now: another engine may do
RETRY_BACKOFF_S = 0.1  # before the first retry; doubled for each one after it
# 503s of a request that waited its queue time (D's pages, P's start): tried again, it would
# only wait again
QUEUE_TIMEOUTS = ("kv_wait_timeout", "queue_timeout")


class StrategyError(BackendError):
    """A strategy raised something that is not an engine's answer: a bug (a 500)."""


class RouterBackend(GenerateBackend):
    def __init__(self, pool: EnginePool, host: StrategyHost, model_name: str,
                 registry: Registry, *, max_retries: int = 2):
        self.pool, self.host, self.model_name = pool, host, model_name
        self.max_retries = max_retries
        self._scoring = _ScoringPlaces(pool)
        self._forks = ChoiceForks()
        self._requests = registry.counter(
            "microserve_router_requests_total", "Requests by strategy and how they ended.",
            ["strategy", "outcome"])
        self._retries = registry.counter(
            "microserve_router_retries_total", "Requests tried again after an engine failed.")
        self._stages = StageMetrics(registry)
        self._forked = registry.counter(
            "microserve_router_forked_choices_total",
            "Choices (n > 1) generated on the engine holding their prompt's KV from the first.")
        self._arms = ArmMetrics(registry)

    @property
    def max_model_len(self) -> int:
        return self.pool.max_model_len

    async def healthy(self) -> bool:
        return bool(self.pool.routable())

    def lora_names(self) -> list[str]:
        return self.pool.lora_names()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0, choices_of: str | None = None
                       ) -> AsyncIterator[GenerateChunk]:
        # the n choices of a prompt: one prefill (router/forks.py); scored ones: _ScoringPlaces
        fork = None
        if choices_of is not None and params.prompt_logprobs is None:
            fork = self._forks.join(choices_of, request_id)
        attempts = self._attempts(request_id, prompt_token_ids, params, priority, fork)
        try:
            async for chunk in attempts:
                yield chunk
        finally:
            await attempts.aclose()  # its cleanup runs now, not when it is collected
            if fork is not None:
                if fork.leader == request_id:  # it ended: the others go on without it
                    self._forks.led(fork, None)
                self._forks.leave(choices_of, fork)

    async def _attempts(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, priority: int, fork: Fork | None
                        ) -> AsyncIterator[GenerateChunk]:
        leads = fork is not None and fork.leader == request_id
        arrived = now()  # an A/B arm's times count the attempts before the last
        # a LoRA adapter's request goes only to engines that have it registered
        pool = self.pool if params.lora_name is None else self.pool.with_adapter(
            params.lora_name)
        for attempt in range(self.max_retries + 1):
            request = Request(request_id, prompt_token_ids, params, priority)
            follow = None  # the engine a choice forks from
            if fork is not None and not leads:
                follow = await self._forks.engine_for(fork, pool)
                if follow is not None:
                    self._forked.inc()
            loaded = self.host.acquire(CLIENT.get(), request_id)
            if params.prompt_logprobs is not None:
                # scoring the prompt needs it computed whole on one engine: no strategy splits it
                chunks = self._scoring.whole(request)
            elif follow is not None:
                chunks = follow.start_generate(request, begin=0)
            else:
                chunks = loaded.instance.generate(request, pool)
            finished = produced = retrying = False
            tokens, ended = 0, None
            try:
                async for chunk in chunks:
                    if not produced:
                        request.timeline.first_token = now()
                        if leads:
                            self._forks.led(fork, request.generating_on)
                    produced = True
                    finished = chunk.finish_reason is not None
                    tokens += len(chunk.token_ids)
                    if finished:
                        ended = now()
                    yield _with_cache_hits(request, chunk)
                    if finished:
                        # Then run the strategy to its end (a consumer that reads on after
                        # the finishing output waits for it; one that closes here cuts it
                        # short): the client has its last token without waiting for the
                        # engine's stream to end.
                        await _no_more(chunks, loaded)
                        return
                raise StrategyError(f"strategy {_who(loaded)} ended request {request_id} "
                                    "without a finish reason")
            except (BackendUnavailable, MicroservingError) as e:
                if produced or not self._retryable(e, attempt):
                    if not produced and _overloaded(e):
                        e.retry_after = RETRY_AFTER_S
                    raise
                retrying = True
                self._retries.inc()
                log.warning("request %s: %s; trying again (attempt %d)", request_id, e,
                            attempt + 2)
            except StrategyError:
                raise
            except Exception as e:
                log.exception("request %s: strategy %s raised", request_id, _who(loaded))
                raise StrategyError(f"strategy {_who(loaded)} raised "
                                    f"{type(e).__name__}") from e
            finally:
                await chunks.aclose()
                if not finished:  # the one place the request is released on the engines
                    await asyncio.shield(self.pool.release(request))
                self.host.release(loaded, finished)
                self._requests.inc(strategy=loaded.name,
                                   outcome="finished" if finished else "failed")
                if finished:
                    self._stages.observe(loaded.name, request.timeline)
                if loaded.arm is not None and not retrying:
                    self._arms.record(loaded.arm, _times(request, arrived, tokens, ended)
                                      if finished else None)
            await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)

    def _retryable(self, error: Exception, attempt: int) -> bool:
        if attempt >= self.max_retries or not self.pool.routable():
            return False
        if isinstance(error, BackendUnavailable):
            return True
        return error.status in RETRY_STATUSES and error.code not in QUEUE_TIMEOUTS

    async def metrics_text(self) -> str:
        return self.pool.metrics_text() + self.host.metrics_text()


async def _no_more(chunks: AsyncIterator[GenerateChunk], loaded: LoadedStrategy) -> None:
    async for _ in chunks:
        raise StrategyError(f"strategy {_who(loaded)} yielded a chunk after the finishing one")


def _overloaded(error: Exception) -> bool:
    """A 503 the client should retry later: no engine up, or its request waited in vain."""
    return isinstance(error, BackendUnavailable) or error.status == 503


class _ScoringPlaces:
    """Requests with prompt_logprobs (completions' echo with logprobs) are served whole,
    whatever the strategy: no engine can score a prompt from KV it received (a strategy's P/D
    split or migration would fail it). Each goes to the least loaded engine, except that the
    `n` choices of a prompt (the same prompt, scored the same way) go where the first of them
    went while it runs: that engine scores the prompt once for all of them (docs/engine.md),
    where spread over engines each would score it again."""

    def __init__(self, engines: EnginePool):
        self.engines = engines
        # (prompt key, prompt_logprobs) -> [engine name, requests on it]; entries live as
        # long as a request of theirs runs
        self._places: dict[tuple[int, int], list] = {}

    async def whole(self, request: Request) -> AsyncIterator[GenerateChunk]:
        key = (hash(tuple(request.prompt)), request.sampling.prompt_logprobs)
        place = self._places.get(key)
        engine = self.engines.get(place[0]) if place is not None else None
        if engine is None or not engine.routable:
            engine = self.engines.least_loaded()
            place = self._places[key] = [engine.name, 0]
        place[1] += 1
        try:
            async for chunk in engine.start_generate(request, begin=0):
                yield chunk
        finally:
            place[1] -= 1
            if place[1] == 0 and self._places.get(key) is place:
                del self._places[key]


def _times(request: Request, arrived: float, tokens: int, ended: float) -> dict[str, float]:
    """A finished request's TTFT and JCT from its arrival, and (with more than one output
    token) TPOT: the time between its first and last token over the tokens after the first."""
    first = request.timeline.first_token
    times = {"ttft": first - arrived, "jct": ended - arrived}
    if tokens > 1:
        times["tpot"] = (ended - first) / (tokens - 1)
    return times


def _who(loaded: LoadedStrategy) -> str:
    return f"{loaded.name!r} v{loaded.version}"


def _cache_hits(request: Request, on_engine: int) -> int:
    """OpenAI's cached_tokens: prompt tokens served from a prefix cache on any engine. The
    generating engine counts KV it received as already there; that is a cache hit only where
    the sender copied it from its own cache."""
    return max(0, on_engine - request.received_tokens + request.peer_cached_tokens)


def _with_cache_hits(request: Request, chunk: GenerateChunk) -> GenerateChunk:
    """The chunk with the generating engine's cached counts (first chunk, usage) made the
    client's: cache hits on any engine (`_cache_hits`)."""
    if chunk.cached_tokens is not None:
        chunk = replace(chunk, cached_tokens=_cache_hits(request, chunk.cached_tokens))
    if chunk.usage is not None:
        usage = replace(chunk.usage, cached_tokens=_cache_hits(request, chunk.usage.cached_tokens))
        chunk = replace(chunk, usage=usage)
    return chunk
