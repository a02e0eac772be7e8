"""The command line's options that more than one command takes, each made from what it sets.

An engine's options set `EngineConfig` fields (engine/config.py) with the field's default; the
router's set `RouterSettings` (router/settings.py), help and default from its declaration, and
`microserve up` takes some of them to override a deployment file. `parse_engine_args` reads a
deployment file's engine `args` the way `microserve engine` would, into its `EngineConfig`.
Plain data: no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from engine.config import KV_CACHE_DTYPES, EngineConfig  # plain data: no torch
from engine.policies import POLICIES
from microserve.http_limits import HttpLimits  # plain data: no server
from router.settings import SETTINGS, RouterSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


class Help(argparse.HelpFormatter):
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


def log_level_option(p) -> None:
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   help="debug, info, warning or error (--uvicorn-log-level: vLLM's name)")


def _config_option(p, flag: str, field: str | None = None, aliases: tuple[str, ...] = (),
                   **kwargs) -> None:
    """An option that sets the EngineConfig field `field` (default: the flag's name), with the
    field's default: the config says what the defaults are, the command line how to ask."""
    field = field or flag.removeprefix("--").replace("-", "_")
    p.add_argument(flag, *aliases, dest=field, default=_CONFIG_FIELDS[field].default, **kwargs)


def _auto_on_off(value: str) -> bool | None:
    try:
        return {"auto": None, "on": True, "off": False}[value]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto, on or off") from None


def engine_options(p: argparse.ArgumentParser) -> None:
    """The options of `microserve engine` (what a deployment file's engine `args` may say)."""
    p.add_argument("--model", default=None,
                   help="a local Hugging Face Llama-family directory, or "
                        f"{DEFAULT_MODEL_NAME} (the default, embedded)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use in 'model' (default: the --model argument)")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on")
    p.add_argument("--port", type=int, default=8000, help="the port of its HTTP API")
    http_limit_options(p)
    p.add_argument("--deployment", default=None,
                   help="the deployment this engine belongs to, reported in its stats (set by "
                        "`microserve up`: its router adopts only its own engines; default: "
                        "none)")
    _config_option(p, "--device", help="cpu, cuda or cuda:N")
    _config_option(p, "--dtype", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, "
                                      "float16")
    _config_option(p, "--tensor-parallel-size", aliases=("-tp",), type=int,
                   help="ranks the model is split over (one process each; CUDA: GPUs --device "
                        "and the next ones): attention heads, MLP rows and the LM head split, "
                        "two all-reduces per layer (docs/engine.md)")
    _config_option(p, "--all-reduce", choices=("auto", "nccl", "one-shot"),
                   help="how a tensor-parallel engine's ranks sum partial products: one-shot "
                        "over symmetric memory for messages up to 512 KiB (decode), NCCL above; "
                        "nccl for all; auto: one-shot where it can be set up")
    _config_option(p, "--tp-overlap-tokens", type=int, metavar="TOKENS",
                   help="tensor-parallel steps of at least this many tokens run in two row "
                        "halves, each half's all-reduces beside the other's GEMMs (0: off)")
    _config_option(p, "--tensor-parallel-timeout-s", type=float, metavar="SECONDS",
                   help="a collective that waits longer on a rank fails the engine instead "
                        "of hanging it")
    _config_option(p, "--quantization", choices=("fp8",),
                   help="fp8: the decoder layers' weights as float8 e4m3, quantized at load "
                        "with a scale per output channel; activations quantized per token "
                        "(CUDA: compute capability 8.9+; default: the model's dtype)")
    _config_option(p, "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8 (fp8_e4m3): the KV cache as float8 e4m3, "
                        "scale 1, saturated at +-448: twice the tokens in the same memory "
                        "(CUDA: compute capability 8.9+)")
    _config_option(p, "--page-size", type=int, aliases=("--block-size",),
                   help="tokens per KV page (--block-size: vLLM's name)")
    _config_option(p, "--kv-cache-memory-gb", type=float, help="size of the KV pool (CPU)")
    _config_option(p, "--gpu-memory-utilization", type=float,
                   help="share of the GPU's memory for weights, activations and KV (CUDA)")
    _config_option(p, "--num-pages", type=int, help="KV pool size in pages (default: from "
                                                    "the memory size)")
    _config_option(p, "--max-num-batched-tokens", type=int,
                   help="per-step token budget (prefill chunk + decodes; default: 512 on CPU, "
                        "2048 on CUDA)")
    _config_option(p, "--max-prefill-step-tokens", type=int,
                   help="token budget of a step in which no sequence decodes (prompt chunks "
                        "only), at least --max-num-batched-tokens (default: 8192 on CUDA, the "
                        "step budget on CPU)")
    _config_option(p, "--max-num-seqs", type=int, help="sequences running at once "
                                                       "(default: 256)")
    _config_option(p, "--max-model-len", type=int,
                   help="longest prompt + output in tokens (default: the model's "
                        "max_position_embeddings)")
    _config_option(p, "--no-prefix-cache", "enable_prefix_cache", action="store_false",
                   aliases=("--no-enable-prefix-caching",),
                   help="do not reuse the KV of earlier requests' common prefixes "
                        "(--no-enable-prefix-caching: vLLM's name)")
    _config_option(p, "--scheduling-policy", choices=POLICIES,
                   help="which requests run first: fcfs (arrival order), priority (the "
                        "request's `priority`, lower first, ties by arrival) or mlfq "
                        "(FastServe's skip-join multi-level feedback queue; short jobs first)")
    _config_option(p, "--scheduling-starvation-s", type=float, metavar="SECONDS",
                   help="priority and mlfq: a request that has not run for this long is "
                        "promoted to the top")
    _config_option(p, "--background-priority", type=int, metavar="PRIORITY",
                   help="a request whose priority is at least this is background work, as a "
                        "batch job's lines are (default: %(default)s, the priority they are "
                        "sent at)")
    _config_option(p, "--background-max-seqs", type=int, metavar="N",
                   help="while other requests run or wait, background work gets at most this "
                        "many sequences of a step (default: %(default)s)")
    _config_option(p, "--background-max-tokens", type=int, metavar="N",
                   help="... and at most this many tokens of a step (default: %(default)s); "
                        "with no other work it runs as any request does")
    _config_option(p, "--background-prompt-every", type=int, metavar="N",
                   help="background prompt chunks wait until N steps' worth of "
                        "--background-max-tokens is saved, then run in one step: fewer steps "
                        "leave the decode CUDA graph (default: %(default)s, every step)")
    _config_option(p, "--mlfq-levels", type=int, help="mlfq: how many queues")
    _config_option(p, "--mlfq-base-quantum-s", type=float, metavar="SECONDS",
                   help="mlfq: the top queue's quantum in predicted seconds of running, "
                        "doubling per queue (default: 8 one-token steps, measured at start-up)")
    _config_option(p, "--kv-host-memory-gb", type=float, metavar="GB",
                   help="host memory for the KV of preempted requests: one that copies back "
                        "faster than it recomputes is swapped out and resumes where it was "
                        "(default 0: off, preempted requests are recomputed)")
    _config_option(p, "--kv-host-copy-gbps", type=float, metavar="GB/S",
                   help="the host <-> device copy rate the swap-or-recompute choice assumes "
                        "(default: measured at start-up)")
    _config_option(p, "--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    _config_option(p, "--skip-warmup", "warmup", action="store_false",
                   help="CUDA: report ready without serving the start-up requests that compile "
                        "the kernels first requests would otherwise wait for")
    lora_options(p)


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH")
    return name, path


def lora_options(p) -> None:
    """LoRA adapters over the base model (docs/lora.md)."""
    _config_option(p, "--lora-modules", type=_lora_module, nargs="+",
                   help="NAME=PATH ...: PEFT LoRA adapters served from the start; a request "
                        "picks one with model=NAME")
    _config_option(p, "--enable-lora", action="store_true",
                   help="LoRA on without start-up adapters (they come through "
                        "/v1/load_lora_adapter)")
    _config_option(p, "--max-loras", type=int, help="adapters resident on the device at once "
                                                    "(a step mixes any of them)")
    _config_option(p, "--max-lora-rank", type=int, help="the highest adapter rank accepted")
    _config_option(p, "--max-cpu-loras", type=int,
                   help="adapters whose host copy is kept (least recently used dropped past "
                        "it, read back from disk when next needed; default: every one)")
    _config_option(p, "--lora-dir", help="the directory /v1/load_lora_adapter reads adapters "
                                         "from (default: none; runtime loading refused)")
    _config_option(p, "--max-piecewise-tokens", type=int,
                   help="CUDA: steps with prompt tokens, up to this many in all, replay "
                        "piecewise CUDA graphs, attention eager (default: 2048; 0: eager)")
    _config_option(p, "--piecewise-bucket-step", type=int,
                   help="CUDA: above 512 tokens, a piecewise graph every this many tokens; a "
                        "step pads to the next (default: 64)")
    _config_option(p, "--mixed-graph-tokens", type=int,
                   help="CUDA: decodes beside one prompt chunk of up to this many tokens "
                        "replay one whole CUDA graph, the chunk padded (default: 0, off; "
                        "try 32 beside batch jobs)")
    _config_option(p, "--launch-ahead-layers", type=int,
                   help="CUDA, async scheduling: schedule the step after one with prompt "
                        "tokens (piecewise graphs) only when this many of its layers are left, "
                        "so a prompt arriving meanwhile makes it (default: 0, at once)")
    _config_option(p, "--prompt-attention", choices=("auto", "paged", "sdpa"),
                   help="CUDA: whole prompts (no cached prefix, up to 8 a step) attend with "
                        "torch's fused SDPA (cuDNN) over the step's own K/V: auto when each "
                        "has 4,096 tokens or more, sdpa always, paged never (the paged extend "
                        "kernel; the default: cuDNN builds a graph per new prompt length); an "
                        "fp8 KV cache keeps the paged kernel")
    _config_option(p, "--few-rows-gemm", type=int, metavar="N",
                   help="CUDA, 16-bit weights: decode steps of 2..N sequences (N <= 16) run "
                        "their projections through a Triton kernel that reads each weight once "
                        "for all of them, not cuBLAS; 0: off (default: 16 on one GPU whose "
                        "tiles were swept, an H200; else off)")
    _config_option(p, "--async-scheduling", type=_auto_on_off, metavar="{auto,on,off}",
                   help="launch step N before reading step N-1's tokens (default: auto, "
                        "which is on for CUDA)")
    _config_option(p, "--seed", type=int,
                   help="seeds the engine's generator for requests that name no seed")
    _config_option(p, "--log-stats-interval", "log_stats_interval_s", type=float,
                   metavar="SECONDS",
                   help="while it works, the engine logs its throughput, load and where its "
                        "core's time went every this many seconds (default: 10; 0: never)")
    shared_setting_option(p, "tool_call_parser")
    shared_setting_option(p, "reasoning_parser")
    vllm_flags(p)
    shared_setting_option(p, "generation_config")
    shared_setting_option(p, "chat_template")
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
    _config_option(p, "--queue-timeout-s", type=float, metavar="SECONDS",
                   help="a request to this engine's own /v1 that no step has started on "
                        "within this long gets a 503 (code queue_timeout) with Retry-After; a "
                        "router's requests carry the router's --queue-timeout-s instead")
    log_level_option(p)


def http_limit_options(p) -> None:
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


def http_limits(args) -> HttpLimits:
    return HttpLimits(max_connections=args.max_connections,
                      header_timeout_s=args.header_timeout_s,
                      body_timeout_s=args.body_timeout_s, keep_alive_s=args.keep_alive_s)


# vLLM's flags for what microserve always does: accepted, so that a command line written for
# `vllm serve` runs; each says what it stands for here.
VLLM_FLAGS = {
    "--enable-auto-tool-choice": "tool calls are always parsed when a request has tools",
    "--enable-prefix-caching": "the prefix cache is on unless --no-prefix-cache",
    "--enable-chunked-prefill": "long prompts are always prefilled in chunks",
    "--disable-log-requests": "requests are never logged one by one",
    "--trust-remote-code": "no model code is ever run from a checkpoint (Llama architectures "
                           "are built in)",
}


def vllm_flags(p) -> None:
    """VLLM_FLAGS, each a flag that changes nothing (help: what it stands for here)."""
    for flag, meaning in VLLM_FLAGS.items():
        p.add_argument(flag, action="store_true", dest=f"vllm_{flag[2:].replace('-', '_')}",
                       help=f"vLLM's flag, accepted and without effect: {meaning}")


def shared_setting_option(p, name: str) -> None:
    """An engine option that is one of the router's settings (router/settings.py), with its
    default, help and choices: the tool-call format, the chat template, the sampling defaults."""
    field = SETTINGS[name]
    p.add_argument(f"--{name.replace('_', '-')}", default=field.default,
                   help=field.metadata["help"], **field.metadata["option"])


def json_object(value: str) -> dict:
    import json

    try:
        obj = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return obj


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    """The EngineConfig of parsed engine options, for `model` (a resolved directory)."""
    given = {name: value for name, value in vars(args).items()
             if name in _CONFIG_FIELDS and name != "model"}
    return EngineConfig(model=model, **given)


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def parse_engine_args(args: list[str]) -> argparse.Namespace:
    """`microserve engine`'s options in `args`; ValueError naming the option it cannot take."""
    p = _Refusing(prog="microserve engine", add_help=False)
    engine_options(p)
    return p.parse_args(args)


_KINDS = {"str": str, "int": int, "float": float}  # a setting's type -> argparse's


def router_setting_options(p: argparse.ArgumentParser, *, up: bool = False) -> None:
    """An option for each of the router's settings (router/settings.py), with its default; with
    `up`, those `microserve up` takes to override the deployment file, default None (the file's
    value)."""
    for name, field in SETTINGS.items():
        meta = field.metadata
        if not meta["flag"] or (up and not meta["up"]):
            continue
        if name == "http_limits":
            http_limit_options(p)
            continue
        flag = "--" + name.replace("_", "-")
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        help = meta["help"]
        if up:
            p.add_argument(flag, type=_KINDS.get(field.type.split(" |")[0]), default=None,
                           help=f"[router] {name}: {help} (overrides the file's; default: the "
                                f"file's, else {'unset' if default is None else default})", **meta["option"])
        elif field.type == "bool":
            p.add_argument(flag, action="store_true", help=help, **meta["option"])
        elif field.type == "dict":
            p.add_argument(flag, type=json_object, default=default, help=help, **meta["option"])
        else:
            p.add_argument(flag, type=_KINDS[field.type.split(" |")[0]], default=default,
                           help=help, **meta["option"])


def router_settings(args: argparse.Namespace) -> RouterSettings:
    """The router's settings from `microserve router`'s parsed options."""
    return RouterSettings(**{name: http_limits(args) if name == "http_limits" else
                             getattr(args, name) for name, field in SETTINGS.items()
                             if field.metadata["flag"]})


def router_overrides(args: argparse.Namespace) -> dict:
    """The router settings `microserve up`'s options set (the others keep the file's)."""
    return {name: getattr(args, name) for name, field in SETTINGS.items()
            if field.metadata["up"] and getattr(args, name) is not None}
