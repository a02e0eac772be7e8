"""Single-token projections (M = 1) as a Triton GEMV: the batch-1 decode path (docs/benchmarks.md,
"GPU: engine on H100").

At batch 1 every projection reads its whole weight once to produce one row, so a decode step is
bound by how fast the weights stream from memory. cuBLAS's kernels for M = 1 (measured with
`python -m bench.gemv_sweep` on an H100, 2026-11-23) read Llama-3.1-8B's projections at
1.97-2.76 TB/s, the split-K kernel it picks for the down projection among the slowest; this
kernel reads them at 2.6-3.1 TB/s (`--engine` sweep, tiles as `gemv_config`):

- each program owns BLOCK_N output rows and walks the whole K once, BLOCK_K columns at a time,
  into a [BLOCK_N, BLOCK_K] fp32 accumulator reduced at the end (no split-K, no second kernel);
- weights load with `evict_first` (read once), so L2 keeps the input row every program reads;
- `gated=True` computes `silu(gate) * up` from a [1, 2K] input on the fly (the MLP's down
  projection), one kernel instead of SiLU·mul and the GEMV;
- `rms_norm_gemv` runs the decoder layer's residual add + RMSNorm inside the projection after
  it: each program first reads the row (from L2) for its sum of squares, then normalizes each
  tile as it streams the weights; program 0 writes the summed residual (5.64 -> 5.59 ms a
  batch-1 step on an H100: 64 fewer kernels);
- programmatic dependent launch (`engine/kernels/pdl.py`): the kernel launches while the
  previous one drains, loads its first weight tile, and only then waits for the previous
  kernel's output: the launch and the first HBM round trip overlap the kernel before it.

Numerics: fp32 accumulation over bf16/fp16 inputs, cast once: within bf16 rounding of
`F.linear`, not bit-identical to it (the summation order differs). The gated input rounds
silu(gate) * up to the input dtype first, as `silu_and_mul` does before the down projection;
the normed input rounds as `fused_add_rms_norm` does (its sum of squares may differ in the last
bit: another summation order).

CUDA-graph safety: the wrapper reads only shapes and dtypes; the grid depends only on shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.device import gpu_of
from engine.kernels import pdl as _pdl


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1


def gemv_config(n: int, k: int, fp8: bool = False, gpu: str = "") -> GemvConfig:
    """The tile from the 2026-11-23 H100 sweep of this kernel (`python -m bench.gemv_sweep
    --engine`): a row of up to 4,096 columns loads whole, 2 rows a program (1 for a vocabulary-
    sized N), 8 warps; longer rows (the down projection) go 2,048 columns at a time, 4 rows a
    program. Against the 4 x 1,024 tile before, per Llama-3.1-8B projection: qkv 21.3 -> 19.5
    us, o 13.5 -> 13.0, gate_up 86.4 -> 79.6 (2.95 TB/s), down 44.9 -> 43.7, LM head 356.8 ->
    338.9 (3.10 TB/s); each within 0.4 us of the fastest tile of 54 (the LM head's is this
    one), and 1 or 2 pipeline stages made no difference. fp8 weights: twice the rows a
    program, so each load moves as many bytes.

    `gpu` (torch.cuda.get_device_name) picks the tiles swept on that GPU where they differ:
    on an H200 (HBM3e, 4.8 TB/s against the H100's 3.35) the H100's tiles left a third of the
    bandwidth unused on the largest projections; see _TILES_BY_GPU.

    Smaller matrices (a tensor-parallel rank's share: under 16 Mi weights of up to 4,096
    columns, under 32 Mi of longer rows) take 8 rows x 1,024 columns a program, 4 warps: in the
    2026-11-28 H200 sweep (`bench.gemv_sweep --engine --tensor-parallel-size 2`) Llama-3.1-8B's
    TP 2 shares went qkv 10.1 -> 9.3 us, o 6.3 -> 5.5, down 20.3 -> 16.6 with it (each within
    0.6 us of the fastest of the grid)."""
    rows = 2 if fp8 else 1
    if n * k < (16 << 20 if k <= 4096 else 32 << 20):
        return GemvConfig(block_n=8 * rows, block_k=min(1024, triton.next_power_of_2(k)),
                          num_warps=4)
    if gpu in _TILES_BY_GPU and not fp8:
        short, vocab, long = _TILES_BY_GPU[gpu]
        return long if k > 4096 else vocab if n >= 65536 else short
    if k <= 4096:
        block_k = triton.next_power_of_2(k)
        return GemvConfig(block_n=(1 if n >= 65536 else 2) * rows, block_k=block_k,
                          num_warps=8 if block_k >= 2048 else 4)
    return GemvConfig(block_n=4 * rows, block_k=2048, num_warps=8)


# Tiles for bf16/fp16 weights of 16 Mi and more, by torch.cuda.get_device_name: for rows of up
# to 4,096 columns, rows of a vocabulary-sized N (the LM head), and longer rows (the down
# projection). The H200's come from its `bench.gemv_sweep --engine` of 2026-11-29 (54 tiles,
# Llama-3.1-8B's projections; docs/benchmarks.md, session 73). Against the H100's tiles
# there: qkv 18.1 -> 15.4 us, o 10.0 -> 9.9, gate_up 75.3 -> 61.8 (3.12 -> 3.80 TB/s), LM head
# 260.2 -> 240.4 (4.37 TB/s), down 33.2 -> 31.7, each within 0.2 us of the grid's fastest
# (o: 9.7). fp8 weights were not swept there and keep the H100's rule.
_TILES_BY_GPU = {
    "NVIDIA H200": (GemvConfig(4, 2048, 4), GemvConfig(4, 4096, 8), GemvConfig(8, 2048, 8)),
}


def device_gpu(t: torch.Tensor) -> str:
    """The name of the GPU holding t ("" off CUDA, or under the Triton interpreter)."""
    gpu = gpu_of(t)
    return "" if gpu is None else gpu.name


@triton.jit
def _weight_tile(w_ptrs, k0, row_ok, cols, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_ptrs + k0, eviction_policy="evict_first")  # read once: L2 keeps x
    return tl.load(w_ptrs + k0, mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _load_cols(ptr, c, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr + c)
    return tl.load(ptr + c, mask=c < K, other=0.0)


@triton.jit
def _residual_sum(x_ptr, r_ptr, c, K, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):
    """x[c] (+ r[c], rounded to x's dtype like the layer's residual add), as fp32."""
    s = _load_cols(x_ptr, c, K, EVEN_K).to(tl.float32)
    if HAS_RES:
        s = (s + _load_cols(r_ptr, c, K, EVEN_K).to(tl.float32)).to(x_ptr.dtype.element_ty)
    return s.to(tl.float32)


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, inv_rms, c, K, GATED: tl.constexpr, NORM: tl.constexpr,
                HAS_RES: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """The GEMV's input at columns c, as fp32:
    plain: x[c];
    GATED: silu(gate[c]) * up[c], rounded to x's dtype like `silu_and_mul`;
    NORM: RMSNorm of (x + r)[c] given its inverse RMS, rounded as `fused_add_rms_norm` rounds
    (the normalized value, then its product with the norm weight g)."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        s = _residual_sum(x_ptr, r_ptr, c, K, HAS_RES, EVEN_K)
        normed = (s * inv_rms).to(dtype).to(tl.float32)
        x = (normed * _load_cols(g_ptr, c, K, EVEN_K).to(tl.float32)).to(dtype)
    else:
        x = _load_cols(x_ptr, c, K, EVEN_K)
    if GATED:
        gate = x.to(tl.float32)
        up = _load_cols(x_ptr + K, c, K, EVEN_K).to(tl.float32)
        x = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _dot_rows(x_ptr, w_ptrs, row_ok, cols, K, r_ptr, res_out_ptr, g_ptr, eps,
              GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
              PDL: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
              EVEN_K: tl.constexpr):
    """sum_k w[row, k] * x[k] for the program's rows (fp32), x as `_input_tile` forms it."""
    # the first tile is peeled: its weights do not depend on the kernel before, so under PDL
    # they are in flight before the wait for that kernel's output (x)
    w = _weight_tile(w_ptrs, 0, row_ok, cols, K, EVEN)
    if PDL:
        tl.extra.cuda.gdc_wait()
        # once every program has started, the next kernel may launch: its programs fill the
        # SMs this kernel's last wave leaves idle and fetch their own first tiles
        tl.extra.cuda.gdc_launch_dependents()
    inv_rms = 0.0
    if NORM:
        store_end = tl.where(tl.program_id(0) == 0, K, 0)  # program 0 writes the residual
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            s = _residual_sum(x_ptr, r_ptr, k0 + cols, K, HAS_RES, EVEN_K)
            if HAS_RES:
                tl.store(res_out_ptr + k0 + cols, s.to(res_out_ptr.dtype.element_ty),
                         mask=k0 + cols < store_end)  # fmt: skip
            squares += s * s
        inv_rms = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    acc = w.to(tl.float32) * _input_tile(x_ptr, r_ptr, g_ptr, inv_rms, cols, K, GATED, NORM,
                                         HAS_RES, EVEN_K)[None, :]  # fmt: skip
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_tile(w_ptrs, k0, row_ok, cols, K, EVEN)
        acc += w.to(tl.float32) * _input_tile(x_ptr, r_ptr, g_ptr, inv_rms, k0 + cols, K, GATED,
                                              NORM, HAS_RES, EVEN_K)[None, :]  # fmt: skip
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, stride_wn,
    r_ptr, res_out_ptr, g_ptr, eps, ws_ptr,
    a_ptr, part_ptr, slot_ptr, NA, base_programs,
    GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, SCALED: tl.constexpr,
    LORA: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out[n] = sum_k w[n, k] * x[k] for this program's BLOCK_N rows n (x: see _input_tile);
    SCALED: times ws[n] (fp8 weights and their per-row scales).

    NORM first walks the row once for its sum of squares (from L2: every program reads the
    same row); with HAS_RES program 0 also writes the summed residual to res_out.

    LORA: the programs past `base_programs` multiply the same input by the NA rows of the
    token's LoRA slot (a [slots, NA, K], the slot at slot_ptr, -1: none) into part [NA] in
    float32: the adapter's shrink, for the price of a few more rows of the projection.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    if LORA:
        if pid >= base_programs:
            slot = tl.load(slot_ptr)  # the host's copy, complete before the step's kernels
            if slot < 0:
                return
            rows = (pid - base_programs) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < NA
            w_ptrs = (a_ptr + (slot.to(tl.int64) * NA + rows)[:, None] * K + cols[None, :])
            y = _dot_rows(x_ptr, w_ptrs, row_ok, cols, K, r_ptr, res_out_ptr, g_ptr, eps,
                          GATED, NORM, HAS_RES, PDL, BLOCK_K, False, EVEN_K)
            tl.store(part_ptr + rows, y, mask=row_ok)
            return
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    y = _dot_rows(x_ptr, w_ptrs, row_ok, cols, K, r_ptr, res_out_ptr, g_ptr, eps, GATED, NORM,
                  HAS_RES, PDL, BLOCK_K, EVEN_N and EVEN_K, EVEN_K)
    if SCALED:
        y *= tl.load(ws_ptr + rows, mask=row_ok, other=0.0)
    y = y.to(out_ptr.dtype.element_ty)
    if EVEN_N:
        tl.store(out_ptr + rows, y)
    else:
        tl.store(out_ptr + rows, y, mask=row_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    gated: bool = False,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight)` for one row x (fp8 weights: `F.linear(x, weight * scale[:, None])`).

    Args:
        x: [1, K] (gated: [1, 2K] = [gate | up]), contiguous.
        weight: [N, K], last dim contiguous, x's dtype (or float8_e4m3fn with `scale`).
        out: [1, N], x's dtype or float32 (allocated in x's dtype if None).
        gated: the input is silu(gate) * up (the MLP's down projection).
        config: launch parameters; default `gemv_config` for N, K, fp8 and x's GPU.
        scale: [N] float32, the fp8 weight's per-row scales (engine/models/fp8.py).
        lora: (a [slots, NA, K] in x's dtype, part [NA] float32, slot [1] int32): part =
            a[slot] @ x as well, the LoRA shrink (nothing when slot is -1).
    Returns:
        out.
    """
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != (2 * k if gated else k):
        want = f"[1, {2 * k if gated else k}]"
        raise ValueError(f"x must be {want} for weight [{n}, {k}], got {tuple(x.shape)}")
    _check(x, weight, scale)
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, config, scale, gated=gated, lora=lora)
    return out


def rms_norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    scale: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's `norm(x, residual)` then `F.linear(normed, weight)`, for one row, in
    one kernel (the RMSNorm kernel before a batch-1 projection costs more in launch and latency
    than in work).

    Args:
        x: [1, K] contiguous; residual: [1, K] or None (the first layer: x is the residual).
        norm_weight: [K]; eps: the norm's epsilon.
        weight: [N, K], x's dtype (or float8_e4m3fn with `scale`, as for `gemv`).
        lora: as for `gemv`: the shrink of the normed input.
    Returns:
        (out [1, N], the residual stream x + residual: a new tensor, or x when residual is
        None).
    """
    n, k = weight.shape
    if x.dim() != 2 or x.shape != (1, k) or norm_weight.shape != (k,):
        raise ValueError(f"x must be [1, {k}] and norm_weight [{k}] for weight [{n}, {k}]; got "
                         f"x {tuple(x.shape)}, norm_weight {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [1, {k}] and contiguous, got {tuple(residual.shape)}")
    _check(x, weight, scale)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    _launch(x, weight, out, config, scale, norm=(residual, res_out, norm_weight, eps),
            lora=lora)
    return out, res_out


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    if scale is None and x.dtype != weight.dtype:
        raise ValueError(f"weight must be x's dtype {x.dtype}, got {weight.dtype}")
    if scale is not None and (weight.dtype != torch.float8_e4m3fn
                              or scale.shape != (weight.shape[0],)
                              or scale.dtype != torch.float32):  # fmt: skip
        raise ValueError(f"scaled weights must be float8_e4m3fn with float32 scales [N]; got "
                         f"{weight.dtype}, scale {scale.dtype} {tuple(scale.shape)}")


def _launch(x, weight, out, config, scale, gated: bool = False, norm=None, lora=None) -> None:
    n, k = weight.shape
    config = config or gemv_config(n, k, fp8=scale is not None, gpu=device_gpu(x))
    residual, res_out, norm_weight, eps = norm or (None, x, x, 0.0)
    pdl = _pdl.use_pdl(x)
    base_programs = triton.cdiv(n, config.block_n)
    a, part, slot = lora or (x, out, out)
    na = a.shape[1] if lora is not None else 0
    if lora is not None and (a.dim() != 3 or a.shape[2] != k or a.dtype != x.dtype
                             or part.shape != (na,) or part.dtype != torch.float32):
        raise ValueError(f"lora: a must be [slots, NA, {k}] in {x.dtype} and part [NA] "
                         f"float32; got a {a.dtype} {tuple(a.shape)}, part {part.dtype} "
                         f"{tuple(part.shape)}")
    _gemv_kernel[(base_programs + triton.cdiv(na, config.block_n),)](
        x, weight, out, n, k, weight.stride(0),
        x if residual is None else residual, res_out, norm_weight, eps,
        out if scale is None else scale, a, part, slot, na, base_programs,
        GATED=gated, NORM=norm is not None, HAS_RES=residual is not None,
        SCALED=scale is not None, LORA=lora is not None, PDL=pdl,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **_pdl.launch_options(pdl),
    )  # fmt: skip
