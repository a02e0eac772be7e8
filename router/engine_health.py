"""The pool's health half: each engine's liveness probe and stats poll, and marking engines
down (`EnginePool` in router/engines.py is a `PoolHealth`).

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
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING

from microserve.auth import proves_key
from microserve.backend import BackendUnavailable, MicroservingError
from microserve.messages import EngineInfo, EngineStats
from microserve.microserving_client import EngineClient

if TYPE_CHECKING:
    from router.engine_handle import EngineHandle
    from router.prefix_index import PrefixIndex

log = logging.getLogger("microserve.router")


class NotVerified(ValueError):
    """What answers at an engine's URL did not prove it is an engine holding the deployment's
    engine key (a 400 in the admin API): it gets nothing sent with the key."""


class PoolHealth:
    """Liveness probes, stats polls and marking down, for the engines of `EnginePool`, which
    sets every attribute below in its constructor."""

    api_key: str | None
    poll_interval_s: float
    health_timeout_s: float
    liveness_timeout_s: float
    prefix_index: PrefixIndex
    marked_down: int  # times an engine went down (poll or failed call); written here only
    stats_missed: int  # stats reads that failed or came late (the engine stayed up)
    _down: dict[str, asyncio.Event]  # set when the engine is marked down
    _poller: asyncio.Task | None
    # (probe, engine) -> its probe in flight; started and cancelled by the poller alone
    _probes: dict[tuple[str, str], asyncio.Task]

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
