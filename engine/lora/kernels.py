"""Segmented LoRA kernels (Punica's SGMV/BGMV, S-LoRA's): shrink then expand, each program
working on one tile of tokens that share a slot, so a step pays for the adapters it uses and
base tokens cost nothing.

The tile table (`LoraBatch`, written by the host before each forward) lists each tile as
(start, length, slot) over `rows`, the step's adapter tokens grouped by slot:

    rows   [ 4 7 9 | 0 1 2 3 5 ... ]       token indices, slot 0's first, then slot 2's
    tiles  (0,3,0)   (3,32,2) (35,5,2) (0,0,-) ...   at most BLOCK_M rows each; length 0: none

    shrink  part[split, row, s*R + r] = sum over split's K of x[row] . A[slot, s*R + r]
    expand  out[row, n] += sum_r (sum_split part[split, row, s(n)*R + r]) * B[slot, r, n]

where s(n) is the slice (q, k, v of a fused qkv) that output column n belongs to. The grid is
sized from the token count alone (tiles can be at most min(T, T/BLOCK_M + slots)), so a CUDA
graph captures it; tiles past the step's are empty and return at once. Splitting K across
programs keeps batch-1 decode's shrink (one tile) spread over the GPU; the expand sums the
splits, so there are no atomics and no buffer to zero: two launches per projection. Both
launch with PDL where the engine's kernels do (engine/kernels/pdl.py), waiting first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl as _pdl
from engine.lora.tiles import TILE_ROWS

BLOCK_M = TILE_ROWS  # tokens per tile: the host's tile table is cut to this
_BLOCK_K = 64
_BLOCK_N = 64
_TARGET_PROGRAMS = 128  # shrink programs to aim for: about one wave on an H100


@triton.jit
def _tile(rows_ptr, tiles_ptr, max_tiles, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """This program's tile: (length, slot, its rows, which of BLOCK_M are rows)."""
    if PDL:  # first, even for an empty tile: the kernels after wait for this one only
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + tile)
    length = tl.load(tiles_ptr + max_tiles + tile)
    slot = tl.load(tiles_ptr + 2 * max_tiles + tile)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < length
    rows = tl.load(rows_ptr + start + m, mask=m_mask, other=0).to(tl.int64)
    return length, slot, rows, m_mask


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, part_ptr, rows_ptr, tiles_ptr, max_tiles,
                   norm_ptr, eps, K, N, k_per_split, part_split_stride,
                   MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """MODE 0: x as given; 1: x is the residual stream, RMS-normed here (batch-1 decode's
    fused norm); 2: x is [gate | up], SiLU(gate) * up taken here (the down projection's)."""
    length, slot, rows, m_mask = _tile(rows_ptr, tiles_ptr, max_tiles, BLOCK_M, PDL)
    if length == 0:
        return
    split = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    x_rows = x_ptr + rows[:, None] * x_stride
    a_base = a_ptr + slot.to(tl.int64) * N * K
    if MODE == 1:
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            squares += tl.sum(v * v, axis=1)
        inv_rms = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        k = split * k_per_split + kk + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (k[None, :] < K)
        if MODE == 2:
            gate = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
            v = (gate * tl.sigmoid(gate) * up).to(a_ptr.dtype.element_ty)
        else:
            v = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
            if MODE == 1:
                w = tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                v = (v.to(tl.float32) * inv_rms[:, None]).to(x_ptr.dtype.element_ty)
                v = (v.to(tl.float32) * w[None, :]).to(a_ptr.dtype.element_ty)
        a = tl.load(a_base + n[None, :] * K + k[:, None],
                    mask=n_mask[None, :] & (k[:, None] < K), other=0.0)
        acc += tl.dot(v, a)
    out = part_ptr + split * part_split_stride + rows[:, None] * N + n[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_kernel(part_ptr, b_ptr, out_ptr, out_stride, rows_ptr, tiles_ptr, max_tiles,
                   R, N_shrunk, N_out, splits, part_split_stride, bound1, bound2,
                   SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    length, slot, rows, m_mask = _tile(rows_ptr, tiles_ptr, max_tiles, BLOCK_M, PDL)
    if length == 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N_out
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    b = tl.load(b_ptr + slot.to(tl.int64) * R * N_out + r[:, None] * N_out + n[None, :],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SLICES):
        # the columns of slice s: [bound_s, bound_s+1); B's other columns are zeroed for it
        lo = 0 if s == 0 else (bound1 if s == 1 else bound2)
        hi = N_out if s == SLICES - 1 else (bound1 if s == 0 else bound2)
        h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for sp in range(splits):
            h += tl.load(part_ptr + sp * part_split_stride + rows[:, None] * N_shrunk
                         + s * R + r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                         other=0.0)
        in_slice = (n >= lo) & (n < hi)
        acc += tl.dot(h.to(b.dtype), tl.where(in_slice[None, :], b, 0.0).to(b.dtype))
    out = out_ptr + rows[:, None] * out_stride + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def max_tiles(tokens: int, slots: int) -> int:
    """The most tiles `tokens` tokens over `slots` slots can make: the grid's size."""
    return min(tokens, -(-tokens // BLOCK_M) + slots)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       rows: torch.Tensor, tiles: torch.Tensor, bounds: list[int],
                       mode: int = 0, norm: tuple[torch.Tensor, float] | None = None) -> None:
    """out[row] += the delta of row's slot for every row in the tile table.

    Args:
        x: [T, K] (mode 2: [T, 2K]); out: [T, N_out], its rows contiguous.
        a: [slots, S*R, K], the slices' A stacked; b: [slots, R, N_out], scale folded in.
        rows, tiles: the tile table (see the module's docstring), tiles [3, max_tiles].
        bounds: where slices 1 and 2 of out's columns start (S - 1 of them).
        norm: (weight [K], eps) with mode 1.
    """
    t = x.shape[0]
    slots, n_shrunk, k = a.shape
    r, n_out = b.shape[1], b.shape[2]
    grid_tiles = max_tiles(t, slots)
    splits = max(1, min(_TARGET_PROGRAMS // grid_tiles, -(-k // 256)))
    k_per_split = -(-(-(-k // splits)) // _BLOCK_K) * _BLOCK_K
    splits = -(-k // k_per_split)
    part = torch.empty(splits, t, n_shrunk, dtype=torch.float32, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    pdl = _pdl.use_pdl(x)
    _shrink_kernel[(grid_tiles, splits)](
        x, x.stride(0), a, part, rows, tiles, tiles.shape[1], norm_weight, eps, k, n_shrunk,
        k_per_split, part.stride(0), MODE=mode, BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, triton.next_power_of_2(n_shrunk)), BLOCK_K=_BLOCK_K, PDL=pdl,
        **_pdl.launch_options(pdl))
    b1, b2 = (list(bounds) + [n_out, n_out])[:2]
    _expand_kernel[(grid_tiles, triton.cdiv(n_out, _BLOCK_N))](
        part, b, out, out.stride(0), rows, tiles, tiles.shape[1], r, n_shrunk, n_out, splits,
        part.stride(0), b1, b2, SLICES=len(bounds) + 1, BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(r)), PDL=pdl, **_pdl.launch_options(pdl))
