"""`microserve` command line: one subcommand each (`microserve --help` lists them).

    microserve up CONFIG          a deployment: engines + router from one file (deploy/*.toml)
    microserve engine ...         one engine (OpenAI API + microserving API)
    microserve router ...         the router in front of engines already running
    microserve drain ROUTER ...   drain an engine through a router's admin API and wait
    microserve admin-token        the admin token a running router made for itself
    microserve batch run FILE     an OpenAI batch file through a running router, with progress
    microserve chat               chat with a router (streamed); /batch FILE in the background
    microserve ab --arm ...       an A/B of routing strategies on a running router's traffic
    microserve model-path [MODEL] the Hugging Face directory a --model resolves to
    microserve quantize MODEL OUT an fp8 copy of a checkpoint
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys

from launcher.options import (
    DEFAULT_MODEL_NAME,
    Help,
    engine_config,
    engine_options,
    log_level_option,
    router_overrides,
    router_setting_options,
    router_settings,
)
from launcher.options import http_limits as _http_limits  # noqa: F401 (tests read it here)


def _command(sub, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=Help)


def _engine_args(sub) -> None:
    engine_options(_command(sub, "engine", "serve one model from one engine (OpenAI API and the "
                                           "microserving API)"))


def _serve_args(sub) -> None:
    p = _command(sub, "serve", "`microserve engine` with the model first, as `vllm serve MODEL` "
                               "takes it, and on a GPU when one is visible (the same options)")
    p.add_argument("served_model", nargs="?", default=None, metavar="MODEL",
                   help="what --model takes (default: the embedded model)")
    engine_options(p)
    [device] = [a for a in p._actions if a.dest == "device"]
    device.default = None
    device.help = "cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)"


# Asked in a child process, so that this one never loads the CUDA driver: whether the driver
# sees a GPU (CUDA_VISIBLE_DEVICES respected), without torch.
_CUDA_CHECK = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
count = ctypes.c_int(0)
ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
sys.exit(0 if ok and count.value > 0 else 1)
"""


def cuda_visible() -> bool:
    try:
        return subprocess.run([sys.executable, "-c", _CUDA_CHECK], timeout=60,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _run_serve(args) -> None:
    if args.served_model is not None:
        if args.model is not None and args.model != args.served_model:
            raise ValueError(f"the model is given twice: {args.served_model!r} and --model "
                             f"{args.model!r}")
        args.model = args.served_model
    if args.device is None:
        args.device = "cuda" if cuda_visible() else "cpu"
        logging.getLogger("microserve.cli").info("no --device: %s (%s)", args.device,
                                                 "a GPU is visible" if args.device == "cuda"
                                                 else "no GPU is visible")
    _run_engine(args)


def _run_engine(args) -> None:
    # Imported here so `microserve --help` stays fast; neither imports torch.
    from engine.frontend.server import serve
    from microserve.model_files import resolve_model

    config = engine_config(args, str(resolve_model(args.model)))
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    _run_loop(serve(config, name, args.host, args.port, args.log_level, api_key=args.api_key,
                    deployment=args.deployment, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser,
                    generation_config=args.generation_config,
                    chat_template=args.chat_template,
                    http_limits=_http_limits(args)))


def _run_loop(main):
    """Run `main` on uvloop when it is installed (a faster loop for the per-token path),
    on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


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
    log_level_option(p)


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
    p.add_argument("--deployment", default=None,
                   help="adopt only engines started with this --deployment (default: any)")
    p.add_argument("--model", default=None,
                   help="the model directory (or the embedded default's name) to take the "
                        "tokenizer and chat template from")
    p.add_argument("--served-model-name", default=None,
                   help="the engines' model name (default: the --model argument)")
    router_setting_options(p)
    _secret_args(p)


def _up_args(sub) -> None:
    p = _command(sub, "up", "start a deployment (engines + router) from a TOML file")
    p.add_argument("config", help="a deployment file, e.g. deploy/local-cpu.toml")
    router_setting_options(p, up=True)
    p.add_argument("--model", default=None,
                   help="the model every engine loads (overrides the file's `model`): a Hugging "
                        "Face directory, smollm2-135m-instruct, or random:llama-3.1-8b")
    _secret_args(p, up=True)


def _batch_args(sub) -> None:
    from launcher.batch_cli import batch_options

    p = _command(sub, "batch", "run an OpenAI batch input file (JSONL) through a router's "
                               "Batch API")
    actions = p.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="upload FILE, start the batch, show its progress and "
                                         "write its output when it ends", formatter_class=Help)
    batch_options(run)


def _run_batch(args) -> None:
    import httpx

    from launcher.batch_cli import run_batch

    try:
        code = run_batch(args)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach the router at {args.base_url}: {e}") from None
    sys.exit(code)


def _chat_args(sub) -> None:
    from launcher.chat_cli import chat_options

    chat_options(_command(sub, "chat", "chat with a running router (answers streamed, history "
                                       "kept); /batch FILE runs a batch in the background"))


def _run_chat(args) -> None:
    import httpx

    from launcher.chat_cli import run_chat

    try:
        run_chat(args)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach the router at {args.base_url}: {e}") from None


def _ab_args(sub) -> None:
    from launcher.ab_cli import ab_options

    ab_options(_command(sub, "ab", "A/B-test routing strategies inside a running router: set "
                                   "the arms, drive load for a while, print the comparison, "
                                   "restore the strategy"))


def _run_ab(args) -> None:
    import httpx

    from launcher.ab_cli import run_ab

    try:
        run_ab(args)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach the router at {args.base_url}: {e}") from None


def _quantize_args(sub) -> None:
    p = _command(sub, "quantize", "write a 16-bit checkpoint's fp8 copy (FP8-dynamic, "
                                  "compressed-tensors layout), served without --quantization")
    p.add_argument("model", help="a Hugging Face Llama directory, smollm2-135m-instruct, or "
                                 "random:llama-3.1-8b")
    p.add_argument("out", help="a new or empty directory for the copy")
    p.add_argument("--device", default="cpu",
                   help="where the weights are quantized (cuda is faster; the result is the same)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors file")
    log_level_option(p)


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
    log_level_option(p)


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
            deployment=args.deployment, api_key=args.api_key, admin_token=token,
            engine_api_key=args.engine_api_key, **router_settings(args).settings())
        _run_loop(serve(config, args.log_level))


def _run_up(args) -> None:
    from launcher.credentials import new_token
    from launcher.deployment import load_deployment
    from launcher.up import up

    deployment = load_deployment(args.config, model=args.model, **router_overrides(args))
    # The engines always take a key: their microserving API moves KV and runs prefills, and
    # KV transfer between them is authenticated by it (kvcache/transfer/auth.py).
    code = _run_loop(up(deployment, log_level=args.log_level, api_key=args.api_key,
                          admin_token=args.admin_token,
                          engine_api_key=args.engine_api_key or new_token()))
    sys.exit(code)


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests check deploy/kubernetes' commands against it)."""
    ap = argparse.ArgumentParser(
        prog="microserve", formatter_class=Help,
        description="LLM microserving: engines with a paged KV cache behind a programmable "
                    "router, served with the OpenAI API.",
        epilog="`microserve COMMAND --help` shows a command's options. Start with `microserve "
               "up deploy/local-cpu.toml` (what `make serve` runs).")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _up_args(sub)
    _engine_args(sub)
    _serve_args(sub)
    _router_args(sub)
    _drain_args(sub)
    _batch_args(sub)
    _chat_args(sub)
    _ab_args(sub)
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
        {"engine": _run_engine, "serve": _run_serve, "router": _run_router, "up": _run_up,
         "drain": _run_drain,
         "batch": _run_batch, "chat": _run_chat, "ab": _run_ab,
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
