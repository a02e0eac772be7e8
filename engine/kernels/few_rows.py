"""Projections of a few rows (2 <= M <= 16: a decode step of a handful of sequences) as a
Triton kernel that reads each weight once for all the rows.

At batch 1 the GEMV (engine/kernels/gemv.py) streams an 8B model's weights at 3.3-4.4 TB/s on
an H200 and a decode step takes 4.24 ms; at batch 5 the same step, its projections through
cuBLASLt, took 5.13 ms, and at batch 10 5.41 (the engine's stats lines under Poisson load,
2026-11-29, docs/benchmarks.md session 73): the GEMMs are still bound by the weights' bytes,
read more slowly. Here each program owns BLOCK_N output features and walks K once,
BLOCK_K columns at a time, multiplying its weight tile by all the rows at once on the tensor
cores with the operands swapped, out^T[BLOCK_N, M] += W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, M]
(the weight is the MMA's tall operand; the few rows, padded to 16, its narrow one). Weights
load with `evict_first` (read once), so L2 keeps x. Where N / BLOCK_N programs would leave
SMs idle (the 4,096-row o and down projections), SPLIT_K programs share a row block, each
summing a slice of K into an fp32 partial that a second kernel adds up in a fixed order:
the results do not depend on timing (no atomics).

Numerics: bf16/fp16 products accumulated in fp32 and cast once, within bf16 rounding of
`F.linear` (the summation order differs). CUDA-graph safety: the wrapper reads only shapes,
dtypes and the GPU's name; the grid depends only on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.device import gpu_of

MAX_ROWS = 16  # the MMA's narrow side: more rows than this go to cuBLAS


@dataclass(frozen=True)
class FewRowsConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    split_k: int = 1


def few_rows_config(n: int, k: int, num_sms: int = 132, gpu: str = "") -> FewRowsConfig:
    """A tile by shape: 64 output features a program, 128 columns a load, 3 stages in flight;
    K split so that row blocks x splits cover the SMs at least once. On a GPU of
    _TILES_BY_GPU (by torch.cuda.get_device_name), rows of up to 4,096 columns take its tiles
    instead (`python -m bench.gemv_sweep --few-rows 4,16` sweeps them)."""
    if k <= 4096 and gpu in _TILES_BY_GPU:
        narrow, wide = _TILES_BY_GPU[gpu]
        return narrow if n <= 8192 else wide
    block_n = 64
    blocks = triton.cdiv(n, block_n)
    split = 1
    while blocks * split < num_sms and k // (2 * split) >= 1024 and split < 8:
        split *= 2
    return FewRowsConfig(block_n=block_n, block_k=128, num_warps=4, num_stages=3, split_k=split)


# Tiles for rows of up to 4,096 columns: N up to 8,192 (qkv, o), and wider (gate_up, the LM
# head). The H200's from its `bench.gemv_sweep --few-rows 4,16` of 2026-11-29 (session 74,
# Llama-3.1-8B's shapes; docs/benchmarks.md): 4 stages and no split of K where the rule
# above takes 3 and splits qkv and o; at 4 rows qkv 16.2 -> 15.8 us, o 12.3 -> 12.2,
# gate_up 67.1 -> 60.2 (cuBLAS: 61.0), the LM head 243.5 -> 243.4. The down projection's
# 14,336 columns keep the rule (split 4 ways, 3 stages: the sweep's fastest).
_TILES_BY_GPU = {
    "NVIDIA H200": (FewRowsConfig(64, 256, 4, 4), FewRowsConfig(64, 128, 4, 4)),
}


def has_swept_tiles(gpu: str) -> bool:
    """Whether `gpu` (torch.cuda.get_device_name) has tiles of its own here: where
    `--few-rows-gemm auto` turns the kernel on."""
    return gpu in _TILES_BY_GPU


@triton.jit
def _few_rows_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_os, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """out[split, m, n] = sum over this split's K range of w[n, k] * x[m, k] (fp32 on the
    tensor cores; written in out's dtype). Grid (N / BLOCK_N, splits)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    k_start = tl.program_id(1) * k_per_split
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    m_ok = ms < M
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_start + cols)[None, :]
    x_ptrs = x_ptr + ms[None, :] * stride_xm + (k_start + cols)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k0 + cols < k_end
            w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_ptrs = (out_ptr + tl.program_id(1) * stride_os + ms[None, :] * stride_om
                + rows[:, None])  # fmt: skip
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over splits s (in order) of part[s, i], for the M * N entries i."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    total = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` takes this product: 2..MAX_ROWS rows of 16-bit x against a
    weight of x's dtype, both contiguous in their last dim."""
    return (x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16,
            torch.float16) and weight.dtype == x.dtype and x.stride(-1) == 1
            and weight.stride(-1) == 1 and x.shape[1] == weight.shape[1])  # fmt: skip


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                    config: FewRowsConfig | None = None) -> torch.Tensor:  # fmt: skip
    """`F.linear(x, weight)` for 2..16 rows of x.

    Args:
        x: [M, K], 2 <= M <= MAX_ROWS, bf16 or fp16, last dim contiguous.
        weight: [N, K] of x's dtype, last dim contiguous.
        out: [M, N] contiguous, x's dtype or float32 (allocated in x's dtype if None).
        config: launch parameters; default `few_rows_config(N, K, the GPU's SM count)`.
    Returns:
        out.
    """
    if not fits(x, weight):
        raise ValueError(f"few_rows_linear takes x [2..{MAX_ROWS}, K] in bf16/fp16 and weight "
                         f"[N, K] of its dtype, contiguous in K; got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or not out.is_contiguous() or out.dtype not in (x.dtype,
                                                                             torch.float32):
        raise ValueError(f"out must be [{m}, {n}] contiguous in {x.dtype} or float32, got "
                         f"{out.dtype} {tuple(out.shape)}")
    gpu = gpu_of(x)  # None on CPU (the interpreter): any SM count will do
    config = config or (few_rows_config(n, k) if gpu is None else
                        few_rows_config(n, k, gpu.multi_processor_count, gpu.name))
    split = max(1, config.split_k)
    # each split a whole number of tiles, so only the last split's last tile is ragged
    k_per_split = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32,
                                                device=x.device)
    _few_rows_kernel[(triton.cdiv(n, config.block_n), split)](
        x, weight, target, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), m * n if split > 1 else 0, n,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0 and k_per_split * split == k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLITS=split,
                                                         BLOCK=block, num_warps=4)
    return out

