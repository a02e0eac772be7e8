"""bench.peers --gpus 2: vLLM and `microserve up` each over two GPUs, in two layouts, on the
P/D paper's workload (3,000 tokens in, 100 out) at three Poisson rates.

  dp  data parallel x2. vLLM: one server with `--data-parallel-size 2`, what vLLM's docs give
      for DP on one host: one API server whose client balances requests over two engine cores
      by their queues (a dense model's DP ranks run independently: vllm/v1/engine/core.py,
      "Non-MoE DP ranks are completely independent"). Ours: `up` with two engines, the
      `data_parallel` strategy, least-loaded (deploy/gpu-dp.toml with a second engine).
  pd  1P1D. vLLM: a prefill and a decode server, each on its own GPU (CUDA_VISIBLE_DEVICES),
      KV over NixlConnector, behind bench/peers/pd_proxy.py; it needs the `nixl` package
      (not carried: the run says so and leaves vLLM's P/D rows empty). Ours: `up` with the
      `pd` strategy, P on the first device and D on the second, KV by --pd-kv-transfer
      (deploy/gpu-1p1d.toml: cuda_ipc).

Rows per layout and rate: TTFT p50/p99, TPOT p50/p99, JCT p99, total tokens/s and goodput
(requests/s per GPU that met the SLO, bench/slo.py: TTFT <= 2 s, TPOT <= 25 ms by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.peers import servers
from bench.peers.figures import check, serve_args
from bench.serve import run as serve_run
from bench.slo import SLO

LAYOUTS = ("dp", "pd")
SIDES = ("vllm", "up")
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def nixl_missing(site: str | None) -> bool:
    """Whether vLLM's NixlConnector would find no NIXL: the import it makes (vllm/distributed/
    nixl_utils.py: `nixl._api`; the `nixl` package loads `nixl_cu13` or `nixl_cu12` by the CUDA
    it finds), in a process with vLLM's path."""
    probe = subprocess.run([sys.executable, "-c", "import nixl._api"],
                           env=servers.vllm_env(site), capture_output=True)
    return probe.returncode != 0


def start_vllm(layout: str, model_dir: Path, args, workdir: Path):
    shared = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
              "--gpu-memory-utilization", str(args.gpu_memory_utilization), *args.vllm_arg]
    if layout == "dp":
        return servers.start_vllm(model_dir, workdir, [*shared, "--data-parallel-size", "2"],
                                  args.vllm_site, name="vllm-dp")
    members = []
    # P and D each see one GPU; NIXL's side channel (a ZeroMQ port per server) must differ
    for role, gpu in (("prefill", "0"), ("decode", "1")):
        env = {"CUDA_VISIBLE_DEVICES": gpu,
               "VLLM_NIXL_SIDE_CHANNEL_PORT": str(servers.free_port())}
        members.append(servers.start_vllm(
            model_dir, workdir, [*shared, "--kv-transfer-config", json.dumps(NIXL)],
            args.vllm_site, name=f"vllm-{role}", env_more=env))  # fmt: skip
    port = servers.free_port()
    cmd = [sys.executable, "-m", "bench.peers.pd_proxy", "--prefill",
           members[0].url.removesuffix("/v1"), "--decode", members[1].url.removesuffix("/v1"),
           "--port", str(port)]  # fmt: skip
    log = workdir / "vllm-proxy.log"
    base = f"http://127.0.0.1:{port}"
    members.append(servers.Server("vllm-proxy", servers.spawn(cmd, log, dict(os.environ)),
                                  base + "/v1", base + "/health", log))
    return servers.Group("vllm-pd", members)


def engines(layout: str, args) -> tuple[list[servers.Engine], str, dict | None]:
    """Ours: the engines of `up`'s deployment file, its strategy and the strategy's args."""
    ours = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype, *args.engine_arg]
    d0, d1 = args.devices
    mem = lambda d: (["--gpu-memory-utilization", str(args.gpu_memory_utilization)]  # noqa: E731
                     if d.startswith("cuda") else [])
    if layout == "dp":
        return ([servers.Engine(f"e{i}", [*ours, "--device", d, *mem(d)])
                 for i, d in enumerate(args.devices)], "data_parallel",
                {"policy": "least_loaded"})
    return ([servers.Engine("prefill-0", [*ours, "--device", d0, *mem(d0)], "prefill"),
             servers.Engine("decode-0", [*ours, "--device", d1, *mem(d1), "--kv-transfer",
                                         args.pd_kv_transfer], "decode")],
            "pd", None)  # fmt: skip


def start(side: str, layout: str, model_dir: Path, args, workdir: Path):
    if side == "vllm":
        return start_vllm(layout, model_dir, args, workdir)
    text = servers.up_config(str(model_dir), *engines(layout, args))
    return servers.start_deployment(workdir / f"peers-up-{layout}.toml", f"up-{layout}", text)


async def rates(base_url: str, layout: str, args, vocab: int) -> dict:
    """bench.serve at each of --pd-rates (per GPU, so twice that in all): the rows."""
    out = {}
    slo = SLO(args.slo_ttft_s, args.slo_tpot_ms)
    for i, per_gpu in enumerate(args.pd_rates):
        # fresh prompts at each rate (as in figures.poisson): no prefix-cache hit on the last's
        ns = serve_args(base_url, servers.SERVED_NAME, [
            "--num-requests", str(args.pd_requests), "--request-rate", str(2 * per_gpu),
            "--input-len", str(args.pd_input), "--output-len", str(args.pd_output),
            "--vocab", str(vocab), "--seed", str(200 + i)])  # fmt: skip
        result = await serve_run(ns, slo, gpus=2)
        check(result, f"{layout}@{per_gpu}")
        name = f"{layout} {per_gpu:g}/s/GPU"
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p99"):
                out[f"{name} {metric.upper()} {q} ms"] = result[metric][f"{q}_ms"]
        out[f"{name} JCT p99 ms"] = result["jct"]["p99_ms"]
        out[f"{name} total tokens/s"] = result["total_tokens_per_s"]
        out[f"{name} goodput req/s/GPU"] = result["slo"]["goodput_per_gpu"]
    return out


async def one_round(side: str, layout: str, model_dir: Path, args, workdir: Path,
                    vocab: int) -> dict:
    server = start(side, layout, model_dir, args, workdir)
    try:
        await server.wait_ready()
        return {f"{layout} start-up s": server.startup_s,
                **await rates(server.url, layout, args, vocab)}
    finally:
        server.stop()


def plan(args) -> list[tuple[str, str]]:
    """(side, layout) in run order per round; vLLM's P/D only where NIXL is there to run it."""
    skip_pd = "vllm" in args.sides and "pd" in args.layouts and nixl_missing(args.vllm_site)
    if skip_pd:
        print("vLLM pd: skipped, `nixl` is not importable (vLLM's NixlConnector needs it; "
              "carry nixl-cu13 to run it)", flush=True)
    return [(side, layout) for layout in args.layouts for side in args.sides
            if not (skip_pd and side == "vllm" and layout == "pd")]
