"""`microserve` command line: `microserve engine ...` (the router and `up` come later)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def _engine_args(sub) -> None:
    p = sub.add_parser("engine", help="serve one model from one engine (OpenAI API)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face Llama-family directory, or "
                        f"'{DEFAULT_MODEL_NAME}' (the embedded default)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the --model argument)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, "
                                                   "bfloat16, float16")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="size of the KV pool (CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and KV (CUDA)")
    p.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages "
                                                               "(overrides the memory size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget (prefill chunk + decodes)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="launch step N before reading step N-1's tokens (auto: on for CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /microserving "
                        "(default: $MICROSERVE_API_KEY; unset: no check)")
    p.add_argument("--kv-transfer", choices=("auto", "shm", "tcp", "none"), default="auto",
                   help="how this engine receives KV from peers (auto: shm on CPU, none on CUDA)")
    p.add_argument("--kv-transfer-host", default="127.0.0.1",
                   help="tcp: address the KV transfer listener binds")
    p.add_argument("--kv-transfer-port", type=int, default=0, help="tcp: 0 picks a free port")
    p.add_argument("--kv-transfer-advertise-host", default=None,
                   help="tcp: address peers dial (default: the bind address)")
    p.add_argument("--kv-lease-s", type=float, default=60.0,
                   help="seconds a prep_recv reservation lives if nothing consumes it")
    p.add_argument("--log-level", default="info")


def _run_engine(args) -> None:
    # Imported here so `microserve --help` stays fast; neither imports torch.
    from engine.config import EngineConfig
    from engine.server import serve
    from microserve.model_files import resolve_model

    model_dir = resolve_model(args.model)
    config = EngineConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_pages=args.num_pages,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_cache=not args.no_prefix_cache,
        enforce_eager=args.enforce_eager,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        seed=args.seed,
        kv_transfer=args.kv_transfer,
        kv_transfer_host=args.kv_transfer_host,
        kv_transfer_port=args.kv_transfer_port,
        kv_transfer_advertise_host=args.kv_transfer_advertise_host,
        kv_lease_s=args.kv_lease_s,
    )
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    asyncio.run(serve(config, name, args.host, args.port, args.log_level, api_key=args.api_key))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="microserve", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    _engine_args(sub)
    args = ap.parse_args(argv)
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("MICROSERVE_LOG_LEVEL", level)  # the core process logs at this level
    try:
        if args.command == "engine":
            _run_engine(args)
    except (ValueError, RuntimeError) as e:
        # Start-up problems the user can fix (bad --model, bad sizes, core failed to start).
        print(f"microserve: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
