"""Fused per-token kernels for the decoder layer: RMSNorm (+ residual add), RoPE + KV-cache write,
SiLU-and-mul.

Each kernel replaces several eager torch ops (and their intermediate tensors) with one pass over
memory, and matches the torch model in `engine/models/llama.py`:

- `rms_norm` / `fused_add_rms_norm`: the norm in fp32, cast back to the input dtype, then times
  `weight` (rounded once more), exactly like `RMSNorm.forward`; the residual add rounds to the
  residual's dtype first, like `x = x + attn_out` in the layer.
- `rope_and_store_kv`: rotate_half RoPE from the fp32 `cos_sin` table, done in fp32 and cast
  once (llama.py casts cos/sin to q's dtype first, so in bf16 the two differ by bf16 rounding).
- `silu_and_mul`: `silu(gate) * up` in fp32, cast once (llama.py rounds silu(gate) to bf16 first).

CUDA-graph safety: the wrappers read only shapes, strides and dtypes on the host (no `.item()`,
no device-to-host copy), allocate nothing when the output is given, and the grid depends only on
shapes. Per-token data (positions, slot_mapping) is read by the kernels on the device, so a graph
replays correctly after the runner refills its static input buffers.

All tensors must have a contiguous last dimension; other strides are passed to the kernels, so
q/k/v views split out of one fused qkv projection work without copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import launch_options as pdl_options
from engine.kernels.pdl import use_pdl
from engine.kernels.fp8_format import FP8_MAX, INV_FP8_MAX, MIN_AMAX

# RMSNorm rows up to this many elements stay in registers (one read, one write; 16 warps keep
# an 8192 row at 64 registers a thread). Longer rows are read twice in chunks of _NORM_LOOP_BLOCK
# (a whole 8192-element accumulator in the loop would spill).
_MAX_NORM_BLOCK = 8192
_NORM_LOOP_BLOCK = 2048
_MAX_SILU_BLOCK = 1024


def _num_warps(block_elements: int, max_warps: int = 8) -> int:
    return min(max(block_elements // 512, 4), max_warps)


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride()})")


# ---------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    out_ptr,
    out_row_stride,
    weight_ptr,
    hidden,
    eps,
    q_ptr,
    q_row_stride,
    scale_ptr,
    row_scale_ptr,
    col_scale_ptr,
    peer_ptr,
    peer_row_stride,
    HAS_RESIDUAL: tl.constexpr,
    HAS_PEER: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INV_FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row. With HAS_RESIDUAL: residual += x, then normalize residual.
    QUANT (one chunk only): the normalized row, rounded to out's dtype, goes to q as fp8 with
    its scale (engine/kernels/quant.py's arithmetic) instead of to out. SCALED (one chunk, with
    a residual): x is an fp8 GEMM's fp32 output without its scales (engine/models/fp8.py
    `Fp8Output`); x * row_scale[row] * col_scale[col], rounded to the residual's dtype, is the
    projection's output. HAS_PEER (with a residual, not SCALED): x is this rank's partial sum
    of a tensor-parallel projection and peer's row the other rank's (engine/tp/exchange.py);
    their sum, rounded to the dtype as an all-reduce's, is the projection's output."""
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    res_row = residual_ptr + row * residual_row_stride
    out_row = out_ptr + row * out_row_stride
    peer_row = peer_ptr + row * peer_row_stride
    # llama.py casts the normalized row back to the input dtype, the residual's (x's unless
    # SCALED; x is the residual itself without one)
    dtype = residual_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)

    if NUM_CHUNKS == 1:
        mask = cols < hidden
        h = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:  # the rowwise GEMM's epilogue: both scales, then the model's dtype
            col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
            h = (h * tl.load(row_scale_ptr + row) * col_scale).to(dtype).to(tl.float32)
        if HAS_PEER:
            h = (h + tl.load(peer_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            h = h.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            h_rounded = (h + r).to(dtype)  # the add rounds to the model dtype, as in eager torch
            tl.store(res_row + cols, h_rounded, mask=mask)
            h = h_rounded.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        normed = (h * inv_rms).to(dtype).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (normed * w).to(out_ptr.dtype.element_ty)
        if QUANT:  # quant.py's _quantize_tile, inline (jit helpers shared across modules
            # break the interpreter's reloads in the tests: engine/kernels/pdl.py)
            y = y.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(y), 0), MIN_AMAX) * INV_FP8_MAX
            q = tl.clamp(y * tl.math.div_rn(1.0, scale), -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + row * q_row_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(scale_ptr + row, scale)
        else:
            tl.store(out_row + cols, y, mask=mask)
    else:
        # pass 1: (residual add and store) and the sum of squares
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            mask = c < hidden
            h = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_PEER:
                h = (h + tl.load(peer_row + c, mask=mask, other=0.0).to(tl.float32)).to(dtype)
                h = h.to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_row + c, mask=mask, other=0.0).to(tl.float32)
                h_rounded = (h + r).to(dtype)
                tl.store(res_row + c, h_rounded, mask=mask)
                h = h_rounded.to(tl.float32)
            acc += h * h
        inv_rms = tl.rsqrt(tl.sum(acc, axis=0) / hidden + eps)
        tl.debug_barrier()  # pass 2 re-reads the residual this program just wrote
        # pass 2: normalize the (summed) row
        for chunk in range(NUM_CHUNKS):
            c = chunk * BLOCK + cols
            mask = c < hidden
            if HAS_RESIDUAL:
                h = tl.load(res_row + c, mask=mask, other=0.0).to(tl.float32)
            else:
                h = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            normed = (h * inv_rms).to(dtype).to(tl.float32)
            w = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + c, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, residual, weight, eps, out, quant=None, scales=None, peer=None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be [T, hidden] and weight [hidden]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    _check_last_dim_contiguous(x=x, out=out, weight=weight, residual=residual)
    if peer is not None:
        if peer.shape != x.shape or peer.dtype != x.dtype or residual is x or scales is not None:
            raise ValueError(f"peer {tuple(peer.shape)} {peer.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}, with a residual and no scales")
        _check_last_dim_contiguous(peer=peer)
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    if block > _MAX_NORM_BLOCK:
        block = _NORM_LOOP_BLOCK
    x8, scale = quant or (out, out)
    row_scale, col_scale = scales or (weight, weight)
    if scales is not None and (hidden > block or residual is x):
        raise ValueError("scaled rows need a residual and hidden <= "
                         f"{_MAX_NORM_BLOCK}, got hidden {hidden}")
    pdl = use_pdl(x)
    _rms_norm_kernel[(num_rows,)](
        x, x.stride(0),
        residual, residual.stride(0),
        out, out.stride(0),
        weight, hidden, eps,
        x8, x8.stride(0), scale,
        row_scale, col_scale,
        x if peer is None else peer, (x if peer is None else peer).stride(0),
        HAS_RESIDUAL=residual is not x,
        HAS_PEER=peer is not None,
        SCALED=scales is not None,
        BLOCK=block,
        NUM_CHUNKS=triton.cdiv(hidden, block),
        QUANT=quant is not None, FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX,
        MIN_AMAX=MIN_AMAX,
        PDL=pdl,
        num_warps=_num_warps(block, max_warps=16),
        **pdl_options(pdl),
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`RMSNorm.forward(x)` of llama.py into `out` (allocated if None; may be x itself).

    Args:
        x: [T, hidden], last dim contiguous.
        weight: [hidden].
        out: [T, hidden], any dtype (the result is rounded to x's dtype first, then to out's).
    Returns:
        out.
    """
    if out is None:
        out = torch.empty_like(x)
    _launch_rms_norm(x, x, weight, eps, out)  # residual is x: HAS_RESIDUAL=False, never written
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    peer: torch.Tensor | None = None,
) -> None:
    """In place, vLLM's semantics: `residual += x; x = rms_norm(residual) * weight`. With
    `peer` (a tensor-parallel rank's partial in x, the other rank's in peer): x + peer,
    rounded to the dtype, is added instead of x.

    Args:
        x: [T, hidden]; on return holds the normalized sum.
        residual: [T, hidden], same dtype as x; on return holds x + residual (rounded to dtype).
        weight: [hidden].
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    if residual.data_ptr() == x.data_ptr():
        raise ValueError("x and residual must be different tensors")
    _launch_rms_norm(x, residual, weight, eps, x, peer=peer)


def rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` (residual None) or `fused_add_rms_norm`, its normalized rows quantized to fp8
    per row in the same kernel, as `engine.kernels.quant.quantize_fp8` would quantize them
    (the fp8 projection after the norm reads one byte a value, and no quantization kernel runs
    between). x is left as it was; residual, when given, becomes x + residual.

    Returns:
        (x8 [T, hidden] float8_e4m3fn, scale [T, 1] float32).
    Raises:
        ValueError when hidden > the one-chunk limit (`rms_norm_fp8_fits`).
    """
    if not rms_norm_fp8_fits(x.shape[-1]):
        raise ValueError(f"rms_norm_fp8 needs hidden <= {_MAX_NORM_BLOCK}, got {x.shape[-1]}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.data_ptr() == x.data_ptr()):  # fmt: skip
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype} and be another tensor")
    x8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _launch_rms_norm(x, x if residual is None else residual, weight, eps, x, quant=(x8, scale))
    return x8, scale


def rms_norm_scaled(y, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    quant: bool = False):
    """`fused_add_rms_norm` (quant False) or `rms_norm_fp8` (quant True) of an fp8 projection's
    output whose scales the GEMM left out (`engine.models.fp8.Fp8Output`): the kernel applies
    them, rounds to the model's dtype, then adds and normalizes as those do. residual becomes
    the projection's output + residual.

    Returns:
        the normalized rows [T, hidden] in the model's dtype (quant False), or (x8, scale) as
        `rms_norm_fp8` returns them.
    Raises:
        ValueError when residual is not [T, hidden] of the output's dtype, or hidden > the
        one-chunk limit (`rms_norm_fp8_fits`).
    """
    acc, row_scale, col_scale, dtype = y
    if residual.shape != acc.shape or residual.dtype != dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be "
                         f"{tuple(acc.shape)} {dtype}")
    if acc.dtype != torch.float32 or row_scale.shape != (acc.shape[0], 1) or \
            col_scale.shape != (acc.shape[1],):  # fmt: skip
        raise ValueError(f"scaled rows: acc {tuple(acc.shape)} {acc.dtype} needs float32 with "
                         f"row scales [{acc.shape[0]}, 1] and column scales [{acc.shape[1]}]; "
                         f"got {tuple(row_scale.shape)} and {tuple(col_scale.shape)}")
    scales = (row_scale, col_scale)
    if not quant:
        out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
        _launch_rms_norm(acc, residual, weight, eps, out, scales=scales)
        return out
    x8 = torch.empty(acc.shape, dtype=torch.float8_e4m3fn, device=acc.device)
    scale = torch.empty(acc.shape[0], 1, dtype=torch.float32, device=acc.device)
    # out (not written with quant) only gives the dtype the normalized row rounds to
    _launch_rms_norm(acc, residual, weight, eps, residual, quant=(x8, scale), scales=scales)
    return x8, scale


def rms_norm_fp8_fits(hidden: int) -> bool:
    """Whether `rms_norm_fp8` takes rows of `hidden` (one chunk in registers)."""
    return triton.next_power_of_2(hidden) <= _MAX_NORM_BLOCK


# ---------------------------------------------------------------------------------------------
# RoPE + KV-cache write


@triton.jit
def _rotate_heads(
    base_ptr,
    head_stride,
    cos1,
    sin1,
    cos2,
    sin2,
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Load one token's heads [NUM_HEADS, 2 * HALF] and rotate them in fp32 (rotate_half):

        out[:HALF] = x1 * cos[:HALF] - x2 * sin[:HALF]      x = [ x1 | x2 ]
        out[HALF:] = x2 * cos[HALF:] + x1 * sin[HALF:]

    Returns the two rotated halves, their offsets from base_ptr (first half) and the mask.
    """
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    offsets = heads * head_stride + dims
    x1 = tl.load(base_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2, offsets, mask


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    q_token_stride,
    q_head_stride,
    k_ptr,
    k_token_stride,
    k_head_stride,
    v_ptr,
    v_token_stride,
    v_head_stride,
    positions_ptr,
    cos_sin_ptr,
    cos_sin_pos_stride,
    cos_sin_kind_stride,
    k_cache_ptr,
    k_cache_slot_stride,
    k_cache_head_stride,
    v_cache_ptr,
    v_cache_slot_stride,
    v_cache_head_stride,
    slot_mapping_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: rotate its q and k heads in place, copy rotated k and v into the
    cache slot `slot_mapping[token]` unless that slot is negative.

        qkv row of a token (q, k, v are views into it; each head is [ x1 | x2 ], 2 * HALF):
          [ q head 0 .. NUM_HEADS-1 | k head 0 .. NUM_KV_HEADS-1 | v head 0 .. NUM_KV_HEADS-1 ]
        cache.view(-1, NUM_KV_HEADS, 2 * HALF)[slot] <- rotated k / v,
          slot = page * page_size + offset in page (chosen by the runner)
    """
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)

    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos1, cos2, sin1, sin2 = rope_angles(cos_sin_ptr, pos, cos_sin_pos_stride,
                                         cos_sin_kind_stride, dims, HALF)

    q_base = q_ptr + token * q_token_stride
    q1, q2, offsets, mask = _rotate_heads(
        q_base, q_head_stride, cos1, sin1, cos2, sin2, NUM_HEADS, BLOCK_HEADS, HALF, BLOCK_HALF
    )
    q_dtype = q_ptr.dtype.element_ty
    tl.store(q_base + offsets, q1.to(q_dtype), mask=mask)
    tl.store(q_base + offsets + HALF, q2.to(q_dtype), mask=mask)

    k_base = k_ptr + token * k_token_stride
    k1, k2, offsets, mask = _rotate_heads(
        k_base, k_head_stride, cos1, sin1, cos2, sin2, NUM_KV_HEADS, BLOCK_KV_HEADS, HALF,
        BLOCK_HALF,
    )
    k_dtype = k_ptr.dtype.element_ty
    tl.store(k_base + offsets, k1.to(k_dtype), mask=mask)
    tl.store(k_base + offsets + HALF, k2.to(k_dtype), mask=mask)

    # the cache gets the same values k holds now (rounded to k's dtype, then to the cache's);
    # slot -1 is a padding row of a CUDA graph: nothing to store
    if slot >= 0:
        heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]
        k_slot = k_cache_ptr + slot * k_cache_slot_stride + heads * k_cache_head_stride + dims
        k_cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_slot, to_cache(k1.to(k_dtype), k_cache_dtype, CACHE_FP8), mask=mask)
        tl.store(k_slot + HALF, to_cache(k2.to(k_dtype), k_cache_dtype, CACHE_FP8), mask=mask)

        v_row = v_ptr + token * v_token_stride + heads * v_head_stride + dims
        v_slot = v_cache_ptr + slot * v_cache_slot_stride + heads * v_cache_head_stride + dims
        v_cache_dtype = v_cache_ptr.dtype.element_ty
        v1 = tl.load(v_row, mask=mask, other=0.0)
        v2 = tl.load(v_row + HALF, mask=mask, other=0.0)
        tl.store(v_slot, to_cache(v1, v_cache_dtype, CACHE_FP8), mask=mask)
        tl.store(v_slot + HALF, to_cache(v2, v_cache_dtype, CACHE_FP8), mask=mask)


@triton.jit
def rope_angles(cos_sin_ptr, pos, pos_stride, kind_stride, dims, HALF: tl.constexpr):
    """(cos1, cos2, sin1, sin2) of position `pos` at `dims` (< HALF) of each half: cos_sin[pos]
    is [2, 2 * HALF], row 0 cos, row 1 sin (both halves equal as llama.py builds them, but each
    half is read from its own place so any table is applied exactly)."""
    dim_mask = dims < HALF
    cos_ptr = cos_sin_ptr + pos * pos_stride + dims
    sin_ptr = cos_ptr + kind_stride
    return (tl.load(cos_ptr, mask=dim_mask, other=0.0),
            tl.load(cos_ptr + HALF, mask=dim_mask, other=0.0),
            tl.load(sin_ptr, mask=dim_mask, other=0.0),
            tl.load(sin_ptr + HALF, mask=dim_mask, other=0.0))


@triton.jit
def to_cache(x, cache_dtype: tl.constexpr, FP8: tl.constexpr):
    """x in the KV cache's dtype; an fp8 cache (scale 1) saturates at +-448 first, as torch's
    reference does (engine/attention/torch_backend.py `store`), then rounds to nearest even."""
    if FP8:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_dtype)


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q and k in place by their tokens' positions and write k, v into the paged cache.

    Args:
        q: [T, num_heads, head_dim]; rotated in place.
        k: [T, num_kv_heads, head_dim]; rotated in place.
        v: [T, num_kv_heads, head_dim]; read only.
            q, k, v may be views of one qkv projection (any token/head strides, last dim
            contiguous).
        positions: [T] integer; every entry must index cos_sin, padding rows included.
        cos_sin: fp32 [max_pos, 2, head_dim], cos then sin (RotaryEmbedding.cos_sin).
        k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]; token t's k and v go
            to slot slot_mapping[t] of `cache.view(-1, num_kv_heads, head_dim)`. A
            float8_e4m3fn cache takes them with scale 1, saturated at +-448.
        slot_mapping: [T] integer; negative slots are skipped (q and k are still rotated).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
            f"[T, heads, head_dim] and [T, kv_heads, head_dim] twice"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
            f"must be [{num_tokens}]"
        )
    if cos_sin.dim() != 3 or cos_sin.shape[1:] != (2, head_dim):
        raise ValueError(f"cos_sin must be [max_pos, 2, {head_dim}], got {tuple(cos_sin.shape)}")
    expected_cache = (num_kv_heads, head_dim)
    if k_cache.shape[2:] != expected_cache or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be "
            f"[num_pages, page_size, {num_kv_heads}, {head_dim}]"
        )
    _check_last_dim_contiguous(q=q, k=k, v=v, cos_sin=cos_sin)
    if positions.stride(0) != 1 or slot_mapping.stride(0) != 1:
        raise ValueError("positions and slot_mapping must be contiguous")
    if num_tokens == 0:
        return
    # a view, not a copy: raises if the page and slot dims cannot be merged
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    _check_last_dim_contiguous(k_cache=k_slots, v_cache=v_slots)
    half = head_dim // 2
    block_heads = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(half)
    pdl = use_pdl(q)
    _rope_store_kv_kernel[(num_tokens,)](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        positions,
        cos_sin, cos_sin.stride(0), cos_sin.stride(1),
        k_slots, k_slots.stride(0), k_slots.stride(1),
        v_slots, v_slots.stride(0), v_slots.stride(1),
        slot_mapping,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HEADS=block_heads,
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        CACHE_FP8=k_cache.dtype == torch.float8_e4m3fn,
        PDL=pdl,
        num_warps=_num_warps(block_heads * block_half),
        **pdl_options(pdl),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# SiLU and mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    x_row_stride,
    out_ptr,
    out_row_stride,
    intermediate,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, block): out[row, cols] = silu(gate) * up, x[row] = [ gate | up ]."""
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))  # the formula torch's silu uses
    out = silu * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.silu(gate) * up` for x = [gate | up], into out (allocated if None).

    Args:
        x: [T, 2 * I], last dim contiguous.
        out: [T, I].
    Returns:
        out.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2 * intermediate], got {tuple(x.shape)}")
    num_rows, intermediate = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, intermediate, dtype=x.dtype, device=x.device)
    if out.shape != (num_rows, intermediate):
        raise ValueError(f"out must be [{num_rows}, {intermediate}], got {tuple(out.shape)}")
    _check_last_dim_contiguous(x=x, out=out)
    if num_rows == 0:
        return out
    block = min(triton.next_power_of_2(intermediate), _MAX_SILU_BLOCK)
    grid = (num_rows, triton.cdiv(intermediate, block))
    pdl = use_pdl(x)
    _silu_and_mul_kernel[grid](
        x, x.stride(0), out, out.stride(0), intermediate, BLOCK=block, PDL=pdl, num_warps=4,
        **pdl_options(pdl),
    )
    return out
