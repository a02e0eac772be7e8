"""Routing LoRA requests by affinity, as units: the router's prefix index keeps one tree per
adapter, and router/affinity.py scores engines from recorded stats (adapter resident, a slot
free or an eviction; prefix held for the adapter; load) to the exact number."""

from __future__ import annotations

import dataclasses

import pytest
from test_router_units import CountingClient, engine_info, engine_load, make_pool

from microserve.messages import SamplingParams
from router.affinity import Weights, scores
from router.host import StrategyHost, StrategySource
from router.prefix_index import PrefixIndex
from router.strategy import Request

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # two pages of 4


def request(adapter: str | None) -> Request:
    return Request("r", PROMPT, SamplingParams(lora_name=adapter))


def test_prefix_index_keeps_one_tree_per_adapter():
    index = PrefixIndex(page_size=4)
    assert index.insert(PROMPT, "e1") == 8
    assert index.insert(PROMPT[:4], "e2", "a1") == 4
    assert len(index) == 3
    assert index.match(PROMPT) == {"e1": 8}
    assert index.match(PROMPT, "a1") == {"e2": 4}
    assert index.match(PROMPT, "a2") == {}
    assert index.engines_of(PROMPT[:4], "a1") == {"e2"}
    index.forget(PROMPT, "e1", held=4, adapter="a1")  # e1 holds nothing under a1: no change
    assert index.match(PROMPT) == {"e1": 8}
    index.remove_engine("e2")
    assert index.match(PROMPT, "a1") == {} and len(index) == 2


def stats(registered: list[str], resident: list[str], **counts):
    return dataclasses.replace(engine_load(**counts), lora_registered=registered,
                               lora_resident=resident)


@pytest.fixture
def pool():
    """e1: a1 resident; e2: a2 resident, a slot free; e3: both slots taken by others; e4: no
    a1 at all. Two slots each."""
    pool = make_pool(("e1", "any"), ("e2", "any"), ("e3", "any"), ("e4", "any"))
    for e in pool:
        e.info = engine_info(max_loras=2)
    pool["e1"].load = stats(["a1", "a2"], ["a1"], running=2)
    pool["e2"].load = stats(["a1", "a2"], ["a2"])
    pool["e3"].load = stats(["a1", "a2", "a3"], ["a2", "a3"])
    pool["e4"].load = stats(["a2"], ["a2"])
    pool.prefix_index = PrefixIndex(page_size=4)
    return pool


def totals(request, engines, **weights) -> list[tuple[str, float]]:
    return [(s.engine, round(s.total, 6)) for s in scores(request, engines,
                                                          weights=Weights(**weights))]


def test_scores_by_adapter_state_prefix_and_load(pool):
    a1 = pool.with_adapter("a1")  # as the router's backend hands an a1 request's strategy
    # e1 resident but the busiest (load 2 of 2: 0), e2 a free slot, e3 evicts; e4 lacks a1
    [e1] = [s for s in scores(request("a1"), a1) if s.engine == "e1"]
    assert (e1.adapter, e1.prefix, e1.load, e1.total) == (1.0, 0.0, 0.0, 1.0)
    assert totals(request("a1"), a1) == [("e2", 1.3), ("e3", 1.1), ("e1", 1.0)]
    pool["e1"].load = stats(["a1", "a2"], ["a1"])  # idle now: residency wins
    assert totals(request("a1"), a1) == [("e1", 1.5), ("e2", 1.3), ("e3", 1.1)]
    assert a1.by_affinity(request("a1")).name == "e1"
    # a prefix cached under a1 outweighs residency; one cached under the base does not count
    pool.prefix_index.insert(PROMPT, "e3", "a1")
    pool.prefix_index.insert(PROMPT, "e2")
    assert totals(request("a1"), a1) == [("e3", 2.1), ("e1", 1.5), ("e2", 1.3)]
    # the base: 1.0 for the adapter part everywhere, e2's prefix decides
    assert totals(request(None), pool) == [("e2", 2.5), ("e1", 1.5), ("e3", 1.5), ("e4", 1.5)]
    # weights: residency alone
    assert totals(request("a1"), a1, prefix=0, load=0) == [("e1", 1.0), ("e2", 0.8),
                                                          ("e3", 0.6)]
    pool["e3"].open_generations = 4  # calls open from this router count as load
    assert totals(request("a1"), a1, adapter=0, prefix=0) == [("e1", 0.5), ("e2", 0.5),
                                                             ("e3", 0.0)]
    # ... and a generation of a1 open on e3 makes a1 resident there before a poll says so
    pool["e3"].open_adapters["a1"] = 1
    assert totals(request("a1"), a1, prefix=0, load=0) == [("e1", 1.0), ("e3", 1.0),
                                                          ("e2", 0.8)]
    # e2's two slots both held by adapters with generations open here: a1 would wait for
    # one of them to drain, which ranks it below evicting an idle adapter on e3
    pool["e2"].open_adapters.update({"a2": 3, "a3": 1})
    assert totals(request("a1"), a1, prefix=0, load=0) == [("e1", 1.0), ("e3", 1.0),
                                                          ("e2", 0.3)]
    assert totals(request("a2"), pool.with_adapter("a2"), prefix=0, load=0)[0] == ("e2", 1.0)
    with pytest.raises(ValueError, match="load_weight -1 must be within"):
        Weights(load=-1)


async def test_the_builtin_strategy_takes_weights_and_routes_to_the_best(pool):
    host = StrategyHost(pool)
    loaded = await host.load(StrategySource.builtin("lora_affinity"), {"prefix_weight": 0})
    assert loaded.instance.describe() == {"adapter_weight": 1.0, "prefix_weight": 0,
                                          "load_weight": 0.5}
    picked = []

    async def start_generate(self, req, begin=0):
        picked.append(self.name)
        yield "done"

    for e in pool:
        e.start_generate = start_generate.__get__(e)
    async for _ in loaded.instance.generate(request("a1"), pool.with_adapter("a1")):
        pass
    assert picked == ["e2"]  # e1 resident but busy; e2 a free slot


async def test_an_engine_counts_its_open_generations_per_adapter(pool):
    """While a1's generation streams from e2, e2 counts it (a1 scores resident there); the
    count goes with the stream."""
    pool["e2"].client = CountingClient()
    seen = []
    async for _ in pool["e2"].start_generate(request("a1")):
        seen.append(dict(pool["e2"].open_adapters))
    assert seen == [{"a1": 1}, {"a1": 1}] and pool["e2"].open_adapters == {}
