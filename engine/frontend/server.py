"""The engine daemon: an OpenAI-compatible HTTP frontend in front of one engine-core process.

    microserve engine --model DIR_OR_NAME --host 127.0.0.1 --port 8000

Two processes (see engine/core_proc.py for why): this one (asyncio, no torch) parses HTTP,
tokenizes, detokenizes and streams; the core process owns the model and runs the step loop. If
the core process dies, this daemon exits too, so a supervisor sees one failure, not a server
that answers /health with 503 forever.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI

from engine.config import EngineConfig
from engine.frontend.core_client import CoreClient
from engine.frontend.microserving_api import add_microserving_routes
from microserve.http_limits import HttpLimits, fit_file_limit
from microserve.http_server import QuietServer, listen_socket
from microserve.openai.app import build_openai_app, model_sampling_defaults
from microserve.tokenizer import Tokenizer

log = logging.getLogger("microserve.engine")

FDS_PER_CONNECTION = 1  # a client's socket (the core's is one for all of them)


def build_engine_app(client: CoreClient, tokenizer: Tokenizer,
                     api_key: str | None = None, tool_call_parser: str = "hermes",
                     sampling_defaults: dict | None = None,
                     reasoning_parser: str | None = None) -> FastAPI:
    """The OpenAI API over the engine, plus the microserving API (microserving_api.py)."""
    app = build_openai_app(client, tokenizer, tool_call_parser=tool_call_parser,
                           sampling_defaults=sampling_defaults, reasoning_parser=reasoning_parser)
    add_microserving_routes(app, client, api_key=api_key)
    return app


async def serve(config: EngineConfig, served_model_name: str, host: str, port: int,
                log_level: str = "info", api_key: str | None = None,
                deployment: str | None = None, tool_call_parser: str = "hermes",
                http_limits: HttpLimits = HttpLimits(), generation_config: str = "auto",
                chat_template: str | None = None, reasoning_parser: str | None = None) -> None:
    sock = listen_socket(host, port)  # first: a busy port fails before the model loads
    limits = fit_file_limit(http_limits, FDS_PER_CONNECTION)
    tokenizer = Tokenizer.from_dir(config.model, chat_template)
    client = CoreClient(config, served_model_name, engine_key=api_key)
    await client.start()
    client.info.deployment = deployment  # what /microserving/stats reports with the model
    info = client.info
    log.info(
        "engine ready: model %s (%s, %s), KV %d pages x %d = %d tokens, max_model_len %d, "
        "KV transfer %s",
        served_model_name, info.device, info.dtype, info.num_pages, info.page_size,
        info.kv_capacity_tokens, info.max_model_len, info.kv_transfer,
    )  # fmt: skip
    defaults = model_sampling_defaults(config.model, generation_config)
    app = build_engine_app(client, tokenizer, api_key, tool_call_parser, defaults,
                           reasoning_parser)
    server = QuietServer.serving(app, log_level, limits)

    async def stop_when_core_exits():
        await client.exited.wait()
        server.should_exit = True

    watcher = asyncio.create_task(stop_when_core_exits())
    print(f"microserve engine serving {served_model_name!r} on http://{host}:{port}/v1",
          flush=True)  # fmt: skip
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        core_died = client.exited.is_set()  # before close(), which sets it too
        await client.close()
    if core_died:
        raise SystemExit(1)  # a supervisor should see the failure
