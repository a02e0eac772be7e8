"""Where a step's time goes, in-process on one engine (docs/benchmarks.md, "GPU: the engine at full
load"): wall time against GPU time of short-prompt first tokens, eager against graphed decode, and
torch.profiler kernel tables of a short prefill, a long prefill and a batch-128 decode.

    python bench/scripts/profile_steps.py [--model random:llama-3.1-8b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_gpu import (
    drain,
    first_token,
    generating,
    params,
    prompts,
    steady_step_ms,
)
from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.model_files import resolve_model


def ttft_by_length(core: EngineCore, vocab: int, lengths, repeat: int = 9) -> dict:
    out = {}
    for n in lengths:
        rows = [first_token(core, f"t{n}-{i}", p)
                for i, p in enumerate(prompts(repeat + 1, n, vocab, 40 + n))][1:]  # fmt: skip
        out[n] = {"wall_ms": statistics.median(r[0] for r in rows),
                  "gpu_ms": statistics.median(r[1] for r in rows)}  # fmt: skip
    return out


def decode_step_ms(core: EngineCore, vocab: int, batch: int, eager: bool) -> float:
    graphs = core.runner.graphs
    if eager:
        core.runner.graphs = None
    try:
        for i, p in enumerate(prompts(batch, 1024, vocab, 50 + batch)):
            core.add_request(f"d{batch}-{eager}-{i}", p, params(80))
        while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
            core.step()
        ms, _ = steady_step_ms(core, 40, lambda: len(core.requests) == batch)
        drain(core)
    finally:
        core.runner.graphs = graphs
    return ms


def host_breakdown(core: EngineCore, vocab: int, steps: int = 30) -> dict:
    """Host time per call of each op an eager step launches (no profiler: perf_counter around
    the Python call, which only queues work while the GPU keeps up), over `steps` eager steps
    of one 16-token prefill plus decoding."""
    import engine.attention.triton_backend as tb
    import engine.kernels.fused as fused
    import engine.models.llama as llama

    spent: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t)
        return wrapper

    patches = [(tb, n) for n in ("rope_and_store_kv", "paged_decode_attention",
                                 "paged_extend_attention")]  # fmt: skip
    patches += [(fused, n) for n in ("rms_norm", "fused_add_rms_norm", "silu_and_mul")]
    patches += [(torch.nn.Linear, "forward"), (llama.LlamaDecoderLayer, "forward"),
                (core.runner, "_forward_eager"), (core.runner, "forward"),
                (core.runner, "sample"), (core, "step")]
    saved = [(obj, n, getattr(obj, n)) for obj, n in patches]
    for obj, n, fn in saved:
        setattr(obj, n, timed(f"{getattr(obj, '__name__', type(obj).__name__)}.{n}", fn))
    graphs, core.runner.graphs = core.runner.graphs, None
    try:
        core.add_request("hb", prompts(1, 16, vocab, 70)[0], params(steps))
        drain(core)
    finally:
        core.runner.graphs = graphs
        for obj, n, fn in saved:
            setattr(obj, n, fn)
    return {k: {"calls": len(v), "us_per_call": sum(v) / len(v) * 1e6,
                "ms_per_step": sum(v) / steps * 1e3} for k, v in spent.items()}


def kernel_table(core: EngineCore, run, rows: int = 25) -> str:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
    by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"-- by GPU time\n{by_gpu}\n-- by host time\n{by_cpu}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tables", action="store_true", help="print profiler kernel tables")
    ap.add_argument("--eager-blas", choices=("cublas", "cublaslt"), default=None)
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--max-piecewise-tokens", type=int, default=512)
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    core = EngineCore(EngineConfig(model=str(resolve_model(args.model)), device="cuda",
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_num_seqs=256,
                                   max_piecewise_tokens=args.max_piecewise_tokens,
                                   pdl=not args.no_pdl,
                                   **({"eager_blas_library": args.eager_blas}
                                      if args.eager_blas else {})))  # fmt: skip
    vocab = core.info.vocab_size
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    if not args.skip_ttft:
        res["ttft"] = ttft_by_length(core, vocab, (1, 16, 64, 256, 1000))
        print("ttft", json.dumps(res["ttft"]), flush=True)
    res["decode_ms"] = {f"{b}-{'eager' if e else 'graph'}": decode_step_ms(core, vocab, b, e)
                        for b in (1, 32) for e in (False, True)}  # fmt: skip
    print("decode", json.dumps(res["decode_ms"]), flush=True)
    res["host_breakdown"] = host_breakdown(core, vocab)
    for k, v in sorted(res["host_breakdown"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        print(f"host {k:45s} {v['calls']:6d} calls {v['us_per_call']:9.1f} us "
              f"{v['ms_per_step']:8.3f} ms/step", flush=True)
    if args.tables:
        short = prompts(3, 16, vocab, 60)
        print("== 16-token prefill, max_tokens 1\n" + kernel_table(
            core, lambda: [first_token(core, f"s{i}", p) for i, p in enumerate(short)]))
        longp = prompts(2, 4096, vocab, 61)

        def long_prefill():
            for i, p in enumerate(longp):
                core.add_request(f"l{i}", p, params(1))
            drain(core)

        print("== 2 x 4,096-token prefill (one step)\n" + kernel_table(core, long_prefill))
        for i, p in enumerate(prompts(128, 1024, vocab, 62)):
            core.add_request(f"b{i}", p, params(40))
        while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
            core.step()
        print("== 128 sequences decoding, 20 steps\n" + kernel_table(
            core, lambda: [core.step() for _ in range(20)]))
        drain(core)
    core.check_integrity()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
