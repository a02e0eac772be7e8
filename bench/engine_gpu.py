"""Engine-level GPU figures (issue 5's table), driving EngineCore in-process.

    python -m bench.engine_gpu --model random:llama-3.1-8b [--only decode1,prefill,decode128]
        [--json out.json]

Figures (each on a fresh engine state, prompts of random token ids, ignore_eos):
  decode1    batch 1, context 1,024: median wall time per decode step (the TPOT a user sees,
             scheduling and sampling included)
  prefill    8 prompts x 4,096 tokens: prompt tokens / wall time of the prefill steps
  decode128  128 sequences at context ~1,024: output tokens/s over decode-only steps, and the
             host overhead of a step: wall time minus the GPU's busy span, over wall time
  offline    1,000 requests, inputs 128-2,048, outputs 128-1,024: total and output tokens/s
  hf         Hugging Face transformers eager `generate`, batch 1, context 1,024 (baseline)
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
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
    while core.seqs["d1"].num_computed_tokens < 1030:  # prefill done, decoding steadily
        core.step()
    ms, n = steady_step_ms(core, 200, lambda: "d1" in core.seqs)
    drain(core)
    return {"tpot_ms": ms, "steps": n}


def prefill(core: EngineCore, vocab: int) -> dict:
    for i, p in enumerate(prompts(8, 4096, vocab, 2)):
        core.add_request(f"p{i}", p, params(1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    drain(core)
    wall = time.perf_counter() - t
    return {"tokens_per_s": 8 * 4096 / wall, "wall_s": wall}


def decode128(core: EngineCore, vocab: int) -> dict:
    for i, p in enumerate(prompts(128, 1024, vocab, 3)):
        core.add_request(f"b{i}", p, params(129))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in core.seqs.values()):
        core.step()
    ms, n = steady_step_ms(core, 100, lambda: len(core.seqs) == 128)
    drain(core)
    return {"output_tokens_per_s": 128 / ms * 1e3, "step_ms": ms, "steps": n}


def host_overhead(core: EngineCore, vocab: int, batch: int = 128) -> dict:
    """Share of a decode step (`batch` sequences at context 1,024) the GPU sits idle, from the
    profiler's kernel times, with the kernels that take the time."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(prompts(batch, 1024, vocab, 4)):
        core.add_request(f"h{i}", p, params(40))
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in core.seqs.values()):
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


def offline(core: EngineCore, vocab: int, n: int = 1000) -> dict:
    rng = random.Random(5)
    n_out = [rng.randint(128, 1024) for _ in range(n)]
    ps = prompts(n, (128, 2048), vocab, 6)
    for i, (p, o) in enumerate(zip(ps, n_out)):
        core.add_request(f"o{i}", p, params(o))
    before = core.stats()["preemptions"]
    steps = decode_only = 0
    t = time.perf_counter()
    while core.has_work():
        running = core.scheduler.running
        decode_only += all(s.num_tokens - s.num_computed_tokens <= 1 for s in running) and not (
            core.scheduler.waiting and len(running) < core.config.max_num_seqs)
        core.step()
        steps += 1
    wall = time.perf_counter() - t
    total_in, total_out = sum(map(len, ps)), sum(n_out)
    return {"requests": n, "wall_s": wall, "output_tokens_per_s": total_out / wall,
            "total_tokens_per_s": (total_in + total_out) / wall, "steps": steps,
            "mean_step_ms": wall / steps * 1e3, "decode_only_steps": decode_only,
            "preemptions": core.stats()["preemptions"] - before}


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
           "overhead": host_overhead, "offline": offline,
           "overhead1": lambda core, vocab: host_overhead(core, vocab, batch=1),
           "offline300": lambda core, vocab: offline(core, vocab, n=300)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--only", default="decode1,prefill,decode128,overhead")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-gemv", action="store_true",
                    help="batch-1 projections through cuBLAS, not the Triton GEMV")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch the GEMV without programmatic dependent launch")
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default=None,
                    help="torch's GEMM library (default: the engine's, cublaslt)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.blas:
        import engine.model_runner

        engine.model_runner.BLAS_LIBRARY = args.blas
    model_dir = str(resolve_model(args.model))
    wanted = args.only.split(",")
    results = {"model": args.model, "device": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}  # fmt: skip
    if args.no_pdl:
        import engine.kernels.pdl

        engine.kernels.pdl.ENABLED = False
    results["blas"] = args.blas or "cublaslt"
    results["gemv"] = "off" if args.no_gemv else "no-pdl" if args.no_pdl else "pdl"
    t = time.perf_counter()
    core = EngineCore(EngineConfig(
        model=model_dir, device="cuda", max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
        decode_gemv=not args.no_gemv,
    ))  # fmt: skip
    results["startup_s"] = time.perf_counter() - t
    results["kv_capacity_tokens"] = core.info.kv_capacity_tokens
    vocab = core.info.vocab_size
    print(json.dumps(results), flush=True)
    for name in wanted:
        if name == "hf":
            continue
        results[name] = FIGURES[name](core, vocab)
        core.check_integrity()
        print(name, json.dumps(results[name]), flush=True)
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
