"""KV transfer between two real engine daemons: throughput of `remote_send` and its cost
against computing the same KV locally.

    python -m bench.transfer [--model smollm2-135m-instruct] [--tokens 1000,3000] [--repeat 3]
    python -m bench.transfer --device cuda --model random:llama-3.1-8b --gpu-share 0.3

Starts three `microserve engine` processes on this host: P (the sender) and two receivers, with
`--kv-transfer shm` and `tcp` on CPU, `cuda_ipc` and `tcp` with `--device cuda` (all three
engines then share one GPU, each with `--gpu-share` of its memory). For each context length N
and each receiver, with fresh random token ids every run:

  copy     P already holds the context in its prefix cache (it served it once), so remote_send
           of its whole pages (992 of 1,000 tokens with 16-token pages) is pure transfer:
           MB/s = KV bytes sent / wall time of the call
  compute  P has nothing cached: remote_send prefills N tokens on P and sends each layer's KV
           while the forward pass goes on
  prefill  the same N tokens prefilled on D alone (start_generate with max_tokens=1), the work
           a transfer saves the receiver

Times are wall-clock per HTTP call, measured from this client (so they include the HTTP round
trip and the engine's scheduling). Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import subprocess
import sys
import time

import httpx

from microserve.microserving import Sampling
from microserve.microserving_client import EngineClient
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model


ENGINE_KEY = secrets.token_urlsafe(32)  # KV moves only between engines sharing a key


def start_engine(model: str, port: int, *args: str, api_key: str | None = None
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "microserve.cli", "engine", "--model", model, "--port",
           str(port), "--log-level", "warning", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    if api_key is not None:
        env["MICROSERVE_API_KEY"] = api_key
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)


async def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"engine at {url} exited with {proc.returncode}")
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"engine at {url} not healthy after {timeout_s} s")


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


async def prefill_on(engine: EngineClient, rid: str, prompt: list[int]) -> None:
    async for _ in engine.start_generate(rid, prompt, 0, Sampling(max_tokens=1, temperature=0)):
        pass


async def measure(p: EngineClient, d: EngineClient, n: int, vocab: int, page_size: int,
                  rng) -> dict:
    ctx = [rng.randrange(vocab) for _ in range(n)]
    tag = f"{n}-{rng.random()}"
    await prefill_on(p, f"warm-{tag}", ctx)  # P caches ctx's whole pages
    cached = n // page_size * page_size  # the prefix cache holds whole pages only
    r = await d.prep_recv(f"copy-{tag}", ctx, end=cached)
    copy_s, sent = await timed(p.remote_send(f"copy-{tag}", ctx, 0, cached, r.kv_addr))
    assert sent.reused == cached and sent.computed == 0, sent
    await d.abort(f"copy-{tag}")
    fresh = [rng.randrange(vocab) for _ in range(n)]
    r = await d.prep_recv(f"compute-{tag}", fresh, end=n)
    compute_s, _ = await timed(p.remote_send(f"compute-{tag}", fresh, 0, n, r.kv_addr))
    await d.abort(f"compute-{tag}")
    local = [rng.randrange(vocab) for _ in range(n)]
    prefill_s, _ = await timed(prefill_on(d, f"local-{tag}", local))
    return {"copy_s": copy_s, "copied": sent.reused, "compute_s": compute_s,
            "prefill_s": prefill_s}  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokens", default="1000,3000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="each engine's --cpu-threads (default: torch's own, all cores)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: three engines on one GPU")
    ap.add_argument("--gpu-share", type=float, default=0.3,
                    help="CUDA: each engine's --gpu-memory-utilization")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    mc = ModelConfig.from_dir(model)
    kv_bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4  # fp32 on CPU
    lengths = [int(x) for x in args.tokens.split(",")]
    common = ("--num-pages", str(4 * max(lengths) // 16 + 64), "--max-model-len",
              str(max(lengths) + 64), "--max-num-batched-tokens", "512")  # fmt: skip
    if args.engine_threads is not None:
        common += ("--cpu-threads", str(args.engine_threads))
    gpu = args.device != "cpu"
    if gpu:  # the pool size comes from the memory share
        common = ("--device", args.device, "--gpu-memory-utilization", str(args.gpu_share),
                  "--max-model-len", str(max(lengths) + 64))
    kinds = ("cuda_ipc", "tcp") if gpu else ("shm", "tcp")
    ports = {"p": args.base_port, kinds[0]: args.base_port + 1, "tcp": args.base_port + 2}
    procs = {"p": start_engine(model, ports["p"], *common, api_key=ENGINE_KEY)}
    for kind in kinds:
        procs[kind] = start_engine(model, ports[kind], *common, "--kv-transfer", kind,
                                   api_key=ENGINE_KEY)
    urls = {k: f"http://127.0.0.1:{port}" for k, port in ports.items()}
    try:
        for k in procs:
            await wait_healthy(urls[k], procs[k])
        clients = {k: EngineClient(u, api_key=ENGINE_KEY) for k, u in urls.items()}
        rng = random.Random(0)
        info = (await clients["p"].stats())["info"]
        if info["dtype"] != "float32":
            kv_bytes_per_token //= 2
        print(f"model {mc.name} on {info['device']}, KV {kv_bytes_per_token} B/token "
              f"({info['dtype']}), median of {args.repeat} runs after one warm-up\n")
        print("| backend | tokens | copy: remote_send from P's cache | MB/s | "
              "compute: remote_send, prefill on P | prefill on D alone |")
        print("|---|---|---|---|---|---|")
        for kind in kinds:
            for n in lengths:
                await measure(clients["p"], clients[kind], n, mc.vocab_size, 16, rng)  # warm-up
                runs = [await measure(clients["p"], clients[kind], n, mc.vocab_size, 16, rng)
                        for _ in range(args.repeat)]  # fmt: skip
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                mb_s = med["copied"] * kv_bytes_per_token / med["copy_s"] / 1e6
                print(f"| {kind} | {n:,} | {med['copy_s'] * 1e3:.1f} ms "
                      f"({int(med['copied'])} tokens) | {mb_s:,.0f} | "
                      f"{med['compute_s'] * 1e3:.0f} ms | {med['prefill_s'] * 1e3:.0f} ms |",
                      flush=True)  # fmt: skip
        for c in clients.values():
            await c.aclose()
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
