"""The router daemon: one OpenAI endpoint in front of several engines, driven by a strategy.

    microserve router --model smollm2-135m-instruct --strategy pd \\
        --engine p0=http://127.0.0.1:8001,prefill --engine d0=http://127.0.0.1:8002,decode

It tokenizes (chat template included) and detokenizes once, here, with the same OpenAI frontend
an engine serves (microserve/openai/app.py) over a RouterBackend; engines see token ids only.
Routes: /v1/completions, /v1/chat/completions, /v1/models, /health (200 while an engine is
routable), /metrics, OpenAI's Files and Batches API under /v1/files and /v1/batches when it has
a data directory (router/batches/), and the ops API under /admin (router/admin.py). Binds
127.0.0.1 unless told otherwise. No torch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from microserve.auth import RequireBearer
from microserve.backend import BackendUnavailable
from microserve.http_limits import fit_file_limit
from microserve.http_server import QuietServer, listen_socket
from microserve.metrics import Registry
from microserve.openai.app import build_openai_app, model_sampling_defaults
from microserve.tokenizer import Tokenizer
from router.admin import AdminAPI, add_admin_routes
from router.backend import RouterBackend
from router.batches.admission import Admission, LiveRequests
from router.batches.api import UPLOAD_BODY_BYTES, BatchAPI, add_batch_routes
from router.batches.runner import BatchRunner
from router.batches.store import Store
from router.discovery import Discovery, DnsName
from router.engines import EnginePool, EngineSpec
from router.host import StrategyHost, StrategySource
from router.settings import RouterSettings

log = logging.getLogger("microserve.router")

# Descriptors a client connection holds in the router: its own socket, and the engine calls its
# request keeps open (P/D: remote_send on P while start_generate streams from D). Measured:
# 2,000 concurrent streams, 5,926 descriptors (docs/router.md, "Connections: deadlines and a cap").
FDS_PER_CONNECTION = 3


@dataclass(frozen=True)
class RouterConfig(RouterSettings):
    """The router's settings (router/settings.py, keyword arguments) and what a running router
    is handed: its tokenizer, its engines, its secrets."""

    tokenizer_dir: str  # a model directory with tokenizer.json (resolved by the caller)
    served_model_name: str
    engines: tuple[EngineSpec, ...]
    engines_from_dns: tuple[DnsName, ...] = ()  # names whose addresses are engines
    api_key: str | None = None  # guards /v1 when set
    admin_token: str | None = None  # opens /admin to its bearer; None: /admin is closed
    engine_api_key: str | None = None  # the engines' --api-key
    deployment: str | None = None  # adopt only engines reporting this deployment (set by up)
    poll_interval_s: float = 0.5
    max_retries: int = 2
    engine_wait_s: float = 120.0  # how long start-up waits for each engine to answer

    def __post_init__(self):
        super().__post_init__()
        if not self.engines and not self.engines_from_dns:
            raise ValueError("a router needs engines: --engine NAME=URL or --engines-from-dns "
                             "NAME")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        for key in ("api_key", "admin_token", "engine_api_key"):
            if getattr(self, key) == "":
                raise ValueError(f"{key} must not be empty (leave it unset for no check)")


class Router:
    """The router's parts, started and stopped together (see `running`)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.registry = Registry()
        self.pool = EnginePool(api_key=config.engine_api_key,
                               poll_interval_s=config.poll_interval_s,
                               queue_timeout_s=config.queue_timeout_s, registry=self.registry,
                               deployment=config.deployment,
                               health_timeout_s=config.health_timeout_s,
                               liveness_timeout_s=config.liveness_timeout_s,
                               channels=not config.engine_streams)
        self.discovery = Discovery(self.pool, config.engines_from_dns, config.dns_interval_s,
                                   self.registry)
        self.host = StrategyHost(self.pool)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer_dir, config.chat_template)
        self.backend = RouterBackend(self.pool, self.host, config.served_model_name,
                                     self.registry, max_retries=config.max_retries)
        self.admission = Admission(config.batch_lines_per_engine,
                                   lambda: len(self.pool.routable()))
        self.batches: BatchRunner | None = None  # with a data dir; its task runs from start()
        if config.data_dir is not None:
            self.batches = BatchRunner(Store(config.data_dir), self.app, self.tokenizer,
                                       self.registry, self.admission, config.api_key,
                                       config.batch_order)
        self._app: FastAPI | None = None  # built once, by app()

    async def start(self) -> None:
        for spec in self.config.engines:
            await self._add_when_up(spec)
        if self.config.engines_from_dns:
            await self.discovery.start()
        await self.host.load(StrategySource.parse(self.config.strategy),
                             self.config.strategy_args)
        await self.pool.start()
        if self.config.watch_strategy:
            self.host.watch()
        if self.batches is not None:
            self.batches.start()  # resumes what a previous run left unfinished

    async def _add_when_up(self, spec: EngineSpec) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.engine_wait_s
        while True:
            try:
                await self.pool.add(spec)
                return
            except BackendUnavailable as e:
                if loop.time() > deadline:
                    raise RuntimeError(f"engine {spec.name} at {spec.url} did not answer within "
                                       f"{self.config.engine_wait_s:.0f} s: {e}") from e
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self.batches is not None:
            await self.batches.close()
            self.batches.store.close()
        await self.discovery.close()
        await self.host.close()
        await self.pool.close()

    def app(self) -> FastAPI:
        """The router's ASGI app: built on first call, the same one after (the batch runner
        sends its lines into it)."""
        if self._app is None:
            self._app = self._build_app()
        return self._app

    def _build_app(self) -> FastAPI:
        defaults = model_sampling_defaults(self.config.tokenizer_dir,
                                           self.config.generation_config)
        app = build_openai_app(self.backend, self.tokenizer, registry=self.registry,
                               tool_call_parser=self.config.tool_call_parser,
                               larger_bodies={"/v1/files": UPLOAD_BODY_BYTES},
                               sampling_defaults=defaults,
                               reasoning_parser=self.config.reasoning_parser)
        add_batch_routes(app, self.batches and BatchAPI(self.batches.store, self.batches,
                                                        self.config.api_key))
        app.add_middleware(LiveRequests, admission=self.admission)
        strategies_dir = self.config.strategies_dir
        add_admin_routes(app, AdminAPI(self.pool, self.host, self.tokenizer,
                                       Path(strategies_dir) if strategies_dir else None))
        guards = [("/admin/", self.config.admin_token)]  # None: closed
        if self.config.api_key is not None:
            guards.append(("/v1/", self.config.api_key))
        app.add_middleware(RequireBearer, guards=guards)
        return app

    def server(self, log_level: str) -> QuietServer:
        """The HTTP server of `app()`, every client connection bounded by the config's
        http_limits; raises the process's open-file limit to what they need."""
        limits = fit_file_limit(self.config.http_limits, FDS_PER_CONNECTION)
        return QuietServer.serving(self.app(), log_level, limits)


async def serve(config: RouterConfig, log_level: str = "info") -> None:
    """Run the router until SIGINT/SIGTERM (or until cancelled)."""
    sock = listen_socket(config.host, config.port)  # first: a busy port fails before anything
    router = Router(config)
    await router.start()
    server = router.server(log_level)
    active = router.host.active
    print(f"microserve router serving {config.served_model_name!r} on "
          f"http://{config.host}:{config.port}/v1 over {len(router.pool)} engines, strategy "
          f"{active.name} ({active.source.origin})", flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        await router.close()
