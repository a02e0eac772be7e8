"""The `auto` strategy's role steering: the task that shows the pool to its RolePolicy
(router/role_policy.py) once per poll and carries out the flips it decides.

    steering = RoleSteering(policy, pool, chosen=lambda: auto.chosen, tpot_s=auto.tpot_s,
                            wait_s=1.5, measured=auto.measured)
    steering.start()      # auto's start(): the task begins
    steering.retire()     # auto swapped out: no flip from now on (its requests still run),
                          # and the engines it flipped get their roles from before it back
    await steering.stop() # auto's stop(): the task cancelled and awaited, the restoring awaited

A flip goes through the same call as the ops API's (`pool.roles.flip`, reason: the rule), so it
drains the old role's work the same way, is logged and counted in
microserve_router_role_flips_total{engine,from_role,to_role,reason}; the last ones are kept
for GET /admin/strategy. A flip cancelled by `stop` leaves the engine's role and routing as
they were (RoleFlips restores them).

Swapped out, the steering gives each engine it flipped the role it had before its first flip
here (reason `restore`, the same drain), unless the engine's role is no longer the one the last
flip here gave it (an ops call changed it since: that one stands): the strategy swapped in
next, a fixed P/D one say, finds the roles the deployment set, not the last ones `auto` chose.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from router.engines import UnknownEngine
from router.role_policy import EngineView, Observation, RolePolicy
from router.roles import FlipInProgress

if TYPE_CHECKING:
    from router.engine_handle import EngineHandle
    from router.engines import EnginePool

log = logging.getLogger("microserve.router")

KEPT_FLIPS = 8  # the last flips GET /admin/strategy shows


class RoleSteering:
    def __init__(self, policy: RolePolicy, pool: EnginePool,
                 chosen: Callable[[], Mapping[str, int]],
                 tpot_s: Callable[[EngineHandle], float], wait_s: float,
                 measured: Callable[[EngineHandle], tuple[float, float]] = lambda e: (0.0, 0.0)):
        """
        Args:
            chosen: the strategy's running count of its choices, by kind.
            tpot_s: an engine's predicted step time with one more sequence decoding.
            wait_s: how long a flip waits for its old role's work.
            measured: an engine's mean step over its last poll and the share of its time
                its prompts took lately, in seconds and (0, 1).
        """
        self.policy, self.pool, self.wait_s = policy, pool, wait_s
        self._chosen, self._tpot_s, self._measured = chosen, tpot_s, measured
        self._last_chosen: dict[str, int] = dict(chosen())
        self._task: asyncio.Task | None = None  # started by start(), ended by stop()
        # engine -> (its role before the first flip here, the role the last flip here gave it)
        self._flipped: dict[str, tuple[str, str]] = {}
        self._restoring: asyncio.Task | None = None  # started by retire()
        self.flips: deque[dict] = deque(maxlen=KEPT_FLIPS)  # written by _flip only
        self.flips_total = 0  # every flip appended to `flips`, the ones it dropped too

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def retire(self) -> None:
        """No flip from now on, and the roles from before this steering's flips back (a task
        of its own); `stop` awaits both."""
        if self._task is not None:
            self._task.cancel()
        if self._flipped and self._restoring is None:
            self._restoring = asyncio.get_running_loop().create_task(self._restore())

    async def stop(self) -> None:
        """The task cancelled and awaited; the restoring (each flip bounded by `wait_s`)
        awaited to its end."""
        if self._task is not None:
            self._task.cancel()
        await asyncio.gather(*(t for t in (self._task, self._restoring) if t is not None),
                             return_exceptions=True)

    async def _restore(self) -> None:
        if self._task is not None:  # a flip of its own in flight ends first (cancelled)
            await asyncio.gather(self._task, return_exceptions=True)
        # one engine at a time: a flip drains its engine (no new request routed to it for up
        # to wait_s), and two at once could leave no engine to take a request
        for name, (before, given) in self._flipped.items():
            engine = self.pool.get(name)
            if engine is None or engine.role != given or before == given:
                continue  # gone, changed by an ops call since, or back already
            try:
                result = await self.pool.roles.flip(name, before, self.wait_s, reason="restore")
            except (UnknownEngine, FlipInProgress) as e:
                log.warning("auto: engine %s keeps role %s: %s", name, given, e)
                continue
            self.flips.append({**result, "reason": "restore", "at": time.time()})
            self.flips_total += 1

    def observation(self, now: float) -> Observation:
        """The pool now, and the choices made since the last observation."""
        chosen = dict(self._chosen())
        since = {k: n - self._last_chosen.get(k, 0) for k, n in chosen.items()}
        self._last_chosen = chosen
        engines = tuple(EngineView(e.name, e.role, e.pending_prefill_tokens, e.decoding,
                                   self._tpot_s(e), _kv_use(e), e.seats or 0,
                                   *self._measured(e))
                        for e in self.pool.routable())
        return Observation(now, engines, since, self.pool.roles.in_flight)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.pool.poll_interval_s)
            try:
                flip = self.policy.observe(self.observation(time.monotonic()))
            except Exception:  # a bug here must not end the steering silently
                log.exception("auto: role steering failed to observe the pool")
                continue
            if flip is not None:
                try:
                    await self._flip(flip)
                finally:
                    self.policy.done(time.monotonic())

    async def _flip(self, flip) -> None:
        try:
            result = await self.pool.roles.flip(flip.engine, flip.to_role, self.wait_s,
                                                reason=flip.reason)
        except (UnknownEngine, FlipInProgress) as e:  # it left the pool, or an ops flip won
            log.warning("auto: no %s flip of engine %s: %s", flip.reason, flip.engine, e)
            return
        self.flips.append({**result, "reason": flip.reason, "at": time.time()})
        self.flips_total += 1
        if result["flipped"]:
            before = self._flipped.get(flip.engine, (result["from"], ""))[0]
            self._flipped[flip.engine] = (before, result["to"])

    def describe(self) -> dict:
        return {**self.policy.describe(time.monotonic()), "flips": list(self.flips),
                "flips_total": self.flips_total}


def _kv_use(engine: EngineHandle) -> float:
    load = engine.load
    return load.kv_pages_used / load.kv_pages_total if load and load.kv_pages_total else 0.0
