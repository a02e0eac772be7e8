"""Per-token fp8 quantization of a projection's input (the W8A8 path of engine/models/fp8.py).

One program per token row, held in registers up to 16,384 values (longer rows are read twice,
the second time from L2): the row's largest magnitude, then each element times 1/scale,
saturated to e4m3's +-448 and rounded to nearest even. `gated=True` quantizes
`silu(gate) * up` of a [gate | up] row, computed as `silu_and_mul` computes it (fp32, rounded
once to the input's dtype), so the down projection reads the gate_up output once instead of
SiLU·mul writing a tensor this kernel reads back.

Bit-identical to `engine.models.fp8.quantize_rows` (of the `silu_and_mul` output when gated):
the max is exact, the scale is the max times fp32(1/448) and the values are times the scale's
reciprocal, each IEEE-rounded in fp32 (the reciprocal is `div_rn`, not the approximate
division Triton emits for `/`), and the GPU
converts to e4m3 rounding to nearest even, as torch does. The CPU interpreter (Triton 3.x)
does not: it rounds halves up, flushes e4m3's subnormals (below 2^-6 after scaling) to zero,
and loses the carry when rounding up reaches the next power of two (125.9 becomes 64, not
128). The model therefore quantizes with torch ops off CUDA, and the CPU tests of this kernel
feed it values the conversion holds exactly; the GPU tests check random values byte for
byte.

CUDA-graph safety: shapes only on the host; the grid is the row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import launch_options as pdl_options
from engine.kernels.pdl import use_pdl
from engine.kernels.fp8_format import FP8_MAX, INV_FP8_MAX, MIN_AMAX

FP8 = torch.float8_e4m3fn
# a row of up to this many values stays in registers (16 warps: 32 a thread); longer rows
# loop in chunks of _LOOP_BLOCK
_MAX_BLOCK = 16384
_LOOP_BLOCK = 2048


@triton.jit
def _row_values(x_row, c, K, GATED: tl.constexpr, EVEN: tl.constexpr):
    """The row's values at columns c as fp32: x, or silu(gate) * up rounded to x's dtype."""
    if EVEN:
        x = tl.load(x_row + c).to(tl.float32)
    else:
        x = tl.load(x_row + c, mask=c < K, other=0.0).to(tl.float32)
    if GATED:
        if EVEN:
            up = tl.load(x_row + K + c).to(tl.float32)
        else:
            up = tl.load(x_row + K + c, mask=c < K, other=0.0).to(tl.float32)
        x = (x / (1.0 + tl.exp(-x)) * up).to(x_row.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _quantize_tile(x, q_ptrs, mask, scale_ptr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                   MIN_AMAX: tl.constexpr):  # fmt: skip
    """Store a whole row x (fp32, in registers) as fp8 at q_ptrs and its scale at scale_ptr."""
    scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX) * INV_FP8_MAX
    q = tl.clamp(x * tl.math.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quant_fp8_kernel(
    x_ptr, x_row_stride, q_ptr, q_row_stride, scale_ptr, K,
    FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per row: a row of one chunk stays in registers (one read); longer rows
    are read twice, the second time from L2."""
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * q_row_stride
    cols = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        x = _row_values(x_row, cols, K, GATED, EVEN)
        _quantize_tile(x, q_row + cols, cols < K, scale_ptr + row, FP8_MAX, INV_FP8_MAX,
                       MIN_AMAX)  # fmt: skip
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(_row_values(x_row, k0 + cols, K, GATED, EVEN)))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) * INV_FP8_MAX
        inv = tl.math.div_rn(1.0, scale)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            c = k0 + cols
            q = tl.clamp(_row_values(x_row, c, K, GATED, EVEN) * inv, -FP8_MAX, FP8_MAX)
            tl.store(q_row + c, q.to(q_ptr.dtype.element_ty), mask=c < K)


def quantize_fp8(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8 [T, K] float8_e4m3fn, scale [T, 1] float32) with x ~ x8 * scale per row.

    Args:
        x: [T, K] (gated: [T, 2K] = [gate | up]), last dim contiguous, 16- or 32-bit float.
        gated: quantize silu(gate) * up.
    """
    if x.dim() != 2 or (gated and x.shape[1] % 2):
        raise ValueError(f"x must be [T, {'2 * K' if gated else 'K'}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim (stride {x.stride()})")
    rows, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    x8 = torch.empty(rows, k, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows == 0:
        return x8, scale
    block = triton.next_power_of_2(k)
    if block > _MAX_BLOCK:
        block = _LOOP_BLOCK
    pdl = use_pdl(x)
    _quant_fp8_kernel[(rows,)](
        x, x.stride(0), x8, x8.stride(0), scale, k, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX,
        MIN_AMAX=MIN_AMAX,
        GATED=gated, BLOCK=block, NUM_CHUNKS=triton.cdiv(k, block), EVEN=k % block == 0,
        PDL=pdl, num_warps=min(max(block // 512, 4), 16), **pdl_options(pdl),
    )  # fmt: skip
    return x8, scale
