"""Engine-level GPU figures (docs/benchmarks.md, "GPU: engine on H100"), driving EngineCore
in-process.

    python -m bench.engine_gpu --model random:llama-3.1-8b [--only decode1,prefill,decode128]
        [--json out.json]

Figures (each on a fresh engine state, prompts of random token ids, ignore_eos):
  decode1    batch 1, context 1,024: median wall time per decode step (the TPOT a user sees,
             scheduling and sampling included)
  prefill    8 prompts x 4,096 tokens: prompt tokens / wall time of the prefill steps (median
             of 3 rounds), and the GPU's time on the same steps
  decode128  128 sequences at context ~1,024: output tokens/s over decode-only steps, and the
             host overhead of a step: wall time minus the GPU's busy span, over wall time
  decode128penalized  the same, every request with repetition, frequency and presence
             penalties (engine/penalties.py): what the penalties cost a step
  offline    1,000 requests, inputs 128-2,048, outputs 128-1,024: total and output tokens/s,
             and the GPU's time on the same steps (CUDA events around each step's work)
  offline300 the same with 300 requests
  serve400   `bench.serve`'s 400 x (1,024 in / 128 out) sent at once, in-process: what the
             engine core alone does with the load of bench.serve's HTTP figure
  ttft       an idle engine's time to first token (max_tokens 1) against the GPU time of the
             same steps: a cold 1,000-token prompt, and 500 new tokens over a cached 2,500
  decode256short  256 sequences decoding at context ~128: step wall time against GPU time
  mixed      64 sequences decoding at context ~512 and a new 128-token prompt every step:
             step wall time against GPU time, and the decode-only step beside it
  mixed512   the same with 512-token prompts (576-token steps)
  mixed1200  the same with 1,200-token prompts (1,264-token steps)
  beside-copies  64 sequences decoding at context ~1,024: the step's wall time alone and while
             the host KV tier's copies (engine/host_swap.py: its copy kernel on its own stream)
             move 64 pages out and back in a loop, in alternating rounds; and the rate the
             copies moved (issue 40: a decode step slows <= 3% while copies run). The copies
             are the engine's beside steps: the kernel's narrow grid (4 programs).
             -staged: the staged copies (gather, then DMA); -dma: their DMAs alone (no
             gather); -k2 ... -k64: the kernel's grid at 2 to 64 programs (16: the wide grid,
             the copies' the GPU waits for);
             -staged-d4, -dma-d4: those two with DMAs of 4 pages (8 MiB) at most;
             -d2d: the DMAs between two device buffers (no PCIe); -events: the copy
             stream's wait and event alone, no bytes (diagnoses); -k4096: a program per
             32-KiB fragment (short blocks, not a few that loop); -hipri-k16, -hipri-k4096,
             -hipri-dma: the steps on a high-priority CUDA stream; -out-k4, -in-k4, -out-k16,
             -in-k16, -dma-out, -dma-in: the kernel or the DMAs one way only (diagnoses)
  hf         Hugging Face transformers eager `generate`, batch 1, context 1,024 (baseline)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.device import to_device
from engine.host_swap import HostSwap
from engine.kernels.host_pages import copy_host_pages
from kvcache.host_tier import HostState
from engine.requests import RequestState
from engine.sequence import Sequence
from microserve.model_files import resolve_model
from microserve.messages import SamplingParams


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompts(n: int, length: int | tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = length if isinstance(length, int) else rng.randint(*length)
        out.append([rng.randrange(vocab) for _ in range(k)])
    return out


def generating(core: EngineCore) -> list[Sequence]:
    return [e.seq for e in core.requests.in_state(RequestState.GENERATING).values()]


def drain(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def steady_step_ms(core: EngineCore, steps: int, still) -> tuple[float, int]:
    """Mean wall time of consecutive steps while `still()` holds. With async scheduling a
    step() returns once the next step is queued, so one call's time means nothing; over many
    steps the host is paced by the GPU (each step reads back the previous one's tokens)."""
    n = 0
    start = time.perf_counter()
    while n < steps and core.has_work() and still():
        core.step()
        n += 1
    return (time.perf_counter() - start) / max(n, 1) * 1e3, n


def decode1(core: EngineCore, vocab: int) -> dict:
    core.add_request("d1", prompts(1, 1024, vocab, 1)[0], params(257))
    while core.requests.get("d1").seq.num_computed_tokens < 1030:  # prefill done, decoding steadily
        core.step()
    ms, n = steady_step_ms(core, 200, lambda: "d1" in core.requests)
    drain(core)
    return {"tpot_ms": ms, "steps": n}


def prefill(core: EngineCore, vocab: int, rounds: int = 3) -> dict:
    """8 x 4,096-token prompts, `rounds` times with fresh prompts: tokens/s of the median
    round, and the GPU's time on the same steps."""
    runs = []
    for r in range(rounds):
        for i, p in enumerate(prompts(8, 4096, vocab, 2 + 100 * r)):
            core.add_request(f"p{r}-{i}", p, params(1))
        timer = StepTimer(core)
        torch.cuda.synchronize()
        t = time.perf_counter()
        drain(core)
        wall = time.perf_counter() - t
        gpu = timer.close()
        runs.append({"tokens_per_s": 8 * 4096 / wall, "wall_s": wall, **gpu,
                     "gpu_tokens_per_s": 8 * 4096 / gpu["gpu_s"],
                     "wall_over_gpu": wall / gpu["gpu_s"]})
    best = sorted(runs, key=lambda run: run["tokens_per_s"])[len(runs) // 2]
    return {**best, "rounds": runs}


def prefill_profile(core: EngineCore, vocab: int) -> dict:
    """One round of 8 x 4,096-token prompts under the profiler (after a warm round): the
    GPU's busy time in NCCL kernels and in the others, and how much of NCCL's ran while
    another kernel did (the overlapped halves of a tensor-parallel step), with the kernels
    that take the time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for r in range(2):
        for i, p in enumerate(prompts(8, 4096, vocab, 7 + 100 * r)):
            core.add_request(f"pp{r}-{i}", p, params(1))
        torch.cuda.synchronize()
        if r == 0:
            drain(core)
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            drain(core)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
               for e in prof.events() if e.device_type == DeviceType.CUDA]
    nccl = _union([(a, b) for a, b, is_nccl in kernels if is_nccl])
    other = _union([(a, b) for a, b, is_nccl in kernels if not is_nccl])
    both = sum(max(0, min(b, d) - max(a, c)) for a, b in nccl for c, d in other)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=14)
    print("8 x 4,096 prefill, by kernel:\n" + table, flush=True)
    return {"wall_ms": wall * 1e3, "nccl_busy_ms": _length(nccl) / 1e3,
            "other_busy_ms": _length(other) / 1e3, "nccl_beside_other_ms": both / 1e3,
            "busy_ms": _length(_union(nccl + other)) / 1e3}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def decode128(core: EngineCore, vocab: int, sampling: SamplingParams | None = None,
              batch: int = 128) -> dict:
    """`batch` sequences (128 unless named: decode2 ... decode16) decoding at ~1,024."""
    for i, p in enumerate(prompts(batch, 1024, vocab, 3)):
        core.add_request(f"b{i}", p, sampling or params(129))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
        core.step()
    ms, n = steady_step_ms(core, 100, lambda: len(core.requests) == batch)
    drain(core)
    return {"output_tokens_per_s": batch / ms * 1e3, "step_ms": ms, "steps": n}


def decode_short(core: EngineCore, vocab: int, batch: int = 256, context: int = 128) -> dict:
    """`batch` sequences decoding at a short context: the GPU's step is short (weights and
    little KV), so here the host's per-step work shows if it does not keep up. Wall time per
    step against the GPU's time on the same steps."""
    for i, p in enumerate(prompts(batch, context, vocab, 8)):
        core.add_request(f"s{i}", p, params(160))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
        core.step()
    timer = StepTimer(core)
    torch.cuda.synchronize()
    ms, n = steady_step_ms(core, 100, lambda: len(core.requests) == batch)
    gpu = timer.close()
    drain(core)
    gpu_ms = gpu["gpu_s"] / max(gpu["gpu_steps"], 1) * 1e3
    return {"step_ms": ms, "gpu_step_ms": gpu_ms, "wall_over_gpu": ms / gpu_ms, "steps": n,
            "output_tokens_per_s": batch / ms * 1e3}


def mixed(core: EngineCore, vocab: int, batch: int = 64, chunk: int = 128) -> dict:
    """`batch` sequences decoding at context ~512 while a new `chunk`-token prompt arrives
    every step (max_tokens 1), so every step is mixed: a prefill chunk beside the decodes.
    Wall time per step against the GPU's time on the same steps, and the decode-only step
    of the same batch for comparison."""
    for i, p in enumerate(prompts(batch, 512, vocab, 9)):
        core.add_request(f"m{i}", p, params(400))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
        core.step()
    decode_ms, _ = steady_step_ms(core, 30, lambda: True)
    arrivals = iter(enumerate(prompts(60, chunk, vocab, 10)))

    def arrive() -> bool:
        i, p = next(arrivals, (None, None))
        if p is not None:
            core.add_request(f"mx{i}", p, params(1))
        return p is not None

    timer = StepTimer(core)
    torch.cuda.synchronize()
    ms, n = steady_step_ms(core, 60, arrive)
    gpu = timer.close()
    drain(core)
    gpu_ms = gpu["gpu_s"] / max(gpu["gpu_steps"], 1) * 1e3
    return {"step_ms": ms, "gpu_step_ms": gpu_ms, "wall_over_gpu": ms / gpu_ms, "steps": n,
            "decode_only_step_ms": decode_ms}


def beside_copies(core: EngineCore, vocab: int, step_priority: int = 0, **kwargs) -> dict:
    """_beside_copies (below); `step_priority` < 0 (a diagnosis): the engine's steps on a CUDA
    stream of that priority (higher than the copies' stream, which has the default 0), so
    that the GPU's block scheduler gives their kernels freed SMs before the copy kernel's."""
    if not step_priority:
        return _beside_copies(core, vocab, **kwargs)
    device = core.runner.kv.kv.device
    if device.type != "cuda":
        raise SystemExit("beside-copies-hipri: stream priorities need a GPU")
    torch.cuda.synchronize(device)  # nothing of the default stream's still running after this
    with torch.cuda.stream(torch.cuda.Stream(device, priority=step_priority)):
        try:
            return {**_beside_copies(core, vocab, **kwargs), "step_priority": step_priority}
        finally:
            torch.cuda.synchronize(device)


def _beside_copies(core: EngineCore, vocab: int, batch: int = 64, context: int = 1024,
                   pages: int = 64, rounds: int = 3, steps: int = 100,
                   copy_programs: int | None = None, dma_only: bool = False,
                   dma_pages: int | None = None, dma_to: str = "host",
                   one_way: str | None = None) -> dict:
    """Decode steps alone and beside the host tier's copies, in alternating rounds of `steps`
    (alone first and last: each round beside copies is set against the mean of the rounds
    alone on either side of it, since the steps slow as the contexts grow). The copies are
    the swap path's own (a HostSwap over the engine's GPU pool, its own host buffer and
    stream) on `pages` pages taken from the pool for them, so no sequence's KV is touched:
    one copy in flight at a time, out then back in, started between steps as soon as the last
    one landed, each as a copy beside steps (`beside`: the engine's scheduler says so for
    its proactive copies out and prefetches back). `copy_programs`: None: HostSwap's defaults
    (the copy kernel, the narrow grid for copies beside steps); k: the kernel at k programs,
    beside steps too; 0: staged.
    `dma_only` (a diagnosis): the staged copies' DMAs alone, a device buffer of the same bytes
    to the pinned host buffer and back on a stream of their own, no gather. `dma_pages`:
    HostSwap's (the staged copies' DMAs, and these, `dma_pages` pages at most each).
    `dma_to` (with `dma_only`): "host"; "device" (a second device buffer: the same bytes, no
    PCIe); "nothing" (the copy stream's wait and event alone, no bytes). `one_way` (a
    diagnosis): "out" or "in", the copies one way only, again and again: the copy kernel (at
    the grid of copies beside steps; no bookkeeping: the pages are the bench's), or with
    `dma_only` the DMAs."""
    if dma_to not in ("host", "device", "nothing"):
        raise ValueError(f"dma_to {dma_to!r}: host, device or nothing")
    if one_way not in (None, "out", "in") or (one_way and not dma_only and copy_programs == 0):
        raise ValueError(f"one_way {one_way!r}: out or in, by the copy kernel or DMAs")
    if dma_only and core.runner.kv.kv.device.type != "cuda":
        raise SystemExit("beside-copies-dma: DMAs on a stream of their own need a GPU")
    if one_way and core.runner.kv.kv.device.type != "cuda":
        raise SystemExit("beside-copies-out/-in: copies on a stream of their own need a GPU")
    own = core.kv.pool.alloc(pages)
    if own is None:
        raise SystemExit(f"beside-copies: {pages} free pages needed")
    gpu_kv = core.runner.kv.kv
    swap = HostSwap(gpu_kv, memory_gb=(pages + 1) * gpu_kv[:, :, 0].numel()
                    * gpu_kv.element_size() / 2**30, copy_gbps=40, copy_programs=copy_programs,
                    dma_pages=dma_pages, beside_programs=copy_programs or None)
    moved = [0]
    staging = (torch.empty((pages, *swap.page_shape), dtype=gpu_kv.dtype, device=gpu_kv.device)
               if dma_only else None)
    far = torch.empty_like(staging) if dma_only and dma_to == "device" else swap.host
    span = 0 if dma_to == "nothing" else pages  # the pages each DMA diagnosis moves
    loop = {"event": None, "out": one_way != "in"}  # the copy in flight; the DMAs' next way

    def on_copy_stream(copy: Callable[[], int]) -> bool:
        """Unless the last copy is in flight, `copy()` (the bytes it moves) on the copy
        stream, after the steps queued so far."""
        if loop["event"] is not None and not loop["event"].query():
            return True
        swap.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(swap.stream):
            moved[0] += copy()
        loop["event"] = torch.cuda.Event()
        loop["event"].record(swap.stream)
        return True

    def dmas() -> int:
        for at in range(0, span, dma_pages or pages):
            piece = slice(at, at + (dma_pages or pages))
            if loop["out"]:
                far[piece].copy_(staging[piece], non_blocking=True)
            else:
                staging[piece].copy_(far[piece], non_blocking=True)
        loop["out"] = one_way == "out" if one_way else not loop["out"]
        return span * swap.page_bytes

    ids = (to_device([own, list(range(pages))], torch.long, gpu_kv.device)
           if one_way and not dma_only else None)

    def kernel_one_way() -> int:
        copy_host_pages(gpu_kv, swap.host, ids, one_way == "out", swap.beside_programs)
        return pages * swap.page_bytes

    def pump() -> bool:
        if dma_only:
            return on_copy_stream(dmas)
        if one_way:  # by kernel
            return on_copy_stream(kernel_one_way)
        swap.poll()
        state = swap.state("copies")
        if state is None:
            swap.swap_out("copies", own, pages * core.kv.page_size, beside=True)
        elif state is HostState.HELD:
            swap.swap_in("copies", own, beside=True)
        else:
            return True
        moved[0] += pages * swap.page_bytes
        return True

    for i, p in enumerate(prompts(batch, context, vocab, 11)):
        core.add_request(f"c{i}", p, params((2 * rounds + 1) * steps + 64))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
        core.step()
    alone, beside, rates = [], [], []
    try:
        for _ in range(rounds):
            ms, _ = steady_step_ms(core, steps, lambda: len(core.requests) == batch)
            alone.append(ms)
            moved[0], start = 0, time.perf_counter()
            ms, _ = steady_step_ms(core, steps, lambda: pump() and len(core.requests) == batch)
            swap.release("copies")  # waits out the copy in flight: the next round is alone
            if loop["event"] is not None:
                loop["event"].synchronize()
            beside.append(ms)
            rates.append(moved[0] / (time.perf_counter() - start) / 1e9)
        alone.append(steady_step_ms(core, steps, lambda: len(core.requests) == batch)[0])
    finally:
        swap.release("copies")
        core.kv.pool.release(own)
        drain(core)
    slowdowns = [b / ((a0 + a1) / 2) - 1 for b, a0, a1 in zip(beside, alone, alone[1:])]
    return {"copy_programs": swap.copy_programs, "beside_programs": swap.beside_programs,
            "dma_only": dma_only, "one_way": one_way,
            "step_ms_alone": alone, "step_ms_beside_copies": beside, "copies_gb_s": rates,
            "copies": swap.counters["kv_swap_outs"] + swap.counters["kv_swap_ins"],
            "slowdowns": slowdowns, "slowdown": statistics.median(slowdowns)}


def host_overhead(core: EngineCore, vocab: int, batch: int = 128) -> dict:
    """Share of a decode step (`batch` sequences at context 1,024) the GPU sits idle, from the
    profiler's kernel times, with the kernels that take the time."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(prompts(batch, 1024, vocab, 4)):
        core.add_request(f"h{i}", p, params(40))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in generating(core)):
        core.step()
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=18)
    print(f"batch-{batch} decode, 10 steps, by kernel:\n" + table, flush=True)
    busy_us = sum(e.self_device_time_total for e in prof.key_averages()) / steps
    drain(core)
    busy = busy_us / 1e6
    return {"step_ms": wall * 1e3, "gpu_busy_ms": busy * 1e3,
            "host_overhead_pct": max(0.0, 1 - busy / wall) * 100}


class StepTimer:
    """CUDA events around each step's device work (from its forward pass's first launch to its
    sampling's last), to compare the host's step time with the GPU's. A span includes any gap
    inside a step (an eager step launching slower than the GPU runs), not the gaps between."""

    def __init__(self, core: EngineCore):
        self.runner = core.runner
        self.forward, self.sample = core.runner.forward, core.runner.sample
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.runner.forward, self.runner.sample = self._forward, self._sample

    def _event(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _forward(self, *args, **kwargs):
        start = self._event()
        logits = self.forward(*args, **kwargs)
        self.spans.append((start, None if logits is not None else self._event()))
        return logits

    def _sample(self, *args, **kwargs):
        pending = self.sample(*args, **kwargs)
        self.spans[-1] = (self.spans[-1][0], self._event())
        return pending

    def close(self) -> dict:
        self.runner.forward, self.runner.sample = self.forward, self.sample
        torch.cuda.synchronize()
        busy = [a.elapsed_time(b) for a, b in self.spans]
        gaps = [self.spans[i][1].elapsed_time(self.spans[i + 1][0])
                for i in range(len(self.spans) - 1)]  # fmt: skip
        return {"gpu_s": sum(busy) / 1e3, "gpu_steps": len(busy),
                "gpu_idle_between_steps_s": sum(max(g, 0.0) for g in gaps) / 1e3}


def offline(core: EngineCore, vocab: int, n: int = 1000, cprofile: bool = False,
            input_len: int | tuple[int, int] = (128, 2048),
            output_len: tuple[int, int] = (128, 1024)) -> dict:
    core.kv.evict_cached()  # a repeat of the figure (same prompts) must not find them cached
    rng = random.Random(5)
    n_out = [rng.randint(*output_len) for _ in range(n)]
    ps = prompts(n, input_len, vocab, 6)
    for i, (p, o) in enumerate(zip(ps, n_out)):
        core.add_request(f"o{i}", p, params(o))
    before = core.stats().preemptions
    steps = decode_only = 0
    timer = StepTimer(core)
    prof = cProfile.Profile() if cprofile else None
    torch.cuda.synchronize()
    t = time.perf_counter()
    if prof:
        prof.enable()
    while core.has_work():
        running = core.scheduler.running
        decode_only += all(s.num_tokens - s.num_computed_tokens <= 1 for s in running) and not (
            core.scheduler.waiting and len(running) < core.config.max_num_seqs)
        core.step()
        steps += 1
    if prof:
        prof.disable()
    wall = time.perf_counter() - t
    gpu = timer.close()
    if prof:
        print(f"host profile of the offline run ({n} requests), by own time:", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    total_in, total_out = sum(map(len, ps)), sum(n_out)
    return {"requests": n, "wall_s": wall, "output_tokens_per_s": total_out / wall,
            "total_tokens_per_s": (total_in + total_out) / wall, "steps": steps,
            "mean_step_ms": wall / steps * 1e3, "decode_only_steps": decode_only,
            "preemptions": core.stats().preemptions - before, **gpu,
            "wall_over_gpu": wall / max(gpu["gpu_s"], 1e-9)}


def first_token(core: EngineCore, rid: str, prompt: list[int]) -> tuple[float, float, int]:
    """Idle engine: ms from add_request to the first token (max_tokens 1), the GPU's ms on the
    same steps, and the steps."""
    timer = StepTimer(core)
    torch.cuda.synchronize()
    t = time.perf_counter()
    core.add_request(rid, prompt, params(1))
    while core.has_work():
        if any(o.request_id == rid and o.token_ids for o in core.step()):
            break
    wall = time.perf_counter() - t
    drain(core)
    gpu = timer.close()
    return wall * 1e3, gpu["gpu_s"] * 1e3, gpu["gpu_steps"]


def ttft(core: EngineCore, vocab: int, repeat: int = 5, shapes: dict | None = None) -> dict:
    """Idle engine, max_tokens 1: wall time from add_request to the token, and the GPU's time
    on the same steps. Cold: a fresh 1,000-token prompt. Cached: 500 new tokens after a
    2,500-token context that an earlier request left in the prefix cache. `shapes`: other
    {name: (context, new)}."""

    out = {}
    shapes = shapes or {"cold_1000": (0, 1000), "cached_2500_new_500": (2500, 500)}
    for name, (context, new) in shapes.items():
        rows = []
        for i, p in enumerate(prompts(repeat + 1, context + new, vocab, 20 + context)):
            if context:
                first_token(core, f"ctx-{name}-{i}", p[:context])
            rows.append(first_token(core, f"{name}-{i}", p))
        rows = sorted(rows[1:])  # the first pays compiles
        wall, gpu, steps = rows[len(rows) // 2]
        out[name] = {"ttft_ms": wall, "gpu_ms": gpu, "steps": steps, "ratio": wall / gpu,
                     "all_ttft_ms": [r[0] for r in rows]}
    return out


def hf_baseline(model_dir: str, vocab: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.eval()
    ids = torch.tensor(prompts(1, 1024, vocab, 7), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=129, min_new_tokens=129, do_sample=False)
        torch.cuda.synchronize()
        long = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        first = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return {"tpot_ms": (long - first) / 128 * 1e3}


FIGURES = {"decode1": decode1, "prefill": prefill, "decode128": decode128,
           **{f"decode{b}": partial(decode128, batch=b) for b in (2, 4, 8, 12, 16, 32)},
           "prefill-profile": prefill_profile,
           "overhead": host_overhead, "offline": offline,
           "overhead1": lambda core, vocab: host_overhead(core, vocab, batch=1),
           "decode128penalized": lambda core, vocab: decode128(core, vocab, SamplingParams(
               max_tokens=129, temperature=0.0, ignore_eos=True, repetition_penalty=1.1,
               frequency_penalty=0.5, presence_penalty=0.5)),
           "offline300": lambda core, vocab: offline(core, vocab, n=300), "ttft": ttft,
           # long whole prompts (the 16,384 in two steps of --max-prefill-step-tokens)
           "ttft-long": partial(ttft, repeat=3, shapes={"cold_8192": (0, 8192),
                                                        "cold_16384": (0, 16384)}),
           "decode256short": decode_short, "mixed": mixed, "beside-copies": beside_copies,
           "beside-copies-staged": partial(beside_copies, copy_programs=0),
           "beside-copies-dma": partial(beside_copies, dma_only=True),
           "beside-copies-staged-d4": partial(beside_copies, copy_programs=0, dma_pages=4),
           "beside-copies-dma-d4": partial(beside_copies, dma_only=True, dma_pages=4),
           "beside-copies-d2d": partial(beside_copies, dma_only=True, dma_to="device"),
           "beside-copies-events": partial(beside_copies, dma_only=True, dma_to="nothing"),
           **{f"beside-copies-k{k}": partial(beside_copies, copy_programs=k)
              for k in (2, 4, 8, 16, 32, 64, 4096)},  # 4,096: a program per fragment of 64 pages
           **{f"beside-copies-hipri-k{k}": partial(beside_copies, copy_programs=k,
                                                   step_priority=-1) for k in (16, 4096)},
           "beside-copies-hipri-dma": partial(beside_copies, dma_only=True, step_priority=-1),
           **{f"beside-copies-{way}-k{k}": partial(beside_copies, copy_programs=k, one_way=way)
              for way in ("out", "in") for k in (1, 2, 4, 16)},
           **{f"beside-copies-dma-{way}": partial(beside_copies, dma_only=True, one_way=way)
              for way in ("out", "in")},
           "mixed512": lambda core, vocab: mixed(core, vocab, chunk=512),
           "mixed1200": lambda core, vocab: mixed(core, vocab, chunk=1200),
           # bench.peers' Poisson load at 16/s: ~19 decoding beside a 1,024-token prompt
           **{f"mixed{c}b19": partial(mixed, batch=19, chunk=c) for c in (600, 1024, 1500)},
           "offline-profile": lambda core, vocab: offline(core, vocab, n=300, cprofile=True),
           "serve400": lambda core, vocab: offline(core, vocab, n=400, input_len=1024,
                                                   output_len=(128, 128)),
           }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--only", default="decode1,prefill,decode128,overhead")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-piecewise-tokens", type=int, default=None,
                    help="steps with prompt tokens replay piecewise graphs up to this size "
                         "(default: the engine's; 0: eager)")
    ap.add_argument("--piecewise-bucket-step", type=int, default=None,
                    help="the engine's --piecewise-bucket-step (buckets' spacing above 512)")
    ap.add_argument("--no-gemv", action="store_true",
                    help="batch-1 projections through cuBLAS, not the Triton GEMV")
    ap.add_argument("--few-rows-gemm", type=int, default=None, metavar="N",
                    help="the engine's --few-rows-gemm: steps of 2..N rows through the "
                         "few-rows kernel, not cuBLAS (default: the engine's; 0: off)")
    ap.add_argument("--prompt-attention", choices=("auto", "paged", "sdpa"), default=None,
                    help="the engine's --prompt-attention (whole prompts' attention)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the GEMV without programmatic dependent launch")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default=None,
                    help="torch's GEMM library in CUDA graphs (default: the engine's)")
    ap.add_argument("--eager-blas", choices=("cublas", "cublaslt"), default=None,
                    help="torch's GEMM library in steps run eagerly (default: the engine's)")
    ap.add_argument("--quantization", choices=("fp8",), default=None,
                    help="the engine's --quantization (fp8 weights)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="the engine's --kv-cache-dtype (fp8: an e4m3 KV cache)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="the engine over this many GPUs (cuda:0 and the next ones)")
    ap.add_argument("--all-reduce", choices=("auto", "nccl", "one-shot"), default="auto",
                    help="the engine's --all-reduce (with --tensor-parallel-size > 1)")
    ap.add_argument("--tp-overlap-tokens", type=int, default=None,
                    help="the engine's --tp-overlap-tokens (0: every all-reduce after its GEMM)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    wanted = args.only.split(",")
    config = EngineConfig(
        model=model_dir, device="cuda", max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
        **({} if args.max_piecewise_tokens is None else
           {"max_piecewise_tokens": args.max_piecewise_tokens}),
        decode_gemv=not args.no_gemv,
        **({} if args.few_rows_gemm is None else {"few_rows_gemm": args.few_rows_gemm}),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, pdl=not args.no_pdl,
        tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **({} if args.piecewise_bucket_step is None else
           {"piecewise_bucket_step": args.piecewise_bucket_step}),
        **({} if args.tp_overlap_tokens is None else
           {"tp_overlap_tokens": args.tp_overlap_tokens}),
        **({"blas_library": args.blas} if args.blas else {}),
        **({"prompt_attention": args.prompt_attention} if args.prompt_attention else {}),
        **({"eager_blas_library": args.eager_blas} if args.eager_blas else {}),
    )  # fmt: skip
    results = {"model": args.model, "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "blas": config.blas_library, "eager_blas": config.eager_blas_library}  # fmt: skip
    results["gemv"] = "off" if args.no_gemv else "no-pdl" if args.no_pdl else "pdl"
    results["few_rows_gemm"] = "auto" if args.few_rows_gemm is None else args.few_rows_gemm
    results["prompt_attention"] = config.prompt_attention
    results["tensor_parallel_size"] = args.tensor_parallel_size
    results["all_reduce"] = args.all_reduce
    results["tp_overlap_tokens"] = config.tp_overlap_tokens
    results["kv_cache_dtype"] = args.kv_cache_dtype
    t = time.perf_counter()
    core = EngineCore(config)
    results["startup_s"] = time.perf_counter() - t
    # the engine's: an fp8 checkpoint is fp8 without --quantization
    results["quantization"] = core.info.quantization
    results["max_piecewise_tokens"] = core.config.max_piecewise_tokens
    results["piecewise_bucket_step"] = core.config.piecewise_bucket_step
    results["kv_capacity_tokens"] = core.info.kv_capacity_tokens
    vocab = core.info.vocab_size
    print(json.dumps(results), flush=True)
    for name in wanted:
        if name == "hf":
            continue
        results[name] = FIGURES[name](core, vocab)
        core.check_integrity()
        print(name, json.dumps(results[name]), flush=True)
    core.close()  # the tensor-parallel ranks stop with it
    if "hf" in wanted:
        del core
        torch.cuda.empty_cache()
        results["hf"] = hf_baseline(model_dir, vocab)
        print("hf", json.dumps(results["hf"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
