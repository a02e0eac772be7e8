"""Engines found through DNS: the addresses of a name (a Kubernetes headless Service), polled.

    microserve router --engines-from-dns microserve-prefill:8000,prefill \\
                      --engines-from-dns microserve-decode:8000,decode --dns-interval-s 5

Every `interval_s` each name is resolved with the system resolver (`loop.getaddrinfo`, A and
AAAA records; in a pod /etc/resolv.conf points at the cluster's DNS and its search domains), and
the pool follows the answer:

    address appears      added through EnginePool.add, the admin API's path: it must answer
                         and serve the pool's model (and deployment, when the router has one);
                         one that does not is tried again at the next poll
    address disappears   drained (no new requests), then removed once its calls have ended
    address comes back   undrained, if it was this discovery that drained it

Engines are named NAME@ADDRESS (`microserve-decode@10.244.1.7`), the name a pod's preStop
hook drains through the admin API, and shown with source "dns:NAME" in /admin/engines.

A failed lookup (the resolver unreachable, a timeout, a SERVFAIL) changes nothing: it is logged
and counted (microserve_router_dns_failures_total) and the engines stay as they were, so a DNS
blip never drops every engine at once. An answer that the name has no address (NXDOMAIN, or no
A/AAAA record: a Service scaled to zero) is believed only after EMPTY_CONFIRMATIONS of them in
a row. Engines added statically or through the admin API are never touched here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass

from microserve.backend import BackendUnavailable
from microserve.metrics import Registry
from router.engines import ROLES, EnginePool, EngineSpec

log = logging.getLogger("microserve.router")

DEFAULT_PORT = 8000
EMPTY_CONFIRMATIONS = 3  # "no such name" answers in a row before a name's engines are drained
# getaddrinfo's answers that the name has no address (as opposed to a failed lookup).
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@dataclass(frozen=True)
class DnsName:
    """One --engines-from-dns NAME[:PORT][,ROLE]: the engines behind a DNS name."""

    name: str
    port: int = DEFAULT_PORT
    role: str = "any"

    def __post_init__(self):
        if not self.name or "/" in self.name or "@" in self.name or ":" in self.name:
            raise ValueError(f"DNS name {self.name!r} must be non-empty, without '/', '@', ':'")
        if not 0 < self.port < 65536:
            raise ValueError(f"DNS name {self.name!r}: port {self.port} not in 1..65535")
        if self.role not in ROLES:
            raise ValueError(f"DNS name {self.name!r}: role {self.role!r} is not one of {ROLES}")

    @classmethod
    def parse(cls, value: str) -> DnsName:
        """'NAME[:PORT][,ROLE]' -> DnsName; ValueError naming what is wrong."""
        where, _, role = value.partition(",")
        name, sep, port = where.partition(":")
        if sep and not port.isdigit():
            raise ValueError(f"{value!r}: port {port!r} is not a number (NAME[:PORT][,ROLE])")
        return cls(name, int(port) if sep else DEFAULT_PORT, role or "any")

    @property
    def source(self) -> str:
        return f"dns:{self.name}"

    def spec(self, address: str) -> EngineSpec:
        host = f"[{address}]" if ":" in address else address
        return EngineSpec(f"{self.name}@{address}", f"http://{host}:{self.port}", self.role)


class Discovery:
    """Keeps the pool's engines of each DNS name equal to the name's addresses."""

    def __init__(self, pool: EnginePool, names: tuple[DnsName, ...], interval_s: float = 5.0,
                 registry: Registry | None = None):
        """
        Args:
            pool: where engines are added, drained and removed.
            names: the DNS names to follow; their `source`s must be distinct.
            interval_s: seconds between two lookups of each name.
            registry: where the counters live (a fresh one if None).
        """
        if not interval_s > 0:
            raise ValueError(f"dns interval {interval_s} s must be > 0")
        sources = [n.source for n in names]
        if len(set(sources)) != len(sources):
            raise ValueError(f"DNS names must be distinct, got {[n.name for n in names]}")
        self.pool, self.names, self.interval_s = pool, names, interval_s
        registry = registry or Registry()
        self._failures = registry.counter(
            "microserve_router_dns_failures_total",
            "DNS lookups of an engine name that failed (the engines stayed as they were).",
            ["name"])
        self._refused = registry.counter(
            "microserve_router_dns_refused_total",
            "Discovered engines the pool refused (another model or deployment).", ["name"])
        self._empty: dict[str, int] = {}  # "no address" answers in a row, by name
        self._drained: set[str] = set()  # engines this discovery drained (their address left)
        self._unready: dict[str, str] = {}  # engine -> why it was not added yet (logged once)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Look every name up once, then keep polling in the background."""
        if self._task is None:
            await self.refresh()
            self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.refresh()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def refresh(self) -> None:
        """Look every name up and make the pool follow the answers."""
        answers = await asyncio.gather(*(self._lookup(n) for n in self.names))
        await asyncio.gather(*(self._follow(name, addresses)
                               for name, addresses in zip(self.names, answers)
                               if addresses is not None))

    async def _lookup(self, name: DnsName) -> set[str] | None:
        """The name's addresses; None when the answer is not to be acted on."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(name.name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in _NO_ADDRESS:
                seen = self._empty[name.name] = self._empty.get(name.name, 0) + 1
                if seen >= EMPTY_CONFIRMATIONS:
                    return set()
                log.warning("DNS: %s has no address (%d of %d answers in a row before its "
                            "engines are drained)", name.name, seen, EMPTY_CONFIRMATIONS)
                return None
            self._failures.inc(name=name.name)
            log.warning("DNS lookup of %s failed, engines kept as they are: %s", name.name, e)
            return None
        except OSError as e:
            self._failures.inc(name=name.name)
            log.warning("DNS lookup of %s failed, engines kept as they are: %s", name.name, e)
            return None
        self._empty.pop(name.name, None)
        return {str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos}

    async def _follow(self, name: DnsName, addresses: set[str]) -> None:
        wanted = {spec.name: spec for spec in map(name.spec, addresses)}
        have = {e.name: e for e in self.pool if e.source == name.source}
        for engine_name, engine in have.items():
            if engine_name in wanted:
                if engine_name in self._drained:
                    self._drained.discard(engine_name)
                    self.pool.undrain(engine_name)
                    log.info("DNS: %s is back in %s; undrained", engine_name, name.name)
                continue
            if not engine.draining:
                self.pool.drain(engine_name)
                self._drained.add(engine_name)
                log.info("DNS: %s left %s; draining it", engine_name, name.name)
            if engine.open_calls == 0:
                self.pool.remove(engine_name)
                self._drained.discard(engine_name)
                log.info("DNS: %s removed (drained)", engine_name)
        # Added last: one that does not answer makes this wait up to the liveness timeout.
        await asyncio.gather(*(self._add(name, spec) for n, spec in wanted.items()
                               if n not in have))
        for engine_name in list(self._unready):
            if engine_name not in wanted and engine_name.startswith(name.name + "@"):
                del self._unready[engine_name]

    async def _add(self, name: DnsName, spec: EngineSpec) -> None:
        try:
            await self.pool.add(spec, source=name.source)
        except (BackendUnavailable, ValueError) as e:
            if isinstance(e, ValueError):
                self._refused.inc(name=name.name)
            if self._unready.get(spec.name) != str(e):  # once per reason, not every poll
                self._unready[spec.name] = str(e)
                log.warning("DNS: engine %s (%s) not added, tried again at the next lookup: "
                            "%s", spec.name, spec.url, e)
            return
        self._unready.pop(spec.name, None)
        log.info("DNS: engine %s found in %s", spec.name, name.name)
