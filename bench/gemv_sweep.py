"""Batch-1 decode GEMMs (M = 1) of Llama-3.1-8B: cuBLAS paths against a Triton GEMV
(docs/benchmarks.md, "GPU: engine on H100").

    python -m bench.gemv_sweep [--json out.json]

At batch 1 every projection is a matrix-vector product that reads its whole weight once: the
step is bound by memory (on 2026-11-22 cuBLAS read the 16 GB of weights in ~5.6 of the 6.2 ms
per token, its split-K kernel for the down projection the slowest at ~2.1 TB/s). For each
projection this times, as
CUDA-graph replays over enough weight copies that L2 holds none of them:

  linear         x @ W^T through torch.mm, as F.linear runs it (torch's default BLAS choice,
                 as the engine runs today)
  linear-cublas  the same under torch.backends.cuda.preferred_blas_library("cublas")
  linear-lt      the same under "cublaslt"
  mv             torch.mv(W, x)
  triton         `gemv` below over a grid of tile shapes and K splits

and prints TB/s of weight read, the relative error against an fp32 product, and per
projection the fastest path; last, what a decode step's 32 layers + LM head would take with
the fastest exact path of each projection against F.linear.

    python -m bench.gemv_sweep --engine [--only gate_up,down]

times instead the engine's own kernel (`engine/kernels/gemv.py`) in the variant the decode
layer runs for each projection (qkv and gate_up with the RMSNorm folded in, down gated, the LM
head writing fp32, with PDL) over a wider grid of tiles (`ENGINE_TILES`, up to whole rows per
load), against its default `gemv_config`.

    python -m bench.gemv_sweep --few-rows 2,4,8,16 [--only gate_up,down]

times the engine's few-rows kernel (`engine/kernels/few_rows.py`, decode steps of 2-16 rows)
over FEW_ROWS_TILES and K splits of 1, 2 and 4, against F.linear at the same rows (cuBLASLt,
as the engine's graphs run it), the LM head writing fp32.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from bench.kernel_sweep import graph_ms, rel_err

# (name, out features N, in features K, times per decode step)
PROJECTIONS = [
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
]
# (BLOCK_N rows, BLOCK_K columns, warps, stages) per program
TILES = [(4, 512, 4, 1), (4, 1024, 4, 1), (4, 1024, 8, 1), (8, 512, 4, 1), (8, 512, 8, 1),
         (8, 1024, 8, 1), (16, 256, 4, 1), (16, 512, 4, 1), (16, 512, 8, 1), (32, 256, 8, 1),
         (32, 128, 4, 1), (2, 1024, 4, 1), (4, 1024, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3)]
DEVICE = "cuda"
# The --engine grid: (BLOCK_N, BLOCK_K) with 2K-16K weights per tile, 4/8/16 warps keeping the
# fp32 accumulator at <= 64 values a thread, 1 or 2 stages.
ENGINE_TILES = [(bn, bk, w, s) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048, 4096)
                for w in (4, 8, 16) for s in (1, 2)
                if 2048 <= bn * bk <= 16384 and bn * bk // (32 * w) <= 64
                and (w < 16 or bn * bk >= 8192)]  # fmt: skip


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, k_per_split, stride_wn, stride_os,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """out[split, n] = sum over this split's K range of w[n, k] * x[k] (fp32 accumulate).

    Grid (N / BLOCK_N, splits). Each program streams BLOCK_N rows of W, BLOCK_K columns at a
    time, into a [BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the end.
    """
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * k_per_split
    cols = k0 + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + cols[None, :]
    x_ptrs = x_ptr + cols
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        w = tl.load(w_ptrs, eviction_policy="evict_first")  # read once: keep L2 for x
        x = tl.load(x_ptrs)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, 1)
    tl.store(out_ptr + tl.program_id(1) * stride_os + rows, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, n, num_splits, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS)
    mask = (splits[:, None] < num_splits) & (offs[None, :] < n)
    part = tl.load(part_ptr + splits[:, None] * n + offs[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs, tl.sum(part, 0).to(out_ptr.dtype.element_ty), mask=offs < n)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int,
         num_warps: int, num_stages: int = 1, splits: int = 1,
         partials: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """out [1, N] = x [1, K] @ w[N, K]^T. N % block_n == 0 and K % (splits * block_k) == 0;
    with splits > 1, `partials` is an fp32 [splits, N] buffer (summed by a second kernel)."""
    n, k = w.shape
    if n % block_n or k % (splits * block_k):
        raise ValueError(f"N={n} must divide by block_n={block_n} and K={k} by "
                         f"splits*block_k={splits * block_k}")  # fmt: skip
    target = out if splits == 1 else partials
    _gemv_kernel[(n // block_n, splits)](
        x, w, target, k // splits, w.stride(0), target.stride(0) if splits > 1 else 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](
            partials, out, n, splits, SPLITS=triton.next_power_of_2(splits), BLOCK=1024,
            num_warps=4,
        )  # fmt: skip
    return out


def _linear(x, weights, out, i=0):
    torch.mm(x, weights[i % len(weights)].t(), out=out)  # what F.linear runs for 2-D x


def _mv(x, weights, out, i=0):
    torch.mv(weights[i % len(weights)], x[0], out=out[0])


def _triton(x, weights, out, tile, splits, partials, i=0):
    gemv(x, weights[i % len(weights)], out, *tile, splits=splits, partials=partials)


def sweep_projection(name: str, n: int, k: int, rows: list[dict], m: int = 1) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    nbytes = n * k * 2
    copies = max(2, min(16, math.ceil((512 << 20) / nbytes)))  # together well past L2
    weights = [torch.randn(n, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]  # fmt: skip
    x = torch.randn(m, k, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    ref = (x.double() @ weights[0].double().t()).float()
    out = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16)
    partials = torch.empty(4, n, device=DEVICE, dtype=torch.float32)
    paths = [("linear", None, 1, functools.partial(_linear, x, weights, out), None),
             ("linear-cublas", None, 1, functools.partial(_linear, x, weights, out), "cublas"),
             ("linear-lt", None, 1, functools.partial(_linear, x, weights, out), "cublaslt"),
             ("mv", None, 1, functools.partial(_mv, x, weights, out), None)]  # fmt: skip
    if m > 1:  # the GEMV paths are for one row
        del paths[-1]
    for tile in TILES if m == 1 else []:
        for splits in (1, 2, 4) if n <= 6144 else (1,):
            if n % tile[0] == 0 and k % (splits * tile[1]) == 0:
                run = functools.partial(_triton, x, weights, out, tile, splits,
                                        partials[:splits])  # fmt: skip
                paths.append(("triton", tile, splits, run, None))
    for method, tile, splits, run, blas in paths:
        before = torch.backends.cuda.preferred_blas_library()
        if blas:
            torch.backends.cuda.preferred_blas_library(blas)
        try:
            out.fill_(float("nan"))
            run()
            err = rel_err(out, ref)
            ms = graph_ms(run, copies)
        finally:
            torch.backends.cuda.preferred_blas_library(before)
        rows.append({"projection": name, "n": n, "k": k, "method": method, "tile": tile,
                     "splits": splits, "rel_err": err, "us": ms * 1e3,
                     "tb_s": nbytes / ms / 1e9})  # fmt: skip
        _print_row(rows[-1])


def sweep_engine_kernel(name: str, n: int, k: int, rows: list[dict]) -> None:
    """The engine's GEMV as the decode layer calls it for `name`, per tile of ENGINE_TILES."""
    from engine.kernels.gemv import GemvConfig, gemv_config, rms_norm_gemv
    from engine.kernels.gemv import gemv as engine_gemv

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    nbytes = n * k * 2
    copies = max(2, min(16, math.ceil((512 << 20) / nbytes)))
    weights = [torch.randn(n, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]  # fmt: skip
    x = torch.randn(1, 2 * k if name == "down" else k, generator=gen, device=DEVICE,
                    dtype=torch.bfloat16)  # fmt: skip
    residual = torch.randn(1, k, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    norm_w = torch.rand(k, generator=gen, device=DEVICE, dtype=torch.bfloat16) + 0.5
    out = torch.empty(1, n, device=DEVICE,
                      dtype=torch.float32 if name == "lm_head" else torch.bfloat16)

    def call(config, i=0):
        w = weights[i % len(weights)]
        if name in ("qkv", "gate_up"):
            return rms_norm_gemv(x, residual, norm_w, 1e-5, w, config)[0]
        return engine_gemv(x, w, out, gated=name == "down", config=config)

    ref = call(GemvConfig(4, 256, 4)).double()
    default = gemv_config(n, k, gpu=torch.cuda.get_device_name())  # as the engine picks
    configs = [default] + [GemvConfig(*t) for t in ENGINE_TILES if GemvConfig(*t) != default]
    for config in configs:
        if config.block_k > triton.next_power_of_2(k):
            continue
        try:
            err = rel_err(call(config), ref)
            ms = graph_ms(functools.partial(call, config), copies)
        except (RuntimeError, OutOfResources, CompilationError) as e:  # a tile that won't build
            print(f"{name} {config}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        tile = (config.block_n, config.block_k, config.num_warps, config.num_stages)
        rows.append({"projection": name, "n": n, "k": k,
                     "method": "default" if config == default else "engine", "tile": tile,
                     "splits": 1, "rel_err": err, "us": ms * 1e3, "tb_s": nbytes / ms / 1e9})
        _print_row(rows[-1])
    mine = [r for r in rows if r["projection"] == name]
    best = min(mine, key=lambda r: r["us"])
    print(f"{name}: default {mine[0]['us']:.1f} us, best ", end="")
    _print_row(best)


# The --few-rows grid: (BLOCK_N, BLOCK_K, warps, stages), each with K split 1, 2 or 4 ways
FEW_ROWS_TILES = [(bn, bk, w, st) for bn in (32, 64, 128) for bk in (128, 256)
                  for w in (4, 8) for st in (3, 4)
                  if bn * bk <= 16384 and (w == 4 or bn * bk >= 8192)]  # fmt: skip


def sweep_few_rows(name: str, n: int, k: int, m: int, rows: list[dict]) -> None:
    """The engine's few-rows kernel (`engine/kernels/few_rows.py`) for `name` at m rows, per
    tile of FEW_ROWS_TILES and K split, against F.linear (cuBLASLt, as the engine runs it)."""
    from engine.kernels.few_rows import FewRowsConfig, few_rows_config, few_rows_linear

    torch.backends.cuda.preferred_blas_library("cublaslt")
    gen = torch.Generator(device=DEVICE).manual_seed(n + k + m)
    nbytes = n * k * 2
    copies = max(2, min(16, math.ceil((512 << 20) / nbytes)))
    weights = [torch.randn(n, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
               for _ in range(copies)]  # fmt: skip
    x = torch.randn(m, k, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
    out = torch.empty(m, n, device=DEVICE, dtype=out_dtype)
    ref = (x.double() @ weights[0].double().t())

    def linear(i=0):
        return F.linear(x, weights[i % len(weights)])

    def call(config, i=0):
        return few_rows_linear(x, weights[i % len(weights)], out, config)

    start = len(rows)
    ms = graph_ms(linear, copies)
    rows.append({"projection": name, "n": n, "k": k, "m": m, "method": "linear", "tile": None,
                 "splits": 1, "rel_err": rel_err(linear().double(), ref), "us": ms * 1e3,
                 "tb_s": nbytes / ms / 1e9})  # fmt: skip
    _print_row(rows[-1])
    props = torch.cuda.get_device_properties(0)
    default = few_rows_config(n, k, props.multi_processor_count, props.name)
    configs = [default] + [FewRowsConfig(*t, split_k=s) for t in FEW_ROWS_TILES
                           for s in (1, 2, 4)]  # fmt: skip
    for config in dict.fromkeys(configs):
        try:
            err = rel_err(call(config).double(), ref)
            ms = graph_ms(functools.partial(call, config), copies)
        except (RuntimeError, OutOfResources, CompilationError) as e:
            print(f"{name} {config}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        rows.append({"projection": name, "n": n, "k": k, "m": m,
                     "method": "default" if config == default else "few-rows",
                     "tile": (config.block_n, config.block_k, config.num_warps,
                              config.num_stages),
                     "splits": config.split_k, "rel_err": err, "us": ms * 1e3,
                     "tb_s": nbytes / ms / 1e9})  # fmt: skip
        _print_row(rows[-1])
    mine = rows[start:]
    best = min(mine[1:], key=lambda r: r["us"])
    print(f"{name} m={m}: F.linear {mine[0]['us']:.1f} us, default {mine[1]['us']:.1f} us, "
          f"best ", end="")
    _print_row(best)


def _print_row(r: dict) -> None:
    tile = "n{}:k{}:w{}:s{}".format(*r["tile"]) if r["tile"] else "-"
    print(f"{r['projection']:8} {r['method']:14} {tile:14} splits {r['splits']}  "
          f"err {r['rel_err']:.1e}  {r['us']:8.1f} us  {r['tb_s']:5.2f} TB/s", flush=True)


def summary(rows: list[dict]) -> dict:
    """Fastest path per projection (relative error within 1.5x of F.linear's, and < 1e-2; the
    fastest Triton tile is shown whatever its error), and one decode step's GEMM time with
    those paths against F.linear everywhere."""
    print("\nfastest per projection:")
    step_linear = step_best = 0.0
    best_paths = {}
    for name, _, _, per_step in PROJECTIONS:
        mine = [r for r in rows if r["projection"] == name]
        if not mine:
            continue
        linear = next(r for r in mine if r["method"] == "linear")
        ok = [r for r in mine if r["rel_err"] < min(1e-2, 1.5 * linear["rel_err"] + 1e-4)]
        best = min(ok, key=lambda r: r["us"])
        best_paths[name] = best
        step_linear += per_step * linear["us"]
        step_best += per_step * best["us"]
        print("  linear: ", end="")
        _print_row(linear)
        triton_rows = [r for r in mine if r["method"] == "triton"]
        if triton_rows:
            print("  triton: ", end="")
            _print_row(min(triton_rows, key=lambda r: r["us"]))
        print("  best:   ", end="")
        _print_row(best)
    print(f"\ndecode step, GEMMs only: F.linear {step_linear / 1e3:.3f} ms, "
          f"fastest paths {step_best / 1e3:.3f} ms")
    return {"step_ms_linear": step_linear / 1e3, "step_ms_best": step_best / 1e3,
            "best": best_paths}  # fmt: skip


def rank_shapes(tp: int) -> list[tuple[str, int, int, int]]:
    """PROJECTIONS as one rank of a tensor-parallel engine of `tp` ranks holds them."""
    return [(name, n if name in ("o", "down") else n // tp,
             k // tp if name in ("o", "down") else k, per_step)
            for name, n, k, per_step in PROJECTIONS]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=",".join(p[0] for p in PROJECTIONS))
    ap.add_argument("--m", type=int, default=1,
                    help="rows of x (batch); above 1 only the cuBLAS paths run")
    ap.add_argument("--engine", action="store_true",
                    help="time the engine's kernel over ENGINE_TILES instead")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="one rank's shapes at this size: qkv, gate_up and the LM head have "
                         "1/size of the rows, o and down 1/size of the columns")
    ap.add_argument("--few-rows", default=None, metavar="M,M,...",
                    help="time the engine's few-rows kernel at these row counts (2-16) over "
                         "FEW_ROWS_TILES and K splits, against F.linear (cuBLASLt)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: list[dict] = []
    for name, n, k, _ in rank_shapes(args.tensor_parallel_size):
        if name in args.only.split(","):
            if args.few_rows:
                for m in (int(v) for v in args.few_rows.split(",")):
                    sweep_few_rows(name, n, k, m, rows)
            elif args.engine:
                sweep_engine_kernel(name, n, k, rows)
            else:
                sweep_projection(name, n, k, rows, args.m)
            torch.cuda.empty_cache()
    if args.engine or args.few_rows:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
        return
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows, "summary": summary(rows)}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
