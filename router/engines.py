"""The router's engines: one handle per engine, and the pool strategies pick them from.

    engine = engines.round_robin()                 # any role, skipping engines down or draining
    d = engines.least_loaded("decode")             # fewest calls open from this router, then
                                                   # the engine's own running + waiting
    p = engines.pick("prefill", exclude=(d.name,)) # the same, or None if no such engine is up
    p, d = engines.prefill_decode()                # a P/D pair, degrading when a role is down
    e = engines.by_affinity(request)               # best by LoRA adapter residency, prefix held
                                                   # and load (router/affinity.py)
    p = engines["p0"]                              # by name
    engines.prefix_index.match(request.prompt, request.adapter)  # which engine holds how much
                                                   # of the prompt (for its LoRA adapter)

`EngineHandle` (router/engine_handle.py) is one engine with the router's bookkeeping around
each call; `PoolHealth` (router/engine_health.py) probes each engine's liveness and polls its
stats.

Roles: "prefill", "decode", or "any" (both). Asking for a role gives the engines of that role
and the "any" ones. A role is a routing preference, not a limit: every engine can prefill and
decode, so `prefill_decode` lets a decode engine serve a whole request when no prefill engine is
up, and any engine serve it when no decode engine is (counted in
microserve_router_pd_fallbacks_total).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from microserve.backend import BackendUnavailable
from microserve.messages import EngineInfo
from microserve.metrics import Registry
from microserve.microserving_client import EngineClient
from router.affinity import Weights, scores
from router.engine_handle import EngineHandle
from router.engine_health import PoolHealth
from router.prefix_index import PrefixIndex
from router.roles import RoleFlips

if TYPE_CHECKING:
    from router.strategy import Request
log = logging.getLogger("microserve.router")

ROLES = ("any", "prefill", "decode")
LIVENESS_TIMEOUT_S = 5.0  # the default: an engine silent this long is down
# Facts every engine of one pool must share: one model, one token space, one KV page size.
SAME_IN_POOL = ("model_name", "vocab_size", "page_size", "dtype")


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


class EnginePool(PoolHealth):
    """The engines a router routes to; what `Strategy.generate` gets as `engines`."""

    def __init__(self, *, api_key: str | None = None, poll_interval_s: float = 0.5,
                 timeout_s: float = 30.0, queue_timeout_s: float = 60.0,
                 registry: Registry | None = None, deployment: str | None = None,
                 health_timeout_s: float | None = None,
                 liveness_timeout_s: float = LIVENESS_TIMEOUT_S, channels: bool = True):
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
            channels: read start_generate's chunks on one channel per engine (EngineClient's
                `channel`); False: a stream per request.
        """
        self.channels = channels
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
        self.roles = RoleFlips(self, registry)  # POST /admin/engines/{name}/role
        self._engines: dict[str, EngineHandle] = {}
        self._rr = itertools.count()
        self._poller: asyncio.Task | None = None
        # (probe, engine) -> its probe in flight; started and cancelled by the poller alone
        self._probes: dict[tuple[str, str], asyncio.Task] = {}
        self.adapter: str | None = None  # set in a with_adapter view only
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
        """Engines up, not draining, serving `role` (None: any role), in the order added;
        in a `with_adapter` view, only those with its adapter registered."""
        return [e for e in self._engines.values() if e.routable and e.serves(role)
                and (self.adapter is None or self.adapter in e.lora_names)]

    def with_adapter(self, name: str) -> EnginePool:
        """This pool as a request for LoRA adapter `name` sees it: every pick (round_robin,
        least_loaded, pick, prefill_decode) among the engines that have it registered. A
        shallow copy: engines, load and counters are the pool's own."""
        view = copy.copy(self)
        view.adapter = name
        return view

    def lora_names(self) -> list[str]:
        """The adapters some routable engine has registered."""
        return sorted({n for e in self.routable() for n in e.lora_names})

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

    def by_affinity(self, request: Request, role: str | None = None,
                    weights: Weights = Weights()) -> EngineHandle:
        """The routable engine of `role` that scores best for `request` by its LoRA adapter's
        residency, the prefix it holds and its load (router/affinity.py). Raises
        BackendUnavailable if none is up."""
        self._need(role)
        return self[scores(request, self, role, weights)[0].engine]

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
        if not decode.receives_kv:  # --kv-transfer none: it serves requests whole
            return None, decode
        cannot_send = tuple(e.name for e in self.routable("prefill") if not e.sends_kv)
        prefill = self.pick("prefill", exclude=(decode.name, *cannot_send))
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
        client = EngineClient(spec.url, api_key=self.api_key, timeout_s=self.timeout_s,
                              channel=self.channels)
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

    def metrics_text(self) -> str:
        """Prometheus text of the pool's state, rendered when /metrics is read."""
        registry = Registry()
        up = registry.gauge("microserve_router_engine_up",
                            "1 if the engine is routable (up and not draining).", ["engine"])
        sends = registry.gauge("microserve_router_engine_open_sends",
                               "remote_send calls open on the engine.", ["engine"])
        gens = registry.gauge("microserve_router_engine_open_generations",
                              "start_generate streams open on the engine.", ["engine"])
        receives = registry.gauge("microserve_router_engine_open_receives",
                                  "P/D requests and migrations on their way to the engine "
                                  "(its KV being sent; their generation not open yet).",
                                  ["engine"])
        for e in self:
            up.set(float(e.routable), engine=e.name)
            sends.set(e.open_sends, engine=e.name)
            gens.set(e.open_generations, engine=e.name)
            receives.set(e.open_receives, engine=e.name)
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
        return [{"name": e.name, "url": e.url, "role": e.role, "added_role": e.added_role,
                 "source": e.source,
                 "state": _state(e),
                 "down_reason": e.down_reason or None, "open_sends": e.open_sends,
                 "open_generations": e.open_generations, "open_receives": e.open_receives,
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
