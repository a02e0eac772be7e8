"""router/role_steering.py's restoring when `auto` is swapped out: each engine it flipped gets
the role it had before its first flip, unless an ops call changed it since; an engine that left
the pool is skipped. The pool here is a stand-in for EnginePool's `get` and `roles.flip` (the
live path, through the router, is tests/test_auto_seats_live.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.engines import UnknownEngine
from router.role_policy import Flip, FlipSettings, RolePolicy
from router.role_steering import RoleSteering


class Flips:
    def __init__(self, engines: dict):
        self.engines, self.calls = engines, []

    async def flip(self, name: str, role: str, wait_s: float, reason: str = "ops") -> dict:
        if name not in self.engines:
            raise UnknownEngine(name)
        engine = self.engines[name]
        old, engine.role = engine.role, role
        self.calls.append((name, old, role, reason))
        return {"engine": name, "from": old, "to": role, "flipped": old != role,
                "waited_s": 0.0, "left": 0}


class Pool:
    poll_interval_s = 0.5

    def __init__(self, **roles: str):
        self.engines = {name: SimpleNamespace(name=name, role=role) for name, role in roles.items()}
        self.roles = Flips(self.engines)

    def get(self, name: str):
        return self.engines.get(name)


def steering(pool: Pool) -> RoleSteering:
    return RoleSteering(None, pool, chosen=dict, tpot_s=lambda e: 0.0, wait_s=2.0)


async def test_retired_steering_gives_back_the_roles_from_before_its_first_flip():
    pool = Pool(p="prefill", d="decode", x="any")
    s = steering(pool)
    await s._flip(Flip("p", "prefill", "any", "decode_bound"))
    await s._flip(Flip("p", "any", "decode", "decode_bound"))  # twice: back to the first's from
    await s._flip(Flip("d", "decode", "any", "chat_like"))
    await s._flip(Flip("x", "any", "prefill", "interference"))
    await pool.roles.flip("d", "prefill", 1.0)  # an ops call since auto's flip: it stands
    del pool.engines["x"]  # x left the pool
    pool.roles.calls.clear()
    s.retire()
    await s.stop()
    assert pool.roles.calls == [("p", "decode", "prefill", "restore")]
    assert {n: e.role for n, e in pool.engines.items()} == {"p": "prefill", "d": "prefill"}
    assert [(f["engine"], f["to"], f["reason"]) for f in s.flips][-1] == (
        "p", "prefill", "restore")


async def test_the_flips_shown_are_the_last_few_and_the_total_counts_every_one():
    """GET /admin/strategy keeps KEPT_FLIPS flips; `flips_total` goes on counting past them
    (bench.strategies' trace finds each new flip by it)."""
    from router.role_steering import KEPT_FLIPS

    pool = Pool(p="prefill")
    s = RoleSteering(RolePolicy(FlipSettings(), slo_tpot_s=0.025), pool, chosen=dict,
                     tpot_s=lambda e: 0.0, wait_s=2.0)
    roles = ["any", "prefill"] * KEPT_FLIPS
    for before, after in zip(["prefill"] + roles, roles):
        await s._flip(Flip("p", before, after, "chat_like"))
    shown = s.describe()
    assert shown["flips_total"] == 2 * KEPT_FLIPS
    assert [f["to"] for f in shown["flips"]] == roles[-KEPT_FLIPS:]


async def test_a_steering_that_flipped_nothing_restores_nothing():
    pool = Pool(p="prefill", d="decode")
    s = steering(pool)
    s.retire()
    await s.stop()
    await asyncio.sleep(0)
    assert pool.roles.calls == []


async def test_a_flip_whose_old_work_never_drains_ends_at_its_wait_not_a_poll_after():
    """router/roles.py: decodes still open on an engine turning prefill; the flip waits
    `wait_s` for them (polling every POLL_S), then flips with them open, within the bound
    (it slept a whole poll past it before: an auto flip read 2.005 s against wait_s 2.0)."""
    from dataclasses import dataclass

    from microserve.metrics import Registry
    from router.roles import POLL_S, RoleFlips

    @dataclass(frozen=True)
    class Spec:
        role: str

    class Engine(SimpleNamespace):  # EngineHandle's parts a flip uses
        role = property(lambda self: self.spec.role)

    engine = Engine(spec=Spec("decode"), draining=False, open_generations=3, open_receives=0,
                    open_sends=0)
    flips = RoleFlips({"d": engine}, Registry())
    wait_s = 2.1 * POLL_S  # not a whole number of polls
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await flips.flip("d", "prefill", wait_s)
    took = loop.time() - started
    assert (result["from"], result["to"], result["flipped"], result["left"]) == (
        "decode", "prefill", True, 3)
    assert wait_s <= result["waited_s"] <= took < wait_s + POLL_S / 2
    assert engine.spec.role == "prefill" and engine.draining is False
