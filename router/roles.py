"""Changing an engine's role while it serves (issue 44, item 2's ops call).

    POST /admin/engines/p0/role {"role": "decode", "wait_s": 30}

A role is a routing preference (router/engines.py): strategies ask for prefill or decode
engines. A flip first drains the work that depends on the old role and that the new role does
not do — the KV sends (remote_send) of a prefill engine, the generations of a decode engine,
either for "any" — by taking the engine out of routing (as a drain does) until the router has
no such call open on it, then sets the new role and puts the engine back (drained again only
if it was drained before). Work of the kind the new role keeps is not waited for. After
`wait_s` the flip happens anyway, with the calls still open reported: every engine can do
every call, so they finish; the wait only keeps the engine from taking new work of its old
kind meanwhile. Each flip is logged and counted (microserve_router_role_flips_total), with
its reason: "ops" for this call, the rule's name for the `auto` strategy's own flips
(router/role_policy.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from microserve.metrics import Registry

if TYPE_CHECKING:
    from router.engine_handle import EngineHandle
    from router.engines import EnginePool

log = logging.getLogger("microserve.router")

POLL_S = 0.02  # how often a flip looks at the engine's open calls
# the open-call counters of each kind of work, by the role that does it
WORK = {"prefill": ("open_sends",), "decode": ("open_generations", "open_receives")}


class FlipInProgress(RuntimeError):
    """The engine's role is being flipped already (a 409)."""


def old_role_work(engine: EngineHandle, old: str, new: str) -> int:
    """The router's calls open on `engine` that its old role brought and its new one does not
    do."""
    return sum(getattr(engine, counter) for work, counters in WORK.items()
               if old in (work, "any") and new not in (work, "any") for counter in counters)


class RoleFlips:
    def __init__(self, pool: EnginePool, registry: Registry):
        self.pool = pool
        self._flipping: set[str] = set()
        self._flips = registry.counter(
            "microserve_router_role_flips_total",
            "Engine role changes, by engine, roles and reason (ops: the admin API; restore: "
            "the auto strategy swapped out, giving roles back; else its rule).",
            ["engine", "from_role", "to_role", "reason"])

    @property
    def in_flight(self) -> bool:
        """Whether some engine's role is being flipped now."""
        return bool(self._flipping)

    async def flip(self, name: str, role: str, wait_s: float, reason: str = "ops") -> dict:
        """Drain `name`'s old-role work (at most `wait_s`), then give it `role`; `reason` is
        who asked (the counter's label). Raises UnknownEngine, ValueError (a role that is
        none), FlipInProgress."""
        engine = self.pool[name]
        replace(engine.spec, role=role)  # checks the role before anything changes
        if name in self._flipping:
            raise FlipInProgress(f"engine {name!r} is already changing its role; retry when "
                                 "that is done")
        old = engine.role
        if old == role:
            return {"engine": name, "from": old, "to": role, "flipped": False,
                    "waited_s": 0.0, "left": 0}
        self._flipping.add(name)
        was_draining, engine.draining = engine.draining, True
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:  # (to the deadline, not a poll past it: a flip's time is bounded by wait_s)
            while old_role_work(engine, old, role) and (
                    left_s := started + wait_s - loop.time()) > 0:
                await asyncio.sleep(min(POLL_S, left_s))
            left = old_role_work(engine, old, role)
            engine.spec = replace(engine.spec, role=role)
        finally:
            engine.draining = was_draining
            self._flipping.discard(name)
        waited = loop.time() - started
        self._flips.inc(engine=name, from_role=old, to_role=role, reason=reason)
        log.info("engine %s: role %s -> %s (%s) after %.3f s%s", name, old, role, reason, waited,
                 f" ({left} calls of its old role still open)" if left else "")
        return {"engine": name, "from": old, "to": role, "flipped": True, "waited_s": waited,
                "left": left}
