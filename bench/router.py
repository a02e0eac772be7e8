"""What the router adds: the same requests to one engine directly and through the router.

    python -m bench.router [--model smollm2-135m-instruct] [--pairs 200] [--output-len 8]
    python -m bench.router --model random:tiny    # a 2-layer synthetic model: the engine's own
                                                  # time and noise out of the comparison

Starts one `microserve engine` and a `microserve router` (data parallel) over it, on this host.

  latency     `--pairs` pairs of requests, one request at a time; each pair sends two fresh
              random prompts (no prefix-cache hits), one straight to the engine and one through
              the router, in random order. Streamed: TTFT and end-to-end; not streamed:
              end-to-end. Reports p50/p99 of each side and of the paired difference
              (router - direct), which cancels the drift of a shared machine.
  throughput  `--requests` requests with `--concurrency` in flight, direct then routed:
              requests/s and output tokens/s.
  router CPU  the router process's CPU time (user + system, /proc) over the routed requests,
              per request.

Prints a Markdown block for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time


from bench.serve import one
from bench.sse_client import StreamClient
from bench.transfer import start_engine, wait_healthy
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def plain(client: StreamClient, prompt: list[int], n_out: int) -> float:
    body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = await client.post("/completions", body)
    try:
        text = await response.read()
    finally:
        response.release()
    assert response.status == 200, text
    return time.perf_counter() - start


async def latency(direct, routed, args, vocab: int, rng) -> dict:
    out = {k: [] for k in ("ttft_d", "ttft_r", "e2e_d", "e2e_r", "plain_d", "plain_r")}
    for _ in range(args.pairs):
        pair = [("d", direct), ("r", routed)]
        rng.shuffle(pair)
        for side, client in pair:
            prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
            result = await one(client, "", prompt, args.output_len)
            assert "error" not in result, result
            out[f"ttft_{side}"].append(result["ttft"])
            out[f"e2e_{side}"].append(result["e2e"])
        rng.shuffle(pair)
        for side, client in pair:
            prompt = [rng.randrange(vocab) for _ in range(args.input_len)]
            out[f"plain_{side}"].append(await plain(client, prompt, args.output_len))
    return out


async def throughput(client: StreamClient, args, vocab: int, rng) -> tuple[float, float]:
    gate = asyncio.Semaphore(args.concurrency)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)]
               for _ in range(args.requests)]

    async def guarded(prompt):
        async with gate:
            result = await one(client, "", prompt, args.output_len)
            assert "error" not in result, result
            return result["output_tokens"]

    start = time.perf_counter()
    tokens = await asyncio.gather(*(guarded(p) for p in prompts))
    wall = time.perf_counter() - start
    return args.requests / wall, sum(tokens) / wall


async def idle_cpu(pid: int, seconds: float) -> float:
    """The router's CPU use with no requests (its engine polling), in CPU seconds per second."""
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--engine-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="the engine's --cpu-threads (default: leave one core to the router "
                         "and this client)")
    ap.add_argument("--base-port", type=int, default=18200)
    ap.add_argument("--engine-streams", action="store_true",
                    help="the router reads a stream per request from the engine, not its "
                         "channel (microserve router --engine-streams)")
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    engine_url = f"http://127.0.0.1:{args.base_port}"
    router_url = f"http://127.0.0.1:{args.base_port + 1}"
    engine = start_engine(model, args.base_port, "--max-model-len", "2048", "--cpu-threads",
                          str(args.engine_threads))
    router = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "router", "--model", model, "--port",
         str(args.base_port + 1), "--engine", f"e0={engine_url}", "--strategy",
         "data_parallel", "--log-level", "warning",
         *(["--engine-streams"] if args.engine_streams else [])], stdout=subprocess.DEVNULL)
    direct, routed = StreamClient(engine_url + "/v1"), StreamClient(router_url + "/v1")
    try:
        await wait_healthy(engine_url, engine)
        await wait_healthy(router_url, router)
        rng = random.Random(0)
        warm = argparse.Namespace(**{**vars(args), "pairs": 10})
        await latency(direct, routed, warm, vocab, rng)
        idle = await idle_cpu(router.pid, 10.0)
        cpu0, t0 = cpu_seconds(router.pid), time.perf_counter()
        lat = await latency(direct, routed, args, vocab, rng)
        cpu_lat = cpu_seconds(router.pid) - cpu0 - idle * (time.perf_counter() - t0)
        rps_d, tps_d = await throughput(direct, args, vocab, rng)
        cpu1, t1 = cpu_seconds(router.pid), time.perf_counter()
        engine_cpu1 = cpu_seconds(engine.pid)
        rps_r, tps_r = await throughput(routed, args, vocab, rng)
        cpu_tput = cpu_seconds(router.pid) - cpu1 - idle * (time.perf_counter() - t1)
        engine_cpu = cpu_seconds(engine.pid) - engine_cpu1
    finally:
        direct.close()
        routed.close()
        router.terminate()
        engine.terminate()
        router.wait(30)
        engine.wait(30)
    report(args, lat, (rps_d, tps_d, rps_r, tps_r), cpu_lat, cpu_tput, idle, engine_cpu)


def report(args, lat: dict, tput: tuple, cpu_lat: float, cpu_tput: float, idle: float,
           engine_cpu: float) -> None:
    ms = 1e3
    print(f"- {args.pairs} pairs, prompts of {args.input_len} random token ids, "
          f"{args.output_len} output tokens (ignore_eos), one request at a time; engine "
          f"--cpu-threads {args.engine_threads}\n")
    print("| metric | direct p50 | direct p99 | router p50 | router p99 | added p50 (paired) "
          "| added p99 (paired) |")
    print("|---|---|---|---|---|---|---|")
    for name, key in (("streamed TTFT", "ttft"), ("streamed end-to-end", "e2e"),
                      ("not streamed end-to-end", "plain")):
        d, r = lat[f"{key}_d"], lat[f"{key}_r"]
        diff = [b - a for a, b in zip(d, r)]
        print(f"| {name} | {statistics.median(d) * ms:.2f} ms | {pct(d, 0.99) * ms:.2f} ms | "
              f"{statistics.median(r) * ms:.2f} ms | {pct(r, 0.99) * ms:.2f} ms | "
              f"{statistics.median(diff) * ms:+.2f} ms | {pct(diff, 0.99) * ms:+.2f} ms |")
    rps_d, tps_d, rps_r, tps_r = tput
    routed_requests = 4 * args.pairs  # streamed and plain, both sides: half went through it
    print(f"\n- throughput, {args.requests} requests, {args.concurrency} in flight: direct "
          f"{rps_d:.2f} req/s ({tps_d:.0f} output tok/s), router {rps_r:.2f} req/s "
          f"({tps_r:.0f} output tok/s), {rps_r / rps_d:.1%} of direct")
    print(f"- router CPU time per request (beyond its idle {idle:.1%} of a core, which is the "
          f"engine polling): {cpu_lat / (routed_requests / 2) * ms:.2f} ms one at a time, "
          f"{cpu_tput / args.requests * ms:.2f} ms with {args.concurrency} in flight")
    tokens = args.requests * args.output_len
    print(f"- CPU per streamed token with {args.concurrency} in flight ("
          f"{'a stream per request' if args.engine_streams else 'the engine channel'}): router "
          f"{cpu_tput / tokens * 1e6:.1f} µs, the engine's HTTP process (not its core) "
          f"{engine_cpu / tokens * 1e6:.1f} µs")


if __name__ == "__main__":
    asyncio.run(main())
