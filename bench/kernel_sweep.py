"""Launch-configuration sweep of the paged-attention kernels at Llama-3.1-8B shapes
(docs/benchmarks.md, "GPU: engine on H100").

    python -m bench.kernel_sweep [--only extend,decode] [--variant old=/tmp/old_attention.py]
        [--json out.json]
    python -m bench.kernel_sweep --compile-only     # no GPU needed: sm_90 resource report

GPU mode times every candidate `TileConfig` of engine/kernels/paged_attention.py (and of each
`--variant`, another copy of that module, e.g. `git show REV:engine/kernels/paged_attention.py`)
on the shapes the engine figures run, bf16, heads 32 / KV heads 8 / head_dim 128, pages of 16
tokens dealt out in random order:

  extend  engine: 2 x 4,096 new tokens (one step of the prefill figure: 8,192-token budget);
          8x4096: the per-layer comparison of the 2026-11-22 record; prefix: 2 x 4,096 new
          tokens over 4,096 cached. Checked against torch SDPA on dense K/V (also timed).
  decode  b128: 128 sequences at context 1,024 (decode128); b1: one at 1,024 (decode1), over
          several split counts. Checked against a dense torch reference. Timed as CUDA-graph
          replays over enough layers' caches that L2 does not hold them, as the engine runs.

Each row: relative error ||out - ref|| / ||ref|| (bf16: ~3e-3), median time
(`triton.testing.do_bench`), TFLOP/s (extend, causal pairs only) or TB/s of KV read (decode),
and the compiled kernel's registers, spills, shared memory and programs per SM. The best
configuration of each shape is printed last.

--compile-only compiles the candidates for sm_90 with the installed Triton on any machine
(nothing runs) and prints registers, stack (spills), shared memory and programs per SM from the
cubin (cuobjdump from Triton's wheel): a free first look before a GPU run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import torch

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DEVICE, DTYPE = "cuda", torch.bfloat16
REGS_PER_SM, SMEM_PER_SM, MAX_WARPS_PER_SM = 65536, 228 * 1024, 64  # sm_90


def candidates(pa) -> dict[str, list]:
    """Extend and decode configurations to try (defaults first)."""
    T = pa.TileConfig
    extend = [pa.extend_config(HEAD_DIM, 4096)] + [
        T(block_m=bm, block_n=bn, num_warps=w, num_stages=s, maxnreg=r)
        for bm, bn, w, s, r in [
            (128, 64, 8, 2, None), (128, 32, 8, 3, None), (128, 128, 8, 2, None),
            (128, 128, 8, 3, None), (128, 64, 8, 3, 128), (128, 32, 8, 3, 128),
            (64, 64, 4, 2, None), (64, 64, 4, 3, None), (64, 32, 4, 3, None),
            (64, 32, 8, 3, None), (64, 64, 8, 3, 128), (64, 128, 8, 3, None),
        ]
    ]  # fmt: skip
    decode = [pa.decode_config(HEAD_DIM)] + [
        T(block_n=bn, num_warps=w, num_stages=s)
        for bn in (16, 32, 64, 128) for w in (2, 4, 8) for s in (2, 3)
        if (bn, w, s) not in {(64, 4, 3), (128, 2, 3), (16, 8, 2), (16, 8, 3)}
    ]  # fmt: skip
    return {"extend": extend, "decode": decode}


def load_variant(name: str, path: str):
    """Import another copy of the kernel module under its own name."""
    spec = importlib.util.spec_from_file_location(f"_sweep_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def programs_per_sm(regs: int, smem: int, num_warps: int) -> int:
    by_regs = REGS_PER_SM // (max(-(-regs // 8) * 8, 1) * 32 * num_warps)
    by_smem = SMEM_PER_SM // (smem + 1024)  # the driver reserves 1 KiB per program
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // num_warps)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


# ---- GPU cases -------------------------------------------------------------------------------


class PagedKV:
    """`layers` layers of one paged KV pool holding sequences of the given lengths."""

    def __init__(self, kv_lens: list[int], layers: int, gen: torch.Generator):
        pages = [-(-n // PAGE_SIZE) for n in kv_lens]
        order = torch.randperm(sum(pages), generator=gen, device=DEVICE).to(torch.int32)
        self.page_table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32, device=DEVICE)
        first = 0
        for s, n in enumerate(pages):
            self.page_table[s, :n] = order[first : first + n]
            first += n
        shape = (layers, 2, sum(pages), PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.kv = torch.randn(shape, generator=gen, device=DEVICE, dtype=DTYPE)
        self.kv_lens_list = kv_lens
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)

    def dense(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence: [kv_heads, kv_len, head_dim] each."""
        n = self.kv_lens_list[seq]
        rows = self.page_table[seq, : -(-n // PAGE_SIZE)].long()
        k, v = (self.kv[layer, i][rows].flatten(0, 1)[:n].transpose(0, 1) for i in (0, 1))
        return k, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """Causal attention of q [heads, n, D] at positions ctx.. over k/v [kv_heads, ctx + n, D]
    (torch SDPA, GQA)."""
    n = q.shape[1]
    q, k, v = q[None], k[None], v[None]  # the fused SDPA kernels want a batch dimension
    if ctx == 0:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)  # fmt: skip
    else:
        pos = ctx + torch.arange(n, device=DEVICE)
        keep = torch.arange(ctx + n, device=DEVICE) <= pos[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                               enable_gqa=True)  # fmt: skip
    return out[0]


def graph_ms(fn, reps: int) -> float:
    """Median ms of one call of fn, timed as replays of a CUDA graph of `reps` calls."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / reps


class KernelStats:
    """Registers, spills and shared memory of the kernel each config compiled to, read from
    the JIT's cache (the wrappers do not return the kernel): the entries that appeared since
    the last call belong to the config just launched."""

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.seen: set = set()
        self.by_key: dict = {}

    def get(self, key) -> dict:
        cache = self.jit_fn.device_caches[torch.cuda.current_device()][0]
        fresh = [kernel for k, kernel in cache.items() if k not in self.seen]
        self.seen.update(cache)
        if fresh and key not in self.by_key:
            k = fresh[-1]
            warps, smem = k.metadata.num_warps, k.metadata.shared
            self.by_key[key] = {"regs": k.n_regs, "spills": k.n_spills, "smem_kb": smem // 1024,
                                "per_sm": programs_per_sm(k.n_regs, smem, warps)}  # fmt: skip
        return self.by_key.get(key, {})


EXTEND_SHAPES = {"engine": [(0, 4096)] * 2, "8x4096": [(0, 4096)] * 8,
                 "prefix": [(4096, 4096)] * 2, "long": [(0, 16384)],
                 "chunk": [(14336, 2048)]}  # (cached, new) per sequence  # fmt: skip


def sweep_extend(pa, variant: str, rows: list[dict]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    stats = KernelStats(pa._extend_kernel)
    for shape, specs in EXTEND_SHAPES.items():
        _extend_shape(pa, variant, shape, specs, gen, stats, rows)
        torch.cuda.empty_cache()


def _extend_shape(pa, variant, shape, specs, gen, stats, rows) -> None:
    from triton.runtime.errors import OutOfResources

    kv = PagedKV([c + n for c, n in specs], 1, gen)
    q = torch.randn(sum(n for _, n in specs), HEADS, HEAD_DIM, generator=gen, device=DEVICE,
                    dtype=DTYPE)  # fmt: skip
    cu = torch.tensor([0] + [n for _, n in specs], device=DEVICE).cumsum(0).to(torch.int32)
    ref, row = torch.empty_like(q), 0
    for s, (ctx, n) in enumerate(specs):
        k, v = kv.dense(0, s)
        ref[row : row + n] = sdpa(q[row : row + n].transpose(0, 1), k, v, ctx).transpose(0, 1)
        row += n
    # the new tokens' K/V, contiguous [tokens, kv_heads, head_dim] (variants that read them)
    new_kv = [torch.cat([kv.dense(0, s)[i][:, c:].transpose(0, 1) for s, (c, _) in
                         enumerate(specs)]).contiguous() for i in (0, 1)]  # fmt: skip
    flops = sum(4 * HEADS * HEAD_DIM * (n * c + n * (n + 1) // 2) for c, n in specs)
    if variant == "main" and specs[0][0] == 0:
        rows.extend(_sdpa_rows(shape, specs, q, kv, flops))
    out = torch.empty_like(q)
    max_q_len = max(n for _, n in specs)
    for index, config in enumerate(candidates(pa)["extend"]):
        run = functools.partial(_run_extend, pa, q, kv, cu, max_q_len, out, config,
                                new_kv=new_kv)
        out.fill_(float("nan"))
        try:
            run()
            torch.cuda.synchronize()
        except OutOfResources as e:
            rows.append({"kernel": "extend", "shape": shape, "variant": variant,
                         "config": asdict(config), "error": str(e)[:200]})  # fmt: skip
            _print_row(rows[-1])
            continue
        resources = stats.get(config)
        err = rel_err(out, ref)
        ms = graph_ms(run, 1)
        rows.append({"kernel": "extend", "shape": shape, "variant": variant,
                     "config": asdict(config), "default": variant == "main" and index == 0,
                     "rel_err": err, "us": ms * 1e3, "tflops": flops / ms / 1e9,
                     **resources})  # fmt: skip
        _print_row(rows[-1])


def _run_extend(pa, q, kv, cu, max_q_len, out, config, _=0, new_kv=None) -> None:
    extra = {}
    if "k_new" in inspect.signature(pa.paged_extend_attention).parameters:
        extra = {"k_new": new_kv[0], "v_new": new_kv[1]}
    pa.paged_extend_attention(q, kv.kv[0, 0], kv.kv[0, 1], kv.page_table, cu, kv.kv_lens,
                              max_q_len, HEAD_DIM**-0.5, out, config=config, **extra)  # fmt: skip


def _sdpa_rows(shape: str, specs, q, kv: PagedKV, flops: int) -> list[dict]:
    """torch SDPA, causal, over contiguous K/V of the same shape: with GQA, and with K/V
    repeated to every head (MHA, as the 2026-11-22 comparison ran it)."""
    b, n = len(specs), specs[0][1]
    qd = q.view(b, n, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    k, v = (torch.stack([kv.dense(0, s)[i] for s in range(b)]).contiguous() for i in (0, 1))
    rows = []
    group = HEADS // KV_HEADS
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mha = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    cases = [("sdpa-gqa", k, v, None), ("sdpa-mha", *mha, None),
             ("flash-gqa", k, v, SDPBackend.FLASH_ATTENTION),
             ("cudnn-mha", *mha, SDPBackend.CUDNN_ATTENTION),
             ("cudnn-gqa", k, v, SDPBackend.CUDNN_ATTENTION)]
    for name, kk, vv, backend in cases:
        run = functools.partial(torch.nn.functional.scaled_dot_product_attention, qd, kk, vv,
                                is_causal=True, enable_gqa=True)  # fmt: skip
        try:
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                ms = graph_ms(lambda _=0, run=run: run(), 1)
        except RuntimeError as e:
            print(f"{name}: {str(e)[:160]}", flush=True)
            continue
        rows.append({"kernel": "extend", "shape": shape, "variant": name, "config": None,
                     "rel_err": 0.0, "us": ms * 1e3, "tflops": flops / ms / 1e9})  # fmt: skip
        _print_row(rows[-1])
    return rows


DECODE_SHAPES = [("b128", 128, (1, 2, 4)), ("b1", 1, (8, 17, 32))]  # batch, split counts
CONTEXT = 1024  # decode: keys per sequence


def sweep_decode(pa, variant: str, rows: list[dict]) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    stats = KernelStats(pa._decode_split_kernel)
    for shape, batch, splits_list in DECODE_SHAPES:
        _decode_shape(pa, variant, shape, batch, splits_list, gen, stats, rows)
        torch.cuda.empty_cache()


def _decode_shape(pa, variant, shape, batch, splits_list, gen, stats, rows) -> None:
    # what the engine's graphs use: capacity = max_model_len (131,072) of Llama-3.1-8B
    engine_splits = pa.choose_num_splits(batch, 131072, KV_HEADS)
    kv_bytes = batch * CONTEXT * 2 * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    layers = max(1, min(32, -(-(256 << 20) // kv_bytes)))  # > L2 in all
    kv = PagedKV([CONTEXT] * batch, layers, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    ref = torch.empty_like(q)
    for s in range(batch):
        k, v = kv.dense(0, s)
        ref[s] = sdpa(q[s, :, None], k, v, CONTEXT - 1)[:, 0]
    out = torch.empty_like(q)
    for index, config in enumerate(candidates(pa)["decode"]):
        for splits in splits_list:
            ws = pa.decode_workspace(batch, HEADS, HEAD_DIM, splits, DEVICE)
            run = functools.partial(_run_decode, pa, q, kv, layers, out, ws, splits, config)
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            resources = stats.get((config, splits == 1))
            err = rel_err(out, ref)
            ms = graph_ms(run, layers)
            default = variant == "main" and index == 0 and splits == engine_splits
            rows.append({"kernel": "decode", "shape": shape, "variant": variant,
                         "config": asdict(config), "default": default, "splits": splits,
                         "rel_err": err, "us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9,
                         **resources})  # fmt: skip
            _print_row(rows[-1])


def _run_decode(pa, q, kv, layers, out, ws, splits, config, i=0) -> None:
    layer = i % layers
    pa.paged_decode_attention(q, kv.kv[layer, 0], kv.kv[layer, 1], kv.page_table, kv.kv_lens,
                              HEAD_DIM**-0.5, out, ws, splits, config=config)  # fmt: skip


def _print_row(r: dict) -> None:
    c = r.get("config") or {}
    cfg = (f"m{c.get('block_m', 0):<3} n{c['block_n']:<3} w{c['num_warps']} s{c['num_stages']}"
           f" r{c['maxnreg'] or '-':<3}") if c else "-"  # fmt: skip
    if "error" in r:
        print(f"{r['kernel']:6} {r['shape']:7} {r['variant']:10} {cfg}  ERROR {r['error']}")
        return
    rate = f"{r['tflops']:6.1f} TFLOP/s" if "tflops" in r else f"{r['tb_s']:5.2f} TB/s"
    res = (f"regs {r['regs']:3} spill {r['spills']:4} smem {r['smem_kb']:3}K x{r['per_sm']}"
           if "regs" in r else "")  # fmt: skip
    split = f"splits {r['splits']:2} " if "splits" in r else ""
    print(f"{r['kernel']:6} {r['shape']:7} {r['variant']:10} {cfg:28} {split}"
          f"err {r['rel_err']:.1e} {r['us']:9.1f} us {rate}  {res}", flush=True)


def summary(rows: list[dict]) -> None:
    print("\nbest per shape (rel_err < 1e-2):")
    for kernel, shape in dict.fromkeys((r["kernel"], r["shape"]) for r in rows):
        same = [r for r in rows if (r["kernel"], r["shape"]) == (kernel, shape)]
        for r in same:
            if not r["config"]:  # torch SDPA
                print("  torch:   ", end="")
                _print_row(r)
        for r in same:
            if r.get("default"):
                print("  default: ", end="")
                _print_row(r)
        ok = [r for r in same if r["config"] and r.get("rel_err", math.inf) < 1e-2]
        if ok:
            print("  best:    ", end="")
            _print_row(min(ok, key=lambda r: r["us"]))


# ---- compile-only (any machine) --------------------------------------------------------------


def compile_report(pa) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = triton.knobs.nvidia.cuobjdump.path
    target = GPUTarget("cuda", 90, 32)
    ptr_types = {"table_ptr": "*i32", "cu_seqlens_ptr": "*i32", "kv_lens_ptr": "*i32",
                 "ws_ptr": "*fp32"}  # fmt: skip
    common = {"HEAD_DIM": HEAD_DIM, "PAGE_SIZE": PAGE_SIZE, "DOT_PRECISION": "tf32", "GROUP": 4}
    jobs = [(pa._extend_kernel, c, {**common, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n})
            for c in candidates(pa)["extend"]]  # fmt: skip
    jobs += [(pa._decode_split_kernel, c, {**common, "GROUP_PAD": 16, "BLOCK_N": c.block_n,
                                           "DIRECT_OUT": True})
             for c in candidates(pa)["decode"]]  # fmt: skip
    rows = []
    for fn, config, consts in jobs:
        # The JIT marks 16-byte aligned pointers and ints divisible by 16 (every stride at
        # these shapes; not num_splits) with tt.divisibility=16: without that hint the loads
        # are not vectorized and the gather is not pipelined.
        signature, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = ptr_types.get(name, "*bf16")
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name == "qk_scale":
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
                if name != "num_splits":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                        attrs)  # fmt: skip
        kernel = triton.compile(src, target=target, options=config.launch_options())
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout  # fmt: skip
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        smem = kernel.metadata.shared
        row = {"kernel": fn.__name__, "config": asdict(config), "regs": regs, "stack": stack,
               "smem_kb": smem // 1024,
               "per_sm": programs_per_sm(regs, smem, config.num_warps)}  # fmt: skip
        rows.append(row)
        c = row["config"]
        print(f"{fn.__name__:21} m{c['block_m']:<3} n{c['block_n']:<3} w{c['num_warps']} "
              f"s{c['num_stages']} r{c['maxnreg'] or '-':<3}  regs {regs:3} stack {stack:4} "
              f"smem {smem // 1024:3}K  programs/SM {row['per_sm']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="extend,decode")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=PATH: also sweep another copy of paged_attention.py")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import engine.kernels.paged_attention as main_module

    variants = {"main": main_module}
    for item in args.variant:
        name, path = item.split("=", 1)
        variants[name] = load_variant(name, path)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    if args.compile_only:
        import triton

        results["triton"] = triton.__version__
        results["rows"] = {name: compile_report(pa) for name, pa in variants.items()}
    else:
        results["device"] = torch.cuda.get_device_name()
        rows: list[dict] = []
        for name, pa in variants.items():
            if "extend" in args.only:
                sweep_extend(pa, name, rows)
            if "decode" in args.only:
                sweep_decode(pa, name, rows)
        results["rows"] = rows
        summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
