"""Adapter affinity (issue 41; llm-d's LoRA-aware scorer): which engine should serve a request,
scored by where its LoRA adapter is, how much of its prompt the engine holds, and its load.

    adapter  1.0  the adapter sits in one of the engine's slots (resident, by its polled
                  stats, or a generation of it from this router is open there): nothing to copy
             0.8  registered, and a slot is free: one copy into it, nothing evicted
             0.6  registered, every slot taken: a copy, and another adapter evicted for it
             0.3  registered, but every slot is held by an adapter with generations open
                  here: it waits until one of them has none (the engine never evicts an
                  adapter whose requests run), so its requests queue behind other adapters'
             (a request for the base model scores 1.0 everywhere)
    prefix   the share of the prompt the router's prefix index says the engine holds for this
             adapter (KV belongs to its adapter: a base prefix does not count for an adapter)
    load     1 - the engine's load / the highest load among the candidates (load: the calls
             this router has open on it, plus its running and waiting requests when last
             polled); 1.0 everywhere when all are idle

    score = weights.adapter * adapter + weights.prefix * prefix + weights.load * load

The candidates are the pool's routable engines of the role asked for, and for an adapter only
those that have it registered (`EnginePool.with_adapter`, which the router's backend hands
every adapter request's strategy): an engine still loading it (`lora_loading` in its stats)
refuses it until the load is done. Everything comes from the engines' polled stats and the
router's own counters: scoring calls no engine. Ties go to the engine added first.

    from router.affinity import scores
    best = engines.by_affinity(request)              # the top engine (any strategy)
    scores(request, engines)                         # every candidate's Score, best first
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.engine_handle import EngineHandle
    from router.engines import EnginePool
    from router.strategy import Request

RESIDENT, FREE_SLOT, EVICTS, WAITS = 1.0, 0.8, 0.6, 0.3


@dataclass(frozen=True)
class Weights:
    adapter: float = 1.0
    prefix: float = 1.0
    load: float = 0.5

    def __post_init__(self):
        for name in ("adapter", "prefix", "load"):
            if not 0.0 <= getattr(self, name) <= 100.0:
                raise ValueError(f"{name}_weight {getattr(self, name)} must be within [0, 100]")


@dataclass(frozen=True)
class Score:
    engine: str
    total: float
    adapter: float
    prefix: float
    load: float


def adapter_score(engine: EngineHandle, adapter: str | None) -> float:
    """Where `adapter` is on `engine`, by its last polled stats and the router's open calls
    (the table above). The calls come first: stats are up to half a second old, and a busy
    engine's slots change faster than that. Slot pressure (WAITS) is what sends each rarely
    used adapter of a skewed mix to one engine rather than to all: an engine busy with as
    many adapters as it has slots takes a new one only after one of them drains."""
    if adapter is None or adapter in engine.open_adapters:
        return RESIDENT
    stats = engine.load
    if stats is not None and adapter in stats.lora_resident:
        return RESIDENT
    slots = engine.info.max_loras if engine.info is not None else 0
    if slots and len(engine.open_adapters) >= slots:
        return WAITS
    if stats is None:  # not polled yet: started with it, resident if a slot was free then
        return FREE_SLOT
    return FREE_SLOT if len(stats.lora_resident) < slots else EVICTS


def engine_load(engine: EngineHandle) -> int:
    """Calls open from this router plus the engine's running and waiting requests."""
    queued = 0 if engine.load is None else engine.load.running + engine.load.waiting
    return engine.open_calls + queued


def scores(request: Request, engines: EnginePool, role: str | None = None,
           weights: Weights = Weights()) -> list[Score]:
    """Every candidate engine's score for `request`, best first (ties: the order added)."""
    candidates = engines.routable(role)
    held = engines.prefix_index.match(request.prompt, request.adapter)
    loads = [engine_load(e) for e in candidates]
    most = max(loads, default=0)
    out = []
    for engine, load in zip(candidates, loads):
        parts = (adapter_score(engine, request.adapter),
                 held.get(engine.name, 0) / max(1, len(request.prompt)),
                 1.0 - load / most if most else 1.0)
        total = (weights.adapter * parts[0] + weights.prefix * parts[1]
                 + weights.load * parts[2])
        out.append(Score(engine.name, total, *parts))
    order = {e.name: i for i, e in enumerate(candidates)}
    return sorted(out, key=lambda s: (-s.total, order[s.engine]))
