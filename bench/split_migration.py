"""BlockLLM's split migration (issue 41, item 5) against a pure copy and a pure recompute of a
context, between two real engine daemons on this host, over each receiver kind.

    python -m bench.split_migration [--model M] [--tokens 2048] [--shares 0.25,0.5] \\
        [--kv-transfer shm,tcp] [--repeat 3]
    python -m bench.split_migration --device cuda:0 --receiver-device cuda:1 \\
        --model random:llama-3.1-8b --tokens 8192 --kv-transfer cuda_ipc,tcp

The source P holds an N-token context in its prefix cache (it served it once); each mode
moves it into a receiver D's prefix cache (`commit`), with fresh token ids every run:

  copy       prep_recv + remote_send + commit: P copies every page
  recompute  D computes the context itself (a one-token request on it)
  split S    prep_recv(own=k) on D; D computes prompt[:k] as a request of its own while P
             copies [k, N), side by side; then commit (k = S x N, whole pages)
  auto       the router's rule (router/split_migration.py's SplitRates): each side's time
             fit as a fixed cost plus a cost per token to the runs before it, then a pure
             move or the split where both sides end together, whichever it predicts fastest

Times are wall-clock per move, from this client (the calls' HTTP round trips included).
Prints a Markdown table per receiver kind for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from bench.transfer import (ENGINE_KEY, fresh, prefill_on, start_engine, stop_engines,
                            wait_healthy)
from microserve.messages import CommitRequest, PrepRecvRequest, RemoteSendRequest
from microserve.microserving_client import EngineClient
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model
from router.split_migration import SplitRates

PAGE = 16  # the engines' page size

async def move(p: EngineClient, d: EngineClient, ctx: list[int], own: int, tag: str,
               rates: SplitRates | None = None) -> float:
    """Seconds to put `ctx` into D's cache, D computing [0, own) and P copying the rest; the
    two sides' own times go into `rates`, as the router's split records them."""
    n = len(ctx)
    started = time.perf_counter()
    if own >= n:  # all on D
        await prefill_on(d, f"recompute-{tag}", ctx)
        elapsed = time.perf_counter() - started
        if rates is not None:
            rates.record("p", "d", n, elapsed, 0, 0.0)
        return elapsed
    r = await d.call(PrepRecvRequest(f"move-{tag}", ctx, end=n, own=own or None))

    async def timed(job) -> float:
        begun = time.perf_counter()
        await job
        return time.perf_counter() - begun

    head = max(0, own - r.matched)
    tail = n - r.kv_addr.begin
    jobs = [timed(p.call(RemoteSendRequest(f"move-{tag}", ctx, r.kv_addr.begin, n,
                                           r.kv_addr)))]
    if head > 0:
        jobs.append(timed(prefill_on(d, f"head-{tag}", ctx[:own])))
    times = await asyncio.gather(*jobs)
    committed = await d.call(CommitRequest(f"move-{tag}"))
    elapsed = time.perf_counter() - started
    assert committed.cached == n // PAGE * PAGE, committed
    if rates is not None:
        rates.record("p", "d", head, times[1] if head > 0 else 0.0, tail, times[0])
    return elapsed


async def one_kind(p: EngineClient, d: EngineClient, kind: str, n: int, shares: list[float],
                   vocab: int, repeat: int, rng) -> None:
    rates = SplitRates()  # what `auto` goes by: the router's rule, fed by the runs before it

    async def timed(own: int) -> float:
        runs = []
        for i in range(repeat + 1):  # the first is a warm-up
            ctx = fresh(rng, vocab, n)
            await prefill_on(p, f"warm-{rng.random()}", ctx)  # P caches it
            runs.append(await move(p, d, ctx, own, f"{own}-{rng.random()}",
                                   rates if i else None))
        return statistics.median(runs[1:])

    copy_s, recompute_s = await timed(0), await timed(n)
    rows = [("copy (P sends all)", 0, copy_s), ("recompute (D computes all)", n, recompute_s)]
    for share in shares:
        own = int(n * share) // PAGE * PAGE
        rows.append((f"split {share:.2f}", own, await timed(own)))
    auto = rates.share("p", "d", n)  # router/split_migration.py's rule
    own = n if auto >= 1 else int(n * auto) // PAGE * PAGE
    rows.append((f"auto ({auto:.2f})", own, await timed(own)))
    best = min(copy_s, recompute_s)
    print(f"\n{kind}, {n:,}-token context, median of {repeat}:\n")
    print("| mode | computed on D | time | vs the better of copy and recompute |")
    print("|---|---|---|---|")
    for name, own, s in rows:
        print(f"| {name} | {own:,} | {s * 1e3:.1f} ms | {s / best:.2f}x |", flush=True)
    print(f"\nauto's lines (router/split_migration.py): {rates.describe()}", flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shares", default="0.25,0.5")
    ap.add_argument("--kv-transfer", default=None,
                    help="the receivers' kinds (default: shm,tcp on CPU, cuda_ipc,tcp on GPU)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--receiver-device", default=None)
    ap.add_argument("--engine-threads", type=int, default=None)
    ap.add_argument("--base-port", type=int, default=18300)
    args = ap.parse_args()
    model = str(resolve_model(args.model))
    mc = ModelConfig.from_dir(model)
    gpu = args.device != "cpu"
    kinds = args.kv_transfer.split(",") if args.kv_transfer else (
        ["cuda_ipc", "tcp"] if gpu else ["shm", "tcp"])
    common = ["--max-model-len", str(args.tokens + 64), "--page-size", str(PAGE)]
    common += (["--gpu-memory-utilization", "0.4"] if gpu
               else ["--num-pages", str(8 * args.tokens // PAGE + 64)])
    if args.engine_threads is not None:
        common += ["--cpu-threads", str(args.engine_threads)]
    places = {"p": args.device} | {k: args.receiver_device or args.device for k in kinds}
    ports = {name: args.base_port + i for i, name in enumerate(places)}
    procs = {name: start_engine(model, ports[name], *common, "--device", places[name],
                                *(() if name == "p" else ("--kv-transfer", name)),
                                api_key=ENGINE_KEY) for name in places}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name in procs:
            await wait_healthy(urls[name], procs[name])
        clients = {name: EngineClient(u, api_key=ENGINE_KEY) for name, u in urls.items()}
        print(f"model {mc.name}; P on {places['p']}, receivers on {places[kinds[0]]}")
        rng = random.Random(0)
        shares = [float(x) for x in args.shares.split(",") if x]
        for kind in kinds:
            await one_kind(clients["p"], clients[kind], kind, args.tokens, shares,
                           mc.vocab_size, args.repeat, rng)
        for c in clients.values():
            await c.aclose()
    finally:
        stop_engines(procs.values())


if __name__ == "__main__":
    asyncio.run(main())
