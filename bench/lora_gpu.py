"""LoRA adapters against the base model on one engine (issue 41's targets), driving EngineCore
in-process on a GPU.

    python -m bench.lora_gpu --model random:llama-3.1-8b [--adapters 8] [--rank 16]
        [--max-loras 8] [--skew 0] [--only decode1,throughput,load] [--json out.json]

Two engines side by side on the GPU, each with a KV pool of --num-pages (default 6,144 pages
of 16 tokens: 12 GiB for Llama-3.1-8B; sizing it from free memory would count the other
engine's): the base model, and the same weights with --adapters random rank-16 PEFT adapters
written to a temporary directory. Figures, each printed as a JSON line:
  decode1     batch 1, context 1,024: median wall time per decode step, the base model on the
              base engine, and one adapter on the LoRA engine (target: <= 1.1x)
  throughput  --requests requests (input 512, output 128) sent at once, each naming an
              adapter (uniform, or Zipf with exponent --skew); output tokens/s and total
              tokens/s against the same requests on the base engine (target: >= 0.85x with 8
              uniform adapters, >= 0.75x with 32 skewed)
  load        loading one more rank-16 adapter from local disk through the call while a base
              request decodes: load_ms (read, check, pack in the loader thread, then
              registering; target: <= 50 ms), the decode steps' median before and longest
              during the load (serving must not pause), and the longest while the loader
              then pins the next spare slab; slot_write_ms_mean (host time of a slot write:
              asynchronous copies)
The first line also gives the start-up adapters' mean load and slot-write times.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.engine_gpu import drain, prompts, steady_step_ms
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.frames import invoke
from engine.lora import kernels as lora_kernels
from engine.lora.adapter import module_shapes
from microserve.heap import freeze_startup_heap
from microserve.messages import CALLS, LoadLoraRequest, SamplingParams
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(path: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A PEFT-format adapter over every projection, N(0, 0.02) A and B, in bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (d_in, d_out) in module_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
            for half, shape in (("A", (rank, d_in)), ("B", (d_out, rank))):
                tensors[f"{key}.lora_{half}.weight"] = (
                    torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(_PARENT), "bias": "none"}))


def greedy(max_tokens: int, lora_name: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          lora_name=lora_name)


def decode1(core: EngineCore, vocab: int, lora_name: str | None, profile: bool = False
            ) -> float:
    core.add_request("d1", prompts(1, 1024, vocab, 1)[0], greedy(300, lora_name))
    while core.requests.get("d1").seq.num_computed_tokens < 1030:
        core.step()
    ms, _ = steady_step_ms(core, 200, lambda: "d1" in core.requests)
    if profile:
        print(f"kernels per step, {lora_name or 'base'}:", flush=True)
        print(kernel_table(core, 20), flush=True)
    drain(core)
    return ms


def kernel_table(core: EngineCore, steps: int) -> str:
    """The GPU kernels of `steps` steps (CUDA graph replays included), per step: name, count,
    total microseconds, by total time."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return "(no GPU: no kernels to list)"
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        _sync()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:70]
            n, us = rows.get(name, (0, 0.0))
            rows[name] = (n + 1, us + e.device_time)
    lines = [f"{'kernel':70} {'n/step':>7} {'us/step':>9}"]
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:20]:
        lines.append(f"{name:70} {n / steps:7.1f} {us / steps:9.1f}")
    total = sum(us for _, us in rows.values()) / steps
    lines.append(f"{'all':70} {'':7} {total:9.1f}")
    return "\n".join(lines)


def throughput(core: EngineCore, vocab: int, names: list[str | None], seed: int = 7) -> dict:
    """Every request at once (request i names names[i]); tokens/s until the last finishes.
    Prompts of `seed`: a warm-up must use another, or the run reuses its cached KV."""
    for i, (p, name) in enumerate(zip(prompts(len(names), 512, vocab, seed), names)):
        core.add_request(f"t{i}", p, greedy(128, name))
    _sync()
    start = time.perf_counter()
    drain(core)
    wall = time.perf_counter() - start
    return {"output_tokens_per_s": 128 * len(names) / wall,
            "tokens_per_s": (512 + 128) * len(names) / wall, "wall_s": wall}


def load_while_serving(core: EngineCore, vocab: int) -> dict:
    """Load adapter "extra" through the call while a base request decodes: the load's time
    (checking its config and file header, then reading its data into a pinned slab, in the
    loader thread; then registering), the wall time until the
    call's answer, and the decode steps' times before and during the load (the step loop
    must not pause)."""
    # long enough to outlast the steps below and the load (~100 ms), within any KV pool here
    core.add_request("bg", prompts(1, 256, vocab, 3)[0],
                     greedy(min(8192, core.max_model_len - 256)))
    for _ in range(20):
        core.step()

    def timed_step() -> float:
        _sync()
        start = time.perf_counter()
        core.step()
        _sync()
        return (time.perf_counter() - start) * 1e3

    before = sorted(timed_step() for _ in range(50))
    start = time.perf_counter()
    frames, during = core.handle(invoke(1, LoadLoraRequest("extra", "extra"))), []
    while not frames:
        during.append(timed_step())
        frames = core.tick(time.monotonic()).frames
    wall = time.perf_counter() - start
    answer = CALLS["load_lora_adapter"].decode_answer(frames[0].result)
    # the loader thread then pins the next spare slab: the steps meanwhile
    pinning, started = [], time.perf_counter()
    while core.adapters._slabs.free < 1 and time.perf_counter() - started < 30:
        pinning.append(timed_step())
    core.abort_request("bg")
    # the loader thread's two parts again, alone (no step loop beside them): checking the
    # adapter, reading its data into a spare slab (pinned on CUDA) as the slots hold it
    path = Path(core.adapters.registry.lookup("extra").path)
    core.adapters._loader.submit(lambda: None).result()  # the next spare slab is pinned
    _, _, slab, check_s, read_s = core.adapters._read("extra", path)
    core.adapters._slabs.give(slab, None)
    stats = core.stats()
    return {"load_ms": answer.load_s * 1e3, "call_wall_ms": wall * 1e3,
            "resident": answer.resident, "steps_during_load": len(during),
            "alone_check_ms": check_s * 1e3, "alone_read_into_slab_ms": read_s * 1e3,
            "step_ms_median_before": before[len(before) // 2],
            "step_ms_max_during": max(during, default=0.0),
            "steps_while_pinning_spare": len(pinning),
            "step_ms_max_while_pinning_spare": max(pinning, default=0.0),
            "slot_write_ms_mean": 1e3 * stats.lora_slot_write_seconds
            / max(1, stats.lora_slot_writes)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def popularity(n_requests: int, adapters: list[str], skew: float, seed: int = 0) -> list[str]:
    """Which adapter each request names: uniform (skew 0, round robin) or Zipf(skew)."""
    if skew == 0:
        return [adapters[i % len(adapters)] for i in range(n_requests)]
    weights = [1 / (k + 1) ** skew for k in range(len(adapters))]
    return random.Random(seed).choices(adapters, weights, k=n_requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None, help="default: --adapters")
    ap.add_argument("--skew", type=float, default=0.0, help="Zipf exponent; 0: uniform")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--num-pages", type=int, default=6144)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--only", default="decode1,throughput,load")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this module")
    ap.add_argument("--profile", action="store_true",
                    help="decode1: print each engine's kernels per step (torch.profiler)")
    ap.add_argument("--expand-col-blocks", type=int, default=None,
                    help="the most output column blocks one segmented expand program covers "
                    "(engine.lora.kernels.MAX_COL_BLOCKS; 1: one each, as before 2026-11-28)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.expand_col_blocks is not None:
        lora_kernels.MAX_COL_BLOCKS = args.expand_col_blocks
    model_dir = str(resolve_model(args.model))
    config = ModelConfig.from_dir(model_dir)
    wanted = args.only.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_random_adapter(tmp / name, config, args.rank, seed=i)
    common = dict(model=model_dir, device=args.device, enforce_eager=args.enforce_eager,
                  num_pages=args.num_pages)
    base = EngineCore(EngineConfig(**common))
    lora = EngineCore(EngineConfig(**common, lora_modules=tuple((n, str(tmp / n)) for n in names),
                                   max_loras=args.max_loras or args.adapters,
                                   max_lora_rank=args.rank, lora_dir=str(tmp)))
    vocab = base.info.vocab_size
    device = args.device if args.device == "cpu" else torch.cuda.get_device_name()
    # as a served engine's process does once started (engine/core_proc.py): full garbage
    # collections then skip what start-up left, which otherwise lands in the timed parts
    freeze_startup_heap()
    started = lora.stats()  # the --lora-modules adapters, registered at start-up
    results = {"model": args.model, "device": device,
               "adapters": args.adapters, "rank": args.rank, "skew": args.skew,
               "max_loras": lora.config.max_loras,
               "expand_max_col_blocks": lora_kernels.MAX_COL_BLOCKS,
               "startup_load_ms_mean": 1e3 * started.lora_load_seconds
               / max(1, started.lora_loads),
               "startup_slot_write_ms_mean": 1e3 * started.lora_slot_write_seconds
               / max(1, started.lora_slot_writes)}
    print(json.dumps(results), flush=True)
    if "decode1" in wanted:
        b = decode1(base, vocab, None, args.profile)
        a = decode1(lora, vocab, names[0], args.profile)
        results["decode1"] = {"base_tpot_ms": b, "lora_tpot_ms": a, "ratio": a / b}
        print("decode1", json.dumps(results["decode1"]), flush=True)
    if "throughput" in wanted:
        throughput(base, vocab, [None] * 32, seed=8)  # warm both up on this shape
        throughput(lora, vocab, names[:1] * 32, seed=8)
        b = throughput(base, vocab, [None] * args.requests)
        a = throughput(lora, vocab, popularity(args.requests, names, args.skew))
        results["throughput"] = {"base": b, "lora": a,
                                 "ratio": a["tokens_per_s"] / b["tokens_per_s"]}
        print("throughput", json.dumps(results["throughput"]), flush=True)
    if "load" in wanted:
        write_random_adapter(tmp / "extra", config, args.rank, seed=1000)
        results["load"] = load_while_serving(lora, vocab)
        print("load", json.dumps(results["load"]), flush=True)
    for core in (base, lora):
        core.check_integrity()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
