"""The `n` choices of one prompt share its prefill: the first choice to arrive runs through the
strategy; the others wait for its first output and then generate whole on the engine that
produces it, where the prompt's KV now is (computed there, or received from a prefill engine,
and in its prefix cache either way). So a P/D request with n choices moves the prompt's KV
once and no engine computes it twice; each choice still samples its own tokens.

    choice 0 ──▶ strategy ──▶ ... ──▶ engine E ──first chunk──┐
    choice 1 ──waits────────────────────────────────────────────┴──▶ E.start_generate(begin=0)
    choice 2 ──waits─────────────────────────────────────────────────▶ E.start_generate(begin=0)

If the first choice ends without output (it failed, or was cancelled), the others go through
the strategy each, as if alone. Scored requests (prompt_logprobs) are placed by the router's
scoring rule instead (router/backend.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from router.engine_handle import EngineHandle
from router.engines import EnginePool


@dataclass
class Fork:
    leader: str  # request id of the choice that runs through the strategy
    members: int = 0  # choices of it whose generation is still running
    engine: str | None = None  # where the leader's output came from; None: it had none
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class ChoiceForks:
    """Choices in flight, by the key the frontend gives the choices of one prompt."""

    def __init__(self):
        self._forks: dict[str, Fork] = {}

    def join(self, key: str, request_id: str) -> Fork:
        fork = self._forks.get(key)
        if fork is None:
            fork = self._forks[key] = Fork(request_id)
        fork.members += 1
        return fork

    def leave(self, key: str, fork: Fork) -> None:
        fork.members -= 1
        if fork.members == 0 and self._forks.get(key) is fork:
            del self._forks[key]

    @staticmethod
    def led(fork: Fork, engine: str | None) -> None:
        """The leader's first output came from `engine` (None: it ended without one)."""
        if not fork.ready.is_set():
            fork.engine = engine
            fork.ready.set()

    @staticmethod
    async def engine_for(fork: Fork, pool: EnginePool) -> EngineHandle | None:
        """For a choice that follows: the engine to generate on once the leader has output,
        or None (the leader had none, or that engine can no longer take it): the strategy's
        choice, then."""
        await fork.ready.wait()
        engine = pool.get(fork.engine) if fork.engine is not None else None
        if engine is None or engine not in pool.routable():
            return None
        return engine
