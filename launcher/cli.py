"""`microserve` command line: one subcommand each (`microserve --help` lists them).

    microserve up CONFIG          a deployment: engines + router from one file (deploy/*.toml)
    microserve engine ...         one engine (OpenAI API + microserving API)
    microserve router ...         the router in front of engines already running
    microserve drain ROUTER ...   drain an engine through a router's admin API and wait
    microserve admin-token        the admin token a running router made for itself
    microserve model-path [MODEL] the Hugging Face directory a --model resolves to
    microserve quantize MODEL OUT an fp8 copy of a checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from engine.config import KV_CACHE_DTYPES, EngineConfig  # plain data: no torch
from microserve.http_limits import HttpLimits  # plain data: no server

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


class _Help(argparse.HelpFormatter):
    """An option's default after its help, unless the help says it
    or there is none to say (a flag, an empty list)."""

    def _get_help_string(self, action) -> str:
        help = action.help or ""
        default = action.default
        if ("default" in help or not action.option_strings or default is None
                or default is argparse.SUPPRESS or isinstance(default, bool)
                or default in ([], {})):
            return help
        return f"{help} (default: %(default)s)" if help else "default: %(default)s"


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=_Help)


def _log_level_arg(p) -> None:
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")


def _config_option(p, flag: str, field: str | None = None, **kwargs) -> None:
    """An option that sets the EngineConfig field `field` (default: the flag's name), with the
    field's default: the config says what the defaults are, the command line how to ask."""
    field = field or flag.removeprefix("--").replace("-", "_")
    p.add_argument(flag, dest=field, default=_CONFIG_FIELDS[field].default, **kwargs)


def _auto_on_off(value: str) -> bool | None:
    try:
        return {"auto": None, "on": True, "off": False}[value]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto, on or off") from None


def _engine_args(sub) -> None:
    p = _command(sub, "engine", "serve one model from one engine (OpenAI API and the "
                                "microserving API)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face Llama-family directory, or "
                        f"{DEFAULT_MODEL_NAME} (the default, embedded)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the --model argument)")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on")
    p.add_argument("--port", type=int, default=8000, help="the port of its HTTP API")
    _http_limit_args(p)
    p.add_argument("--deployment", default=None,
                   help="the deployment this engine belongs to, reported in its stats (set by "
                        "`microserve up`: its router adopts only its own engines; default: "
                        "none)")
    _config_option(p, "--device", help="cpu, cuda or cuda:N")
    _config_option(p, "--dtype", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, "
                                      "float16")
    _config_option(p, "--quantization", choices=("fp8",),
                   help="fp8: the decoder layers' weights as float8 e4m3, quantized at load "
                        "with a scale per output channel; activations quantized per token "
                        "(CUDA: compute capability 8.9+; default: the model's dtype)")
    _config_option(p, "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8 (fp8_e4m3): the KV cache as float8 e4m3, "
                        "scale 1, saturated at +-448: twice the tokens in the same memory "
                        "(CUDA: compute capability 8.9+)")
    _config_option(p, "--page-size", type=int, help="tokens per KV page")
    _config_option(p, "--kv-cache-memory-gb", type=float, help="size of the KV pool (CPU)")
    _config_option(p, "--gpu-memory-utilization", type=float,
                   help="share of the GPU's memory for weights, activations and KV (CUDA)")
    _config_option(p, "--num-pages", type=int, help="KV pool size in pages (default: from "
                                                    "the memory size)")
    _config_option(p, "--max-num-batched-tokens", type=int,
                   help="per-step token budget (prefill chunk + decodes; default: 512 on CPU, "
                        "2048 on CUDA)")
    _config_option(p, "--max-num-seqs", type=int, help="sequences running at once "
                                                       "(default: 256)")
    _config_option(p, "--max-model-len", type=int,
                   help="longest prompt + output in tokens (default: the model's "
                        "max_position_embeddings)")
    _config_option(p, "--no-prefix-cache", "enable_prefix_cache", action="store_false",
                   help="do not reuse the KV of earlier requests' common prefixes")
    _config_option(p, "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    _config_option(p, "--skip-warmup", "warmup", action="store_false",
                   help="CUDA: report ready without serving the start-up requests that compile "
                        "the kernels first requests would otherwise wait for")
    _config_option(p, "--max-piecewise-tokens", type=int,
                   help="CUDA: steps with prompt tokens, up to this many in all, replay "
                        "piecewise CUDA graphs, attention eager (default: 2048; 0: eager)")
    _config_option(p, "--async-scheduling", type=_auto_on_off, metavar="{auto,on,off}",
                   help="launch step N before reading step N-1's tokens (default: auto, "
                        "which is on for CUDA)")
    _config_option(p, "--seed", type=int,
                   help="seeds the engine's generator for requests that name no seed")
    _config_option(p, "--log-stats-interval", "log_stats_interval_s", type=float,
                   metavar="SECONDS",
                   help="while it works, the engine logs its throughput, load and where its "
                        "core's time went every this many seconds (default: 10; 0: never)")
    _tool_call_parser_arg(p)
    _config_option(p, "--cpu-threads", type=int,
                   help="torch CPU threads (default: every core); engines sharing a host "
                        "should split the cores (microserve up does)")
    p.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /microserving "
                        "(default: $MICROSERVE_API_KEY; unset: no check)")
    _config_option(p, "--kv-transfer",
                   choices=("auto", "shm", "tcp", "cuda_ipc", "nvshmem", "none"),
                   help="how this engine receives KV from peers (auto: shm on CPU, cuda_ipc "
                        "on CUDA, none without an engine key; tcp: across hosts; nvshmem: GPU "
                        "engines started together by `microserve up`, a fixed group)")
    p.add_argument("--nvshmem-group", default=os.environ.get("MICROSERVE_NVSHMEM_GROUP"),
                   help="nvshmem: this engine's place in its group, RANK/SIZE@DIR (default: "
                        "$MICROSERVE_NVSHMEM_GROUP, which `microserve up` sets)")
    _config_option(p, "--kv-transfer-host", help="tcp: address the KV transfer listener binds")
    _config_option(p, "--kv-transfer-port", type=int, help="tcp: 0 picks a free port")
    _config_option(p, "--kv-transfer-advertise-host",
                   help="tcp: address peers dial (default: the bind address)")
    _config_option(p, "--kv-lease-s", type=float,
                   help="seconds a prep_recv reservation lives after its sender last renewed "
                        "it (senders renew every 0.25 s while they hold the job)")
    _config_option(p, "--kv-lease-max-s", type=float,
                   help="the longest lease a prep_recv may ask for (lease_s)")
    _config_option(p, "--kv-recv-wait-s", type=float,
                   help="how long a prep_recv waits its turn for KV pages when the call names "
                        "no wait_s (then a 503)")
    _config_option(p, "--kv-recv-wait-max-s", type=float,
                   help="the longest wait_s a prep_recv may name")
    _log_level_arg(p)


def _run_engine(args) -> None:
    # Imported here so `microserve --help` stays fast; neither imports torch.
    from engine.frontend.server import serve
    from microserve.model_files import resolve_model

    model_dir = resolve_model(args.model)
    given = {name: value for name, value in vars(args).items()
             if name in _CONFIG_FIELDS and name != "model"}
    config = EngineConfig(model=str(model_dir), **given)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    _run_loop(serve(config, name, args.host, args.port, args.log_level, api_key=args.api_key,
                    deployment=args.deployment, tool_call_parser=args.tool_call_parser,
                    http_limits=_http_limits(args)))


def _run_loop(main):
    """Run `main` on uvloop when it is installed (a faster loop for the per-token path),
    on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _http_limit_args(p) -> None:
    """What each client connection of the HTTP server may take (microserve/http_limits.py)."""
    default = HttpLimits()
    p.add_argument("--max-connections", type=int, default=default.max_connections,
                   help="client connections open at once; a new one past it gets a 503 with "
                        "Retry-After (the open-file limit is raised to fit them)")
    p.add_argument("--header-timeout-s", type=float, default=default.header_timeout_s,
                   help="a request's line and headers must arrive within this many seconds of "
                        "the connection's accept (or of the request's first byte), else a 408 "
                        "and a close")
    p.add_argument("--body-timeout-s", type=float, default=default.body_timeout_s,
                   help="a request's body must arrive within this many seconds of its "
                        "headers, else a 408 and a close")
    p.add_argument("--keep-alive-s", type=float, default=default.keep_alive_s,
                   help="an idle connection is closed this many seconds after its last answer")


def _http_limits(args) -> HttpLimits:
    return HttpLimits(max_connections=args.max_connections,
                      header_timeout_s=args.header_timeout_s,
                      body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s)


def _tool_call_parser_arg(p) -> None:
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default="hermes",
                   help="how tool calls look in the model's text (as vLLM's option): hermes "
                        "(<tool_call> blocks; also how tools are written into the prompt when "
                        "the chat template does not render them) or llama3_json")


def _engine_spec(value: str):
    """NAME=URL[,ROLE] -> EngineSpec."""
    from router.engines import EngineSpec

    name, sep, rest = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=URL[,ROLE]")
    url, _, role = rest.partition(",")
    try:
        return EngineSpec(name, url, role or "any")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dns_name(value: str):
    """NAME[:PORT][,ROLE] -> DnsName."""
    from router.discovery import DnsName

    try:
        return DnsName.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(value: str) -> dict:
    import json

    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


def _secret_args(p, *, up: bool = False) -> None:
    p.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the router's /v1 "
                        "(default: $MICROSERVE_API_KEY)")
    p.add_argument("--admin-token", default=os.environ.get("MICROSERVE_ADMIN_TOKEN"),
                   help="the bearer token /admin requires (default: $MICROSERVE_ADMIN_TOKEN; "
                        "unset: a new one, printed once and saved in a file only you can read)")
    p.add_argument("--engine-api-key", default=os.environ.get("MICROSERVE_ENGINE_API_KEY"),
                   help="the engines' --api-key, sent on every call to them "
                        "(default: $MICROSERVE_ENGINE_API_KEY" + (
                            "; unset: a new one for this deployment's engines)" if up else ")"))
    p.add_argument("--strategies-dir", default=None,
                   help="the directory PUT /admin/strategy {\"path\": ...} may load .py files "
                        "from (default: none; built-ins and uploads only)")
    p.add_argument("--queue-timeout-s", type=float, default=None,
                   help="how long a request may wait for KV pages on a receiving engine, or "
                        "for a prefill engine to start computing it, before it gets a 503 with "
                        "Retry-After (default 60)")
    p.add_argument("--liveness-timeout-s", type=float, default=None,
                   help="an engine whose liveness probe gets no answer this long, or whose "
                        "core has sent no heartbeat this long (stopped, hung, cut off), is "
                        "marked down and the calls open on it end (default 5; a busy engine "
                        "still answers)")
    _log_level_arg(p)


def _router_args(sub) -> None:
    p = _command(sub, "router", "one OpenAI endpoint over engines already running, by a "
                                "strategy")
    p.add_argument("--engine", type=_engine_spec, action="append", default=[],
                   metavar="NAME=URL[,ROLE]",
                   help="an engine (repeat); ROLE: prefill, decode or any (default)")
    p.add_argument("--engines-from-dns", type=_dns_name, action="append", default=[],
                   metavar="NAME[:PORT][,ROLE]",
                   help="engines at every address of a DNS name (repeat; a Kubernetes headless "
                        "Service), followed as addresses come and go; PORT default 8000")
    p.add_argument("--dns-interval-s", type=float, default=5.0,
                   help="seconds between lookups of the --engines-from-dns names")
    p.add_argument("--deployment", default=None,
                   help="adopt only engines started with this --deployment (default: any)")
    p.add_argument("--health-timeout-s", type=float, default=30.0,
                   help="how long a stats poll (an engine's load) may take; a later answer "
                        "leaves the load as it was (--liveness-timeout-s decides what is down)")
    p.add_argument("--model", default=None,
                   help="the model directory (or the embedded default's name) to take the "
                        "tokenizer and chat template from")
    p.add_argument("--served-model-name", default=None,
                   help="the engines' model name (default: the --model argument)")
    _tool_call_parser_arg(p)
    p.add_argument("--strategy", default="data_parallel",
                   help="a built-in strategy (data_parallel, pd, balanced_pd, "
                        "context_migration) or a path to a .py file")
    p.add_argument("--strategy-args", type=_json_object, default={},
                   help='the strategy\'s constructor arguments as JSON: \'{"ratio": 0.2}\'')
    p.add_argument("--watch-strategy", action="store_true",
                   help="reload the strategy's file whenever it changes")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on")
    p.add_argument("--port", type=int, default=8000, help="the port of its HTTP API")
    _http_limit_args(p)
    _secret_args(p)


def _up_args(sub) -> None:
    p = _command(sub, "up", "start a deployment (engines + router) from a TOML file")
    p.add_argument("config", help="a deployment file, e.g. deploy/local-cpu.toml")
    p.add_argument("--host", default=None,
                   help="the router's address (overrides the file's; default: 127.0.0.1). "
                        "The engines keep theirs")
    p.add_argument("--port", type=int, default=None, help="the router's port (overrides the "
                                                          "file's; default: 8000; engines "
                                                          "follow it)")
    p.add_argument("--model", default=None,
                   help="the model every engine loads (overrides the file's `model`): a Hugging "
                        "Face directory, smollm2-135m-instruct, or random:llama-3.1-8b")
    _secret_args(p, up=True)


def _quantize_args(sub) -> None:
    p = _command(sub, "quantize", "write a 16-bit checkpoint's fp8 copy (FP8-dynamic, "
                                  "compressed-tensors layout), served without --quantization")
    p.add_argument("model", help="a Hugging Face Llama directory, smollm2-135m-instruct, or "
                                 "random:llama-3.1-8b")
    p.add_argument("out", help="a new or empty directory for the copy")
    p.add_argument("--device", default="cpu",
                   help="where the weights are quantized (cuda is faster; the result is the same)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors file")
    _log_level_arg(p)


def _run_quantize(args) -> None:
    from engine.models.fp8_export import write_fp8_checkpoint
    from microserve.model_files import resolve_model

    out = write_fp8_checkpoint(resolve_model(args.model), args.out, device=args.device,
                               shard_bytes=int(args.shard_gb * (1 << 30)))  # fmt: skip
    print(f"microserve quantize: wrote {out} (serve it with: microserve engine --model {out})")


def _drain_args(sub) -> None:
    p = _command(sub, "drain", "drain an engine at a router (a pod's preStop hook) and wait "
                               "until the router has no call open on it")
    p.add_argument("router", help="the router's URL, e.g. http://microserve-router:8000")
    p.add_argument("--engine", required=True,
                   help="the engine's name in the router, or its URL (http://POD_IP:8000)")
    p.add_argument("--admin-token", default=os.environ.get("MICROSERVE_ADMIN_TOKEN"),
                   help="the router's admin token (default: $MICROSERVE_ADMIN_TOKEN)")
    p.add_argument("--wait-s", type=float, default=300.0,
                   help="give up waiting for its open calls after this long")
    _log_level_arg(p)


def _admin_token_args(sub) -> None:
    p = _command(sub, "admin-token", "print the admin token a router or deployment on this "
                                     "host made for itself (it was given none)")
    p.add_argument("--port", type=int, default=8000, help="the router's port")


def _run_admin_token(args) -> None:
    from launcher.credentials import saved_admin_token

    print(saved_admin_token(args.port))


def _model_path_args(sub) -> None:
    p = _command(sub, "model-path", "print the Hugging Face directory a --model resolves to: "
                                    "the tokenizer path benchmark clients take (the embedded "
                                    "default is converted there on first use)")
    p.add_argument("model", nargs="?", default=None,
                   help=f"a Hugging Face directory, or {DEFAULT_MODEL_NAME} (the default)")


def _run_model_path(args) -> None:
    from microserve.model_files import resolve_model

    print(resolve_model(args.model))


def _run_drain(args) -> None:
    from router.drain import DrainError, drain

    if not args.admin_token:
        raise ValueError("drain needs the router's admin token: --admin-token or "
                         "MICROSERVE_ADMIN_TOKEN")
    try:
        open_calls = drain(args.router, args.engine, args.admin_token, args.wait_s)
    except DrainError as e:
        raise RuntimeError(str(e)) from None
    left = {name: n for name, n in open_calls.items() if n}
    print(f"microserve drain: {args.engine} drained at {args.router}"
          + (f"; calls still open after {args.wait_s:g} s: {left}" if left else ""), flush=True)


def _run_router(args) -> None:
    from launcher.credentials import admin_token
    from microserve.model_files import resolve_model
    from microserve.http_server import check_port_free
    from router.server import RouterConfig, serve

    check_port_free(args.host, args.port, "the router")  # before a token file is written
    with admin_token(args.admin_token, args.port) as token:
        config = RouterConfig(
            tokenizer_dir=str(resolve_model(args.model)),
            served_model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
            engines=tuple(args.engine), engines_from_dns=tuple(args.engines_from_dns),
            dns_interval_s=args.dns_interval_s, deployment=args.deployment,
            health_timeout_s=args.health_timeout_s,
            strategy=args.strategy, strategy_args=args.strategy_args,
            host=args.host, port=args.port, http_limits=_http_limits(args),
            api_key=args.api_key, admin_token=token,
            engine_api_key=args.engine_api_key, watch_strategy=args.watch_strategy,
            strategies_dir=args.strategies_dir,
            queue_timeout_s=60.0 if args.queue_timeout_s is None else args.queue_timeout_s,
            tool_call_parser=args.tool_call_parser,
            **_given(liveness_timeout_s=args.liveness_timeout_s))
        _run_loop(serve(config, args.log_level))


def _given(**options) -> dict:
    """The options given on the command line (the others keep their one default)."""
    return {k: v for k, v in options.items() if v is not None}


def _run_up(args) -> None:
    from launcher.credentials import new_token
    from launcher.deployment import load_deployment
    from launcher.up import up

    deployment = load_deployment(args.config, port=args.port, host=args.host, model=args.model,
                                 strategies_dir=args.strategies_dir,
                                 queue_timeout_s=args.queue_timeout_s,
                                 liveness_timeout_s=args.liveness_timeout_s)
    # The engines always take a key: their microserving API moves KV and runs prefills, and
    # KV transfer between them is authenticated by it (microserve/transfer_auth.py).
    code = _run_loop(up(deployment, log_level=args.log_level, api_key=args.api_key,
                          admin_token=args.admin_token,
                          engine_api_key=args.engine_api_key or new_token()))
    sys.exit(code)


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests check deploy/kubernetes' commands against it)."""
    ap = argparse.ArgumentParser(
        prog="microserve", formatter_class=_Help,
        description="LLM microserving: engines with a paged KV cache behind a programmable "
                    "router, served with the OpenAI API.",
        epilog="`microserve COMMAND --help` shows a command's options. Start with `microserve "
               "up deploy/local-cpu.toml` (what `make serve` runs).")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _up_args(sub)
    _engine_args(sub)
    _router_args(sub)
    _drain_args(sub)
    _admin_token_args(sub)
    _model_path_args(sub)
    _quantize_args(sub)
    return ap


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("microserve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO (up's health polling, the benchmarks' clients).
    logging.getLogger("httpx").setLevel(max(logging.getLevelName(level), logging.WARNING))
    os.environ.setdefault("MICROSERVE_LOG_LEVEL", level)  # the core process logs at this level
    try:
        {"engine": _run_engine, "router": _run_router, "up": _run_up, "drain": _run_drain,
         "admin-token": _run_admin_token, "model-path": _run_model_path,
         "quantize": _run_quantize}[args.command](args)
    except (ValueError, RuntimeError, OSError) as e:
        # Start-up problems the user can fix (bad --model, bad sizes, core failed to start).
        print(f"microserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
