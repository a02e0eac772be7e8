"""KV transfer between two real engine daemons: throughput of `remote_send` and its cost
against computing the same KV locally; context migration against recompute and a local
prefix-cache hit; the receiver's decode speed while KV arrives.

    python -m bench.transfer [--model smollm2-135m-instruct] [--tokens 1000,3000] [--repeat 3]
    python -m bench.transfer --device cuda --model random:llama-3.1-8b --gpu-share 0.3 \
        [--modes send,migrate,tpot] [--kv-transfer nvshmem,cuda_ipc]

Starts `microserve engine` processes on this host: P (the sender) and a receiver per
`--kv-transfer` kind: `shm` and `tcp` on CPU, `cuda_ipc` and `tcp` with `--device cuda` by
default (the engines then share one GPU, each with `--gpu-share` of its memory; with
`--device cuda:0 --receiver-device cuda:1`, P sits on one GPU and the receivers on another, the
two-GPU layout P/D is deployed in). With `nvshmem`
among the kinds, P and that receiver form an NVSHMEM group of two, as `microserve up` would
(P then sends to the other receivers from its pool in the symmetric heap). For each context
length N and each receiver, with fresh random token ids every run:

send (paper §3.6; docs/benchmarks.md, "CPU: KV transfer between engines"):
  copy     P already holds the context in its prefix cache (it served it once), so remote_send
           of its whole pages (992 of 1,000 tokens with 16-token pages) is pure transfer:
           MB/s = KV bytes sent / wall time of the call
  compute  P has nothing cached: remote_send prefills N tokens on P and sends each step's KV
           while the forward pass goes on
  prefill  the same N tokens prefilled on P alone and on D alone (start_generate with
           max_tokens=1; on D, the work a transfer saves the receiver)

migrate (paper §4.2, Fig. 12 and Table 3): a prompt of N tokens whose first N - 500 P has
  cached, served as the context_migration and pd strategies do for a greedy request (D:
  prep_recv of the whole prompt, P: remote_send that also samples the first token, D:
  start_generate from the prompt's end with that token, max_tokens=1)
  migration  P's remote_send copies its cached pages and computes the rest; its time is "P's
             prefill", the paper's figure (P starts beside D's prep_recv and is told where to
             send by send_to, as the router does); the first token is the client's: the
             router emits P's sampled token when P answers; D's first chunk comes after D's
             start_generate;
             also the flow where D samples the first token (P sends prompt[:-1], D computes
             the last token: what the strategies do for logprobs, a grammar or a seed)
  recompute  the same flow for a fresh prompt: P computes all N tokens
  local hit  D itself had the first N - 500 cached (it served them once) and prefills the rest:
             the best a migration could do (the target: >= 90% as fast)
  per layer  a pure copy of the cached context (remote_send of P's pages alone) and the local
             hit's prefill, divided by the layer count (the paper's Table 3)

tpot (receiving GPU only): 16 greedy streams decode on each GPU kind's receiver; their time per
  output token is taken while it is idle, while D's side of a copy runs alone (prep_recv and
  abort, back to back, no bytes: D's host cost), while P copies 3,000 cached tokens into it in
  a loop (transfer alone), and while P prefills and sends fresh 3,000-token prompts to it (on
  one shared GPU that also takes the receiver's GPU for P's compute); --tpot-rounds rounds of
  the four windows, each set against its round's idle one. The copy kernel's grid is the
  sender's (MICROSERVE_KV_COPY_PROGRAMS in the engines' environment, a diagnosis)

Times are wall-clock per HTTP call, measured from this client (so they include the HTTP round
trip and the engine's scheduling). Prints Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from microserve.messages import (AbortRequest, PrepRecvRequest, RemoteSendRequest, SamplingParams,
                                 SendToRequest)
from microserve.microserving_client import EngineClient
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model


ENGINE_KEY = secrets.token_urlsafe(32)  # KV moves only between engines sharing a key


def start_engine(model: str, port: int, *args: str, api_key: str | None = None
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.cli", "engine", "--model", model, "--port",
           str(port), "--log-level", "warning", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    if api_key is not None:
        env["MICROSERVE_API_KEY"] = api_key
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env)


def stop_engines(procs) -> None:
    """SIGTERM every engine, then wait for each (30 s); one still running then is killed, and
    said so. (An engine exits once its connections have closed: a client's channel left open,
    as EngineClient.aclose did until it awaited the channel's end, held it.)"""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            print(f"engine {' '.join(proc.args[6:8])} still running 30 s after SIGTERM: "
                  "killed", file=sys.stderr, flush=True)
            proc.kill()
            proc.wait()


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


async def prefill_on(engine: EngineClient, rid: str, prompt: list[int],
                     begin: int = 0) -> None:
    """Prefill `prompt[begin:]` on `engine` and sample one token (what a TTFT measures)."""
    async for _ in engine.start_generate(rid, prompt, begin,
                                         SamplingParams(max_tokens=1, temperature=0)):
        pass


async def measure(p: EngineClient, d: EngineClient, n: int, vocab: int, page_size: int,
                  rng) -> dict:
    ctx = fresh(rng, vocab, n)
    tag = f"{n}-{rng.random()}"
    await prefill_on(p, f"warm-{tag}", ctx)  # P caches ctx's whole pages
    cached = n // page_size * page_size  # the prefix cache holds whole pages only
    r = await d.call(PrepRecvRequest(f"copy-{tag}", ctx, end=cached))
    copy_s, sent = await timed(p.call(RemoteSendRequest(f"copy-{tag}", ctx, 0, cached, r.kv_addr)))
    assert sent.reused == cached and sent.computed == 0, sent
    timing = sent.timing  # P's own parts of the copy's time; the rest is the hops
    await d.call(AbortRequest(f"copy-{tag}"))
    new = fresh(rng, vocab, n)
    r = await d.call(PrepRecvRequest(f"compute-{tag}", new, end=n))
    compute_s, _ = await timed(p.call(RemoteSendRequest(f"compute-{tag}", new, 0, n, r.kv_addr)))
    await d.call(AbortRequest(f"compute-{tag}"))
    p_prefill_s, _ = await timed(prefill_on(p, f"p-local-{tag}", fresh(rng, vocab, n)))
    prefill_s, _ = await timed(prefill_on(d, f"local-{tag}", fresh(rng, vocab, n)))
    return {"copy_s": copy_s, "copied": sent.reused, "compute_s": compute_s,
            "p_prefill_s": p_prefill_s, "prefill_s": prefill_s,
            "copy_queued_s": timing.queued_s if timing else math.nan,
            "copy_tail_s": timing.tail_s if timing else math.nan}  # fmt: skip


def fresh(rng, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


async def pd_first_token(p: EngineClient, d: EngineClient, rid: str, prompt: list[int],
                         p_samples: bool = True) -> tuple[float, float, float]:
    """The P/D flow of the router's pd and context_migration strategies
    (EngineHandle.send_prompt, then start_generate), up to the first token: P's remote_send
    starts beside D's prep_recv and is told where to send when that answers (send_to).
    `p_samples`: P samples the first token, which the router gives the client as soon as P
    answers (greedy requests); else D computes the last prompt token. Returns seconds of P's
    remote_send, to the client's first token, and to D's first chunk."""
    t0 = time.perf_counter()
    n = len(prompt)
    end = n if p_samples else n - 1
    params = SamplingParams(max_tokens=1, temperature=0)
    sending = asyncio.ensure_future(p.call(RemoteSendRequest(rid, prompt, 0, end, None,
                                                  params if p_samples else None)))
    r = await d.call(PrepRecvRequest(rid, prompt, end=end, wait_s=0))
    await p.call(SendToRequest(rid, r.matched, r.kv_addr))
    sent = await sending
    send_s = first_s = time.perf_counter() - t0
    async for _ in d.start_generate(rid, prompt, end, params, first_token=sent.first_token):
        pass
    d_first_s = time.perf_counter() - t0
    return send_s, first_s if p_samples else d_first_s, d_first_s


async def measure_migration(p: EngineClient, d: EngineClient, n: int, new: int, vocab: int,
                            page_size: int, rng) -> dict:
    """Paper §4.2: P holds the first n - new tokens in its prefix cache; the request's prefill
    runs on P, which copies the cached KV and computes the rest, and D decodes."""
    tag = f"{n}-{rng.random()}"
    ctx = fresh(rng, vocab, n - new)
    await prefill_on(p, f"warm-{tag}", ctx)  # P caches the context's whole pages
    cached = (n - new) // page_size * page_size
    r = await d.call(PrepRecvRequest(f"copy-{tag}", ctx, end=cached))
    copy_s, _ = await timed(p.call(RemoteSendRequest(f"copy-{tag}", ctx, 0, cached, r.kv_addr)))
    await d.call(AbortRequest(f"copy-{tag}"))
    migrate_s, migrate_ttft, migrate_d = await pd_first_token(p, d, f"mig-{tag}",
                                                              ctx + fresh(rng, vocab, new))
    ctx = fresh(rng, vocab, n - new)  # D holds the first context now
    await prefill_on(p, f"warm2-{tag}", ctx)
    _, d_samples_ttft, _ = await pd_first_token(p, d, f"mig-d-{tag}",
                                                ctx + fresh(rng, vocab, new), p_samples=False)
    recompute_s, recompute_ttft, _ = await pd_first_token(p, d, f"cold-{tag}",
                                                          fresh(rng, vocab, n))
    ctx = fresh(rng, vocab, n - new)
    await prefill_on(d, f"dwarm-{tag}", ctx)  # D caches it
    hit_s, _ = await timed(prefill_on(d, f"hit-{tag}", ctx + fresh(rng, vocab, new)))
    return {"migrate_s": migrate_s, "recompute_s": recompute_s, "migrate_ttft": migrate_ttft,
            "migrate_d": migrate_d,
            "recompute_ttft": recompute_ttft, "hit_s": hit_s, "copy_s": copy_s,
            "d_samples_ttft": d_samples_ttft}


async def decode_times(d: EngineClient, vocab: int, rng, streams: int, max_tokens: int,
                       stop: asyncio.Event) -> list[list[float]]:
    """Run `streams` greedy decodes on `d` until `stop` (a stream that reaches `max_tokens`
    starts again on a fresh prompt); returns each stream's token times."""
    times: list[list[float]] = [[] for _ in range(streams)]

    async def one(i: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        while not stop.is_set():
            async for chunk in d.start_generate(f"tpot-{i}-{rng.random()}",
                                                fresh(rng, vocab, 64), 0, sampling):
                times[i] += [time.perf_counter()] * len(chunk.token_ids)
                if stop.is_set():
                    break

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return times


TPOT_WINDOWS = ("idle", "rpc", "copy", "compute")
# each stream's tokens before it starts again: ~3 s at 6 ms a token, so every 4-s window sees
# contexts over the whole range (with 2,936, a window fell at one end of the range or the
# other, and the rounds of one H200 run read 0.92-1.25x for the same load)
TPOT_TOKENS = 512


async def measure_tpot(p: EngineClient, d: EngineClient, vocab: int, page_size: int, rng,
                       n: int, max_tokens: int, phase_s: float = 4.0, streams: int = 16,
                       rounds: int = 1) -> dict:
    """D's time per output token over `rounds` rounds of four windows: idle; `rpc` (D's side
    of a copy alone: prep_recv of `n` cached tokens and its abort, back to back, no bytes);
    receiving copies of `n` tokens; receiving while P computes `n`-token prompts. Each stream
    decodes up to `max_tokens`, then starts again. Each window is set against the idle one
    of its round (the machine drifts over a run); the figure is the median over rounds."""
    cached = fresh(rng, vocab, n)
    await prefill_on(p, "tpot-ctx", cached)
    whole = n // page_size * page_size
    stop, phase = asyncio.Event(), {"now": "warm"}
    marks: list[tuple[str, float]] = []
    sends = {"rpc": 0, "copy": 0, "compute": 0}

    async def load() -> None:
        i = 0
        while not stop.is_set():
            kind = phase["now"]
            if kind not in sends:
                await asyncio.sleep(0.01)
                continue
            i += 1
            prompt, end = (fresh(rng, vocab, n), n) if kind == "compute" else (cached, whole)
            r = await d.call(PrepRecvRequest(f"load-{i}", prompt, end=end))
            if kind != "rpc":
                await p.call(RemoteSendRequest(f"load-{i}", prompt, r.matched, end, r.kv_addr))
            await d.call(AbortRequest(f"load-{i}"))
            sends[kind] += 1

    async def phases() -> None:
        await asyncio.sleep(2.0)  # the streams' prefills are over
        for _ in range(rounds):
            for name in TPOT_WINDOWS:
                phase["now"] = name
                marks.append((name, time.perf_counter()))
                await asyncio.sleep(phase_s)
        marks.append(("end", time.perf_counter()))
        stop.set()

    loader = asyncio.create_task(load())
    timer = asyncio.create_task(phases())
    times = await decode_times(d, vocab, rng, streams, max_tokens, stop)
    await timer
    await loader
    windows: dict[str, list[dict]] = {name: [] for name in TPOT_WINDOWS}
    for (name, lo), (_, hi) in zip(marks, marks[1:]):
        lo += 0.2  # skip the switch between loads
        per_stream = [(hi - lo) / c for c in (sum(lo <= t < hi for t in ts) for ts in times) if c]
        gaps = sorted(b - a for ts in times for a, b in zip(ts, ts[1:]) if lo <= a and b < hi)
        windows[name].append({  # (a window with no token: nan, not a crash)
            "tpot_ms": 1e3 * statistics.mean(per_stream) if per_stream else math.nan,
            "gap_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))] if gaps else math.nan})
    for got in windows.values():  # each window against its round's idle one
        for w, idle in zip(got, windows["idle"]):
            w["vs_idle"] = w["tpot_ms"] / idle["tpot_ms"]
    out = {"sends": sends, "rounds": windows}
    for name, got in windows.items():
        out[name] = {k: statistics.median(w[k] for w in got)
                     for k in ("tpot_ms", "gap_p99_ms", "vs_idle")}
    return out


async def median_runs(measure_one, repeat: int) -> dict:
    await measure_one()  # warm-up
    runs = [await measure_one() for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def table_send(clients, kinds, lengths, mc, kv_bytes_per_token, repeat, rng) -> None:
    print("| backend | tokens | copy: remote_send from P's cache | of it on P: queued / tail "
          "(the rest: the hops) | MB/s | compute: remote_send, prefill on P | prefill on P "
          "alone | prefill on D alone | compute / P alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        for n in lengths:
            med = await median_runs(lambda: measure(clients["p"], clients[kind], n,
                                                    mc.vocab_size, 16, rng), repeat)
            mb_s = med["copied"] * kv_bytes_per_token / med["copy_s"] / 1e6
            print(f"| {kind} | {n:,} | {med['copy_s'] * 1e3:.1f} ms "
                  f"({int(med['copied'])} tokens) | {med['copy_queued_s'] * 1e3:.2f} / "
                  f"{med['copy_tail_s'] * 1e3:.2f} ms | {mb_s:,.0f} | "
                  f"{med['compute_s'] * 1e3:.0f} ms | {med['p_prefill_s'] * 1e3:.0f} ms | "
                  f"{med['prefill_s'] * 1e3:.0f} ms | "
                  f"{med['compute_s'] / med['p_prefill_s']:.2f}x |",
                  flush=True)  # fmt: skip


async def table_migrate(clients, kinds, lengths, mc, new, repeat, rng) -> None:
    print(f"\n| backend | tokens ({new} new) | P's prefill: migration / recompute | speedup | "
          "first token: migration / recompute | D's first chunk | local hit on D | local hit / "
          "migration: P's prefill, first token | first token if D samples it: migration, "
          "local hit / it | per layer: copy of the context / local prefill of the rest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    layers = mc.num_layers
    for kind in kinds:
        for n in lengths:
            m = await median_runs(lambda: measure_migration(
                clients["p"], clients[kind], n, new, mc.vocab_size, 16, rng), repeat)
            print(f"| {kind} | {n:,} | {m['migrate_s'] * 1e3:.1f} / {m['recompute_s'] * 1e3:.1f} "
                  f"ms | {m['recompute_s'] / m['migrate_s']:.2f}x | "
                  f"{m['migrate_ttft'] * 1e3:.1f} / {m['recompute_ttft'] * 1e3:.1f} ms | "
                  f"{m['migrate_d'] * 1e3:.1f} ms | {m['hit_s'] * 1e3:.1f} ms | "
                  f"{m['hit_s'] / m['migrate_s']:.0%}, "
                  f"{m['hit_s'] / m['migrate_ttft']:.0%} | "
                  f"{m['d_samples_ttft'] * 1e3:.1f} ms, {m['hit_s'] / m['d_samples_ttft']:.0%} | "
                  f"{m['copy_s'] * 1e3 / layers:.2f} / {m['hit_s'] * 1e3 / layers:.2f} ms |",
                  flush=True)  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokens", default="1000,3000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="each engine's --cpu-threads (default: torch's own, all cores)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: three engines on one GPU")
    ap.add_argument("--receiver-device", default=None,
                    help="the receivers' device (default: --device), e.g. cuda:1 with --device "
                         "cuda:0 for P and D on two GPUs of one host")
    ap.add_argument("--gpu-share", type=float, default=0.3,
                    help="CUDA: each engine's --gpu-memory-utilization")
    ap.add_argument("--modes", default="send", help="any of send,migrate,tpot (tpot: GPU)")
    ap.add_argument("--new-tokens", type=int, default=500, help="migrate: tokens not cached")
    ap.add_argument("--tpot-rounds", type=int, default=3,
                    help="tpot: rounds of the four windows, interleaved (the median is shown)")
    ap.add_argument("--kv-transfer", default=None,
                    help="the receivers' kinds, comma-separated (default: cuda_ipc,tcp on a "
                         "GPU, shm,tcp on CPU); with nvshmem, P joins that receiver's group")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="P's ranks, on GPUs --device + 0 .. N-1")
    ap.add_argument("--receiver-tensor-parallel-size", type=int, default=1,
                    help="each receiver's ranks, on GPUs --receiver-device + 0 .. N-1 (KV "
                         "moves between engines of any two sizes by shm or cuda_ipc)")
    args = ap.parse_args()
    modes = set(args.modes.split(","))
    model = str(resolve_model(args.model))
    mc = ModelConfig.from_dir(model)
    kv_bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4  # fp32 on CPU
    lengths = [int(x) for x in args.tokens.split(",")]
    common = ("--num-pages", str(4 * max(lengths) // 16 + 64), "--max-model-len",
              str(max(lengths) + 64), "--max-num-batched-tokens", "512")  # fmt: skip
    if args.engine_threads is not None:
        common += ("--cpu-threads", str(args.engine_threads))
    gpu = args.device != "cpu"
    device = {"p": args.device}
    if gpu:  # the pool size comes from the memory share
        common = ("--gpu-memory-utilization", str(args.gpu_share),
                  "--max-model-len", str(max(lengths) + 64))
    kinds = tuple(args.kv_transfer.split(",")) if args.kv_transfer else (
        ("cuda_ipc", "tcp") if gpu else ("shm", "tcp"))
    ports = {"p": args.base_port} | {k: args.base_port + 1 + i for i, k in enumerate(kinds)}
    transfer = {"p": ()} | {k: ("--kv-transfer", k) for k in kinds}
    group = tempfile.mkdtemp(prefix="bench-nvshmem-")  # P is PE 0, the nvshmem receiver PE 1
    if "nvshmem" in kinds:
        transfer["p"] = ("--kv-transfer", "nvshmem", "--nvshmem-group", f"0/2@{group}")
        transfer["nvshmem"] += ("--nvshmem-group", f"1/2@{group}")
    device |= {k: args.receiver_device or args.device for k in kinds}
    placed = {k: ("--device", device[k]) if gpu else () for k in ports}
    for k in ports:
        size = args.tensor_parallel_size if k == "p" else args.receiver_tensor_parallel_size
        if size > 1:
            placed[k] += ("--tensor-parallel-size", str(size))
    procs = {k: start_engine(model, port, *common, *placed[k], *transfer[k], api_key=ENGINE_KEY)
             for k, port in ports.items()}
    urls = {k: f"http://127.0.0.1:{port}" for k, port in ports.items()}
    clients: dict[str, EngineClient] = {}
    try:
        for k in procs:
            await wait_healthy(urls[k], procs[k])
        clients = {k: EngineClient(u, api_key=ENGINE_KEY) for k, u in urls.items()}
        rng = random.Random(0)
        info = (await clients["p"].stats()).info
        if info.dtype != "float32":
            kv_bytes_per_token //= 2
        where = info.device if len(set(device.values())) == 1 else (
            f"P on {device['p']}, receivers on {device[kinds[0]]}")
        if args.tensor_parallel_size > 1 or args.receiver_tensor_parallel_size > 1:
            where += (f"; P at TP {args.tensor_parallel_size}, receivers at TP "
                      f"{args.receiver_tensor_parallel_size}")
        print(f"model {mc.name} on {where}, KV {kv_bytes_per_token} B/token "
              f"({info.dtype}), median of {args.repeat} runs after one warm-up\n")
        if "send" in modes:
            await table_send(clients, kinds, lengths, mc, kv_bytes_per_token, args.repeat, rng)
        if "migrate" in modes:
            await table_migrate(clients, kinds, lengths, mc, args.new_tokens, args.repeat, rng)
        if "tpot" in modes and gpu:  # the engines' environment is this process's
            from kvcache.transfer.cuda_ipc import CudaIpcPeer
        for kind in (k for k in kinds if k != "tcp") if "tpot" in modes and gpu else ():
            n = min(3000, max(lengths))
            r = await measure_tpot(clients["p"], clients[kind], mc.vocab_size, 16, rng,
                                   n, max_tokens=TPOT_TOKENS, rounds=args.tpot_rounds)
            print(f"\nD's decode while receiving with {kind} (16 streams; "
                  f"{r['sends']['rpc']} prep_recv/abort pairs alone, {r['sends']['copy']} "
                  f"copies and {r['sends']['compute']} computed sends of {n:,} tokens in the "
                  f"windows; {args.tpot_rounds} rounds, median; the copy kernel's grid "
                  f"{CudaIpcPeer.num_programs} programs)\n")
            print("| D is | time per output token | vs idle (same round) | p99 gap between "
                  "tokens | each round vs idle |")
            print("|---|---|---|---|---|")
            for name in TPOT_WINDOWS:
                each = ", ".join(f"{w['vs_idle']:.3f}" for w in r["rounds"][name])
                print(f"| {name} | {r[name]['tpot_ms']:.2f} ms | {r[name]['vs_idle']:.3f}x | "
                      f"{r[name]['gap_p99_ms']:.2f} ms | {each} |")
    finally:
        for c in clients.values():  # first: an engine waits for its open connections to close
            await c.aclose()
        stop_engines(procs.values())
        shutil.rmtree(group, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
