"""What a strategy is: an async generator that turns one client request into microserving calls.

    from router.strategy import Strategy

    class DataParallel(Strategy):
        async def generate(self, request, engines):
            engine = engines.round_robin()
            async for out in engine.start_generate(request, begin=0):
                yield out

`request` carries the prompt's token ids (the router tokenized it once) and the sampling
parameters; `engines` is the router's EnginePool (router/engines.py): engines by name and role,
`round_robin()`, `least_loaded()`, their live load, and the router's prefix index. Each engine
handle has async `prep_recv`, `remote_send`, `start_generate`, `commit`, `abort` and `pin`, all
taking the request first, so the router knows which engines a request touched.

What the router guarantees around `generate` (router/backend.py):
- the chunks it yields go to the client as they come; the last one has a finish_reason;
- if it raises, or the client goes away, or an engine fails, the request is aborted on every
  engine it touched: a strategy never needs try/finally to clean up engines;
- a request runs start to end on the instance it started with, even if the strategy is swapped
  meanwhile (router/host.py); `start()` runs before the first request, `retire()` when it is
  swapped out, `stop()` after its last request.

A strategy must be safe to run for many requests at once (it is one object) and must not block
the event loop: it is on every token's path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from microserve.messages import GenerateChunk, SamplingParams
from router.handover import Timeline, now

if TYPE_CHECKING:
    from router.engines import EnginePool


@dataclass
class Request:
    """One client request as strategies see it. The router makes one per client request and
    uses `request_id` for every engine call of it."""

    request_id: str
    prompt: list[int]  # token ids (chat template applied, special tokens added)
    sampling: SamplingParams
    # its rank on engines run with --scheduling-policy priority (lower runs first): the
    # client's `priority`, which a strategy may change before its calls
    priority: int = 0
    # Names of the engines called for this request so far, and of those that hold nothing for
    # it now (their call finished, or they were told to abort); written by the engine handles
    # and the router's cleanup, which aborts `touched - settled`, once.
    touched: set[str] = field(default_factory=set, compare=False)
    settled: set[str] = field(default_factory=set, compare=False)
    # Prompt tokens whose KV remote_send moved into another engine, and how many of those the
    # sender copied from its prefix cache: usage counts cache hits, not KV received (the
    # router's backend works out cached_tokens from these and the generating engine's count).
    received_tokens: int = field(default=0, compare=False)
    peer_cached_tokens: int = field(default=0, compare=False)
    # Where its time to first token went (router/handover.py): stamped by the engine handles
    # and the router's backend.
    timeline: Timeline = field(default_factory=lambda: Timeline(now()), compare=False)
    # The engine whose start_generate streams its output (the last one called); written by
    # the engine handle, read by the router's choice forks (router/forks.py).
    generating_on: str | None = field(default=None, compare=False)

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter it runs with (its `model`, when that names one); None: the base.
        Every engine call carries it (router/engine_handle.py); the prefix index is per
        adapter (`engines.prefix_index.match(request.prompt, request.adapter)`)."""
        return self.sampling.lora_name

    @property
    def first_token_travels(self) -> bool:
        """Whether the engine that prefills the prompt may also sample the first output token
        and hand it to the generating engine with the KV. Not with logprobs, a grammar or
        logit adjustments (logit_bias, min_tokens, penalties: the generating engine keeps
        their state), nor for a seeded random sample (one generator draws every token of it)."""
        p = self.sampling
        return (p.logprobs is None and p.grammar is None and not p.adjusts_logits
                and (p.greedy or p.seed is None))


class Strategy(ABC):
    """Base of every strategy. Subclasses take their settings as keyword arguments to
    `__init__` (the admin API passes them as JSON) and raise ValueError on a bad one, naming
    the argument and the value."""

    @abstractmethod
    def generate(self, request: Request, engines: EnginePool) -> AsyncIterator[GenerateChunk]:
        """Yield the request's output chunks (usually by relaying one engine's start_generate).

        Raises whatever the engine calls raise (MicroservingError, BackendUnavailable); the
        router turns that into the client's error and cleans up.
        """

    async def start(self, engines: EnginePool) -> None:
        """Called once before the instance serves its first request: start background tasks
        here (and keep them). The default does nothing."""

    def retire(self) -> None:
        """Called once when the instance is swapped out, while its last requests may still
        run (`stop` follows them): stop whatever acts on the pool as a whole, such as auto's
        role flips, so that it does not go on under the strategy that replaced it. The
        default does nothing."""

    async def stop(self) -> None:
        """Called once after the instance was swapped out and its last request finished:
        cancel and await what `start` began. The default does nothing."""

    def describe(self) -> dict:
        """Settings and state shown by GET /admin/strategy. The default shows nothing."""
        return {}
