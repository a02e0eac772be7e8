"""Where a pure KV copy's time goes: P copies a cached context into a receiver, back to back,
for a while, and (with --py-spy) py-spy samples P's processes meanwhile (issue 37: the copy of
3,000 cached tokens took 5.6-6.2 ms across two H200s, 4.8-6.1 ms on one H100, where the copy
kernel alone moves the same bytes in well under a millisecond on one GPU).

    python -m bench.scripts.copy_loop --device cuda:0 --receiver-device cuda:1 \
        --model random:llama-3.1-8b --kv-transfer cuda_ipc --tokens 3000 --seconds 20 \
        [--py-spy OUT/p.txt]

One copy is what `bench.transfer`'s "copy" measures: D's prep_recv (not timed), P's
remote_send of the cached pages (timed from this client), D's abort. Prints the copies'
p50 / p90 wall time and, from P's answer (SendTiming), how much of it P spent from taking the
call to the KV landing (`queued_s` of an all-cached send) and after (`tail_s`); the rest is the
hops between this client and P. With --py-spy, `py-spy record --subprocesses --idle
--threads -f raw` runs on P for the middle of the loop and writes collapsed stacks to the file
given, and the heaviest frames of each of P's processes and threads are printed (--fresh: a
context P has just computed each time, as bench.transfer copies). py-spy is not a dependency;
for a lent GPU machine, `pip download py-spy --no-deps -d .whl` puts its wheel beside the
others (`bench/scripts/device_wheels.sh`), and `--target /tmp/site` installs the binary in
/tmp/site/bin (put it on PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import shutil
import statistics
import subprocess
import time

from bench.transfer import (ENGINE_KEY, fresh, prefill_on, start_engine, stop_engines, timed,
                            wait_healthy)
from microserve.messages import AbortRequest, PrepRecvRequest, RemoteSendRequest
from microserve.microserving_client import EngineClient
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model


def heaviest(raw_path: str, top: int = 25) -> list[str]:
    """The frames py-spy's raw (collapsed) output spends most samples in, as a leaf and
    inclusive, per process and thread (its first two frames)."""
    leaf, inclusive = collections.Counter(), collections.Counter()
    per_thread = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames, n = stack.split(";"), int(count)
            # (the process and thread frames lead: "process PID:cmd", "thread (0x...)")
            head = [f for f in frames if f.startswith(("process ", "thread "))]
            where = "; ".join(f.split(":")[0] if f.startswith("process") else f for f in head)
            per_thread[where] += n
            leaf[frames[-1][:110]] += n
            for frame in set(frames[len(head):]):
                inclusive[frame[:110]] += n
    lines = ["samples per process and thread:"]
    lines += [f"  {n:6d}  {w}" for w, n in per_thread.most_common(12)]
    lines += ["leaf frames:"] + [f"  {n:6d}  {f}" for f, n in leaf.most_common(top)]
    lines += ["inclusive (engine, kvcache, microserve frames):"]
    lines += [f"  {n:6d}  {f}" for f, n in inclusive.most_common(400)
              if any(k in f for k in ("engine/", "kvcache/", "microserve/"))][:top]
    return lines


async def run(args) -> None:
    model = str(resolve_model(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    gpu = args.device != "cpu"
    common = (("--gpu-memory-utilization", str(args.gpu_share)) if gpu else
              ("--num-pages", str(2 * args.tokens // 16 + 64), "--max-num-batched-tokens",
               "512")) + ("--max-model-len", str(args.tokens + 64))
    placed = {"p": ("--device", args.device) if gpu else (),
              "d": ("--device", args.receiver_device or args.device) if gpu else ()}
    procs = {"p": start_engine(model, args.base_port, *common, *placed["p"],
                               api_key=ENGINE_KEY),
             "d": start_engine(model, args.base_port + 1, *common, *placed["d"],
                               "--kv-transfer", args.kv_transfer, api_key=ENGINE_KEY)}
    urls = {k: f"http://127.0.0.1:{args.base_port + i}" for i, k in enumerate(procs)}
    clients: dict[str, EngineClient] = {}
    spy = None
    try:
        for k in procs:
            await wait_healthy(urls[k], procs[k])
        clients = {k: EngineClient(u, api_key=ENGINE_KEY) for k, u in urls.items()}
        p, d = clients["p"], clients["d"]
        rng = random.Random(0)
        ctx = fresh(rng, vocab, args.tokens)
        await prefill_on(p, "warm", ctx)
        cached = args.tokens // 16 * 16
        walls, queued, tails = [], [], []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < args.seconds:
            i += 1
            if spy is None and args.py_spy and time.monotonic() - start > args.seconds / 4:
                exe = shutil.which("py-spy") or "py-spy"
                spy = subprocess.Popen([exe, "record", "-p", str(procs["p"].pid), "-s", "--idle",
                                        "--threads",
                                        "-r", "1000", "-d", str(max(1, int(args.seconds / 2))),
                                        "-f", "raw", "-o", args.py_spy, "--nonblocking"],
                                       stdout=subprocess.DEVNULL)
            if args.fresh:  # as bench.transfer: a context P has just computed, each time
                ctx = fresh(rng, vocab, args.tokens)
                await prefill_on(p, f"warm-{i}", ctx)
                if args.pause_s:
                    await asyncio.sleep(args.pause_s)
            r = await d.call(PrepRecvRequest(f"copy-{i}", ctx, end=cached))
            wall, sent = await timed(p.call(RemoteSendRequest(f"copy-{i}", ctx, 0, cached,
                                                              r.kv_addr)))
            await d.call(AbortRequest(f"copy-{i}"))
            assert sent.reused == cached and sent.computed == 0, sent
            walls.append(wall)
            if sent.timing is not None:
                queued.append(sent.timing.queued_s)
                tails.append(sent.timing.tail_s)

        def q(xs: list[float], at: float) -> float:
            return statistics.quantiles(xs, n=100)[int(at * 100) - 1] * 1e3 if len(xs) > 1 \
                else float("nan")

        print(f"{len(walls)} copies of {cached:,} cached tokens ({args.kv_transfer}, P on "
              f"{args.device}, D on {args.receiver_device or args.device}) in {args.seconds:g} "
              f"s: wall p50 {q(walls, .5):.2f} / p90 {q(walls, .9):.2f} ms; on P, taking the "
              f"call to the KV landing p50 {q(queued, .5):.2f} ms, after it {q(tails, .5):.2f} "
              f"ms; the hops p50 {q(walls, .5) - q(queued, .5) - q(tails, .5):.2f} ms",
              flush=True)
    finally:
        if spy is not None:
            spy.wait(timeout=args.seconds + 30)
        for c in clients.values():
            await c.aclose()
        stop_engines(procs.values())
    if spy is not None:
        print("\n".join(heaviest(args.py_spy)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--receiver-device", default=None)
    ap.add_argument("--gpu-share", type=float, default=0.3)
    ap.add_argument("--kv-transfer", default="shm")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--base-port", type=int, default=18300)
    ap.add_argument("--fresh", action="store_true",
                    help="copy a context P has just prefilled each time (bench.transfer's "
                         "copy), not the same one")
    ap.add_argument("--pause-s", type=float, default=0.0,
                    help="with --fresh: wait this long between the prefill and the copy")
    ap.add_argument("--py-spy", default=None, metavar="FILE",
                    help="sample P with py-spy meanwhile; its collapsed stacks go here")
    args = ap.parse_args(argv)
    if args.tokens < 16 or args.seconds <= 0:
        ap.error("--tokens must be at least 16 (one page) and --seconds positive")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
