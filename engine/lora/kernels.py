"""Segmented LoRA kernels (Punica's SGMV/BGMV, S-LoRA's): shrink then expand, each program
working on one tile of tokens that share a slot, so a step pays for the adapters it uses and
base tokens cost nothing.

The tile table (`LoraBatch`, written by the host before each forward) lists each tile as
(start, length, slot) over `rows`, the step's adapter tokens grouped by slot:

    rows   [ 4 7 9 | 0 1 2 3 5 ... ]       token indices, slot 0's first, then slot 2's
    tiles  (0,3,0)   (3,32,2) (35,5,2) (0,0,-) ...   at most BLOCK_M rows each; length 0: none

    shrink  part[split, row, s*R + r] = sum over split's K of x[row] . A[slot, s*R + r]
    expand  out[row, n] += sum_r (sum_split part[split, row, s(n)*R + r]) * B[slot, n, r]

where s(n) is the slice (q, k, v of a fused qkv) that output column n belongs to. The grid is
sized from the token count alone (tiles can be at most min(T, T/BLOCK_M + slots)), so a CUDA
graph captures it; tiles past the step's are empty and return at once. Splitting K across
programs keeps batch-1 decode's shrink (one tile) spread over the GPU; the expand sums the
splits, so there are no atomics and no buffer to zero: two launches per projection. With the
RMS norm fused in (batch-1 decode), the norm is a scalar per row and commutes with the shrink:
each split multiplies x by the norm weight and adds up its own columns' squares, and the
expand scales the summed h by 1/rms. Both launch with PDL where the engine's kernels do
(engine/kernels/pdl.py), waiting first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl as _pdl
from engine.kernels.fused import rope_angles, to_cache
from engine.lora.tiles import BGMV_MAX_TOKENS, TILE_ROWS

BLOCK_M = TILE_ROWS  # tokens per tile: the host's tile table is cut to this
_BLOCK_K = 64
_BLOCK_N = 64
_TARGET_PROGRAMS = 128  # shrink programs to aim for: about one wave on an H100
# The most programs one tile's K is split over. Each split is one more load in every expand
# program's (unrolled) sum; with 16-56 splits and a loop that waited on each load in turn,
# and a pass over the whole row for the RMS norm before the shrink's own loop, batch-1
# decode with an adapter took 8.09 ms against 4.88 (H200, 2026-11-27).
_MAX_SPLITS = 8
# An expand program covers up to MAX_COL_BLOCKS blocks of output columns, so it sums the
# splits' partials once for all of them, while the grid keeps at least _EXPAND_PROGRAMS
# programs (a few waves on an H100). bench.lora_gpu --expand-col-blocks 1 sets it for an A/B.
MAX_COL_BLOCKS = 8
_EXPAND_PROGRAMS = 512
# Steps of at most BGMV_MAX_TOKENS tokens (decode) take the BGMV kernels: a program per token
# and split (shrink) or column block (expand), vector multiply-adds; K split into _BGMV_SPLITS.
_BGMV_SPLITS = 16
_BGMV_BLOCK_K = 128
_BGMV_BLOCK_N = 128


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
def _b_tile(b_ptr, slot, R, N_out, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_N output columns and the slot's B (stored [N_out, R]: one
    contiguous block of BLOCK_N * R values) over them as [BLOCK_R, BLOCK_N]: (n, n_mask, r,
    r_mask, b)."""
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N_out
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    b = tl.load(b_ptr + slot.to(tl.int64) * R * N_out + n[None, :] * R + r[:, None],
                mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    return n, n_mask, r, r_mask, b


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, part_ptr, rows_ptr, tiles_ptr, max_tiles,
                   norm_ptr, K, N, P, k_per_split, part_split_stride,
                   MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """MODE 0: x as given; 1: x is the residual stream, to be RMS-normed (batch-1 decode's
    fused norm): the program multiplies x * norm weight and adds up its columns' squares
    into part's column N, and the expand scales by 1/rms once every split's squares are in
    (no pass over the whole row first); 2: x is [gate | up], SiLU(gate) * up taken here (the
    down projection's). part's rows are P wide (N, or N + 1 for the squares)."""
    length, slot, rows, m_mask = _tile(rows_ptr, tiles_ptr, max_tiles, BLOCK_M, PDL)
    if length == 0:
        return
    split = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    x_rows = x_ptr + rows[:, None] * x_stride
    a_base = a_ptr + slot.to(tl.int64) * N * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
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
                f = v.to(tl.float32)
                squares += tl.sum(f * f, axis=1)
                w = tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                v = (f * w[None, :]).to(a_ptr.dtype.element_ty)
        a = tl.load(a_base + n[None, :] * K + k[:, None],
                    mask=n_mask[None, :] & (k[:, None] < K), other=0.0)
        acc += tl.dot(v, a, input_precision=DOT_PRECISION)
    out = part_ptr + split * part_split_stride + rows[:, None] * P
    tl.store(out + n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])
    if MODE == 1:
        tl.store(out + N, squares[:, None], mask=m_mask[:, None])


@triton.jit
def _h_slice(part_rows, part_split_stride, s, R, r, r_mask, m_mask, scale,
             SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Slice s's shrunk values of the tile's rows, every split summed (times scale):
    [BLOCK_M, BLOCK_R] fp32."""
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):  # unrolled: the loads go out together
        h += tl.load(part_rows + sp * part_split_stride + s * R + r[None, :],
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    return h * scale


@triton.jit
def _expand_kernel(part_ptr, b_ptr, out_ptr, out_stride, rows_ptr, tiles_ptr, max_tiles,
                   R, N_shrunk, P, N_out, part_split_stride, bound1, bound2, K, eps,
                   SLICES: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   COL_BLOCKS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """The tile's rows over COL_BLOCKS consecutive blocks of BLOCK_N output columns: the
    summed h of each slice is loaded once for all of them (every program re-reading the
    splits' partials was ~170 MB of L2 reads a layer in a 256-token decode step)."""
    length, slot, rows, m_mask = _tile(rows_ptr, tiles_ptr, max_tiles, BLOCK_M, PDL)
    if length == 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    part_rows = part_ptr + rows[:, None] * P
    inv_rms = tl.full([BLOCK_M, 1], 1.0, dtype=tl.float32)
    if NORM:  # every split's squares of the row: its RMS
        squares = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):  # unrolled: the loads go out together
            squares += tl.load(part_rows + sp * part_split_stride + N_shrunk,
                               mask=m_mask[:, None], other=0.0)
        inv_rms = 1.0 / tl.sqrt(squares / K + eps)
    h0 = _h_slice(part_rows, part_split_stride, 0, R, r, r_mask, m_mask, inv_rms, SPLITS,
                  BLOCK_M, BLOCK_R)
    h1 = h0
    h2 = h0
    if SLICES > 1:
        h1 = _h_slice(part_rows, part_split_stride, 1, R, r, r_mask, m_mask, inv_rms, SPLITS,
                      BLOCK_M, BLOCK_R)
    if SLICES > 2:
        h2 = _h_slice(part_rows, part_split_stride, 2, R, r, r_mask, m_mask, inv_rms, SPLITS,
                      BLOCK_M, BLOCK_R)
    b_slot = b_ptr + slot.to(tl.int64) * R * N_out
    for cb in range(COL_BLOCKS):
        n = (tl.program_id(1) * COL_BLOCKS + cb) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N_out
        b = tl.load(b_slot + n[None, :] * R + r[:, None], mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0)
        # the columns of slice s: [bound_s, bound_s+1); B's other columns are zeroed for it
        if SLICES == 1:
            acc = tl.dot(h0.to(b.dtype), b, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(h0.to(b.dtype), tl.where((n < bound1)[None, :], b, 0.0).to(b.dtype),
                         input_precision=DOT_PRECISION)
            hi1 = N_out if SLICES == 2 else bound2
            acc += tl.dot(h1.to(b.dtype),
                          tl.where(((n >= bound1) & (n < hi1))[None, :], b, 0.0).to(b.dtype),
                          input_precision=DOT_PRECISION)
            if SLICES > 2:
                acc += tl.dot(h2.to(b.dtype), tl.where((n >= bound2)[None, :], b, 0.0).to(b.dtype),
                              input_precision=DOT_PRECISION)
        out = out_ptr + rows[:, None] * out_stride + n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_shrink_kernel(x_ptr, x_stride, a_ptr, part_ptr, slots_ptr, norm_ptr, K, N, P,
                        k_per_split, part_split_stride, MODE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One token's shrink over one split of K (grid: tokens x splits), for steps of few
    tokens (decode): plain multiply-adds on vectors, no tiles, no tensor-core dot padded to
    32 rows. The modes are the segmented shrink's."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    split = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    n_mask = n < N
    x_row = x_ptr + t.to(tl.int64) * x_stride
    a_base = a_ptr + slot.to(tl.int64) * N * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        k = split * k_per_split + kk + tl.arange(0, BLOCK_K)
        k_mask = k < K
        if MODE == 2:
            gate = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + k, mask=k_mask, other=0.0).to(tl.float32)
            v = gate * tl.sigmoid(gate) * up
        else:
            v = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            if MODE == 1:
                squares += v * v
                v = v * tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_base + n[:, None] * K + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc += tl.sum(a.to(tl.float32) * v[None, :], axis=1)
    out = part_ptr + split * part_split_stride + t * P
    tl.store(out + n, acc, mask=n_mask)
    if MODE == 1:
        tl.store(out + N, tl.sum(squares, axis=0))


@triton.jit
def _bgmv_expand_kernel(part_ptr, b_ptr, out_ptr, out_stride, slots_ptr, R, N_shrunk, P, N_out,
                        part_split_stride, bound1, bound2, K, eps, SLICES: tl.constexpr,
                        SPLITS: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One token's expand into BLOCK_N output columns (grid: tokens x column blocks). The
    slot and the B tile are loaded before the PDL wait: neither is written by the kernel
    before (the slots by the host's copy, B by a slot write the step waited for), so their
    latency hides behind that kernel's last programs; part and out are read after it."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    n, n_mask, r, r_mask, b = _b_tile(b_ptr, slot, R, N_out, BLOCK_N, BLOCK_R)
    b = b.to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    part_row = part_ptr + t * P
    scale = 1.0
    if NORM:
        squares = 0.0
        for sp in tl.static_range(SPLITS):
            squares += tl.load(part_row + sp * part_split_stride + N_shrunk)
        scale = 1.0 / tl.sqrt(squares / K + eps)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SLICES):
        lo = 0 if s == 0 else (bound1 if s == 1 else bound2)
        hi = N_out if s == SLICES - 1 else (bound1 if s == 0 else bound2)
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            h += tl.load(part_row + sp * part_split_stride + s * R + r, mask=r_mask, other=0.0)
        h = h * scale
        in_slice = (n >= lo) & (n < hi)
        acc += tl.sum(tl.where(in_slice[None, :], b, 0.0) * h[:, None], axis=0)
    out = out_ptr + t.to(tl.int64) * out_stride + n
    y = tl.load(out, mask=n_mask, other=0.0).to(tl.float32) + acc
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def max_tiles(tokens: int, slots: int) -> int:
    """The most tiles `tokens` tokens over `slots` slots can make: the grid's size."""
    return min(tokens, -(-tokens // BLOCK_M) + slots)


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       rows: torch.Tensor, tiles: torch.Tensor, bounds: list[int],
                       mode: int = 0, norm: tuple[torch.Tensor, float] | None = None,
                       slots: torch.Tensor | None = None) -> None:
    """out[row] += the delta of row's slot for every row in the tile table; or, for a step
    of at most BGMV_MAX_TOKENS tokens with `slots` (each token's slot, -1 for the base, on
    the device), per token by the BGMV kernels.

    Args:
        x: [T, K] (mode 2: [T, 2K]); out: [T, N_out], its rows contiguous.
        a: [slots, S*R, K], the slices' A stacked; b: [slots, N_out, R], scale folded in.
        rows, tiles: the tile table (see the module's docstring), tiles [3, max_tiles].
        bounds: where slices 1 and 2 of out's columns start (S - 1 of them).
        norm: (weight [K], eps) with mode 1.
    """
    t = x.shape[0]
    if slots is not None and t <= BGMV_MAX_TOKENS:
        _bgmv(x, out, a, b, slots, bounds, mode, norm)
        return
    slots, n_shrunk, k = a.shape
    n_out, r = b.shape[1], b.shape[2]
    grid_tiles = max_tiles(t, slots)
    # K split over programs so a one-tile step's shrink spreads over the GPU, at most
    # _MAX_SPLITS: the expand adds the splits up in an unrolled loop
    splits, k_per_split = _k_splits(
        k, min(_MAX_SPLITS, _TARGET_PROGRAMS // grid_tiles, -(-k // 256)), _BLOCK_K)
    width = n_shrunk + (mode == 1)  # a part row: the shrunk values (and the squares)
    part = torch.empty(splits, t, width, dtype=torch.float32, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    pdl = _pdl.use_pdl(x)
    # float32 slots (a float32 engine) multiply in full precision, not TF32
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _shrink_kernel[(grid_tiles, splits)](
        x, x.stride(0), a, part, rows, tiles, tiles.shape[1], norm_weight, k, n_shrunk, width,
        k_per_split, part.stride(0), MODE=mode, BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, triton.next_power_of_2(n_shrunk)), BLOCK_K=_BLOCK_K,
        DOT_PRECISION=precision, PDL=pdl, **_pdl.launch_options(pdl))
    b1, b2 = (list(bounds) + [n_out, n_out])[:2]
    blocks = triton.cdiv(n_out, _BLOCK_N)
    col_blocks = _col_blocks(grid_tiles, blocks)
    _expand_kernel[(grid_tiles, triton.cdiv(blocks, col_blocks))](
        part, b, out, out.stride(0), rows, tiles, tiles.shape[1], r, n_shrunk, width, n_out,
        part.stride(0), b1, b2, k, eps, SLICES=len(bounds) + 1, SPLITS=splits,
        NORM=mode == 1, BLOCK_M=BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(r)), COL_BLOCKS=col_blocks,
        DOT_PRECISION=precision, PDL=pdl, **_pdl.launch_options(pdl))


def _col_blocks(grid_tiles: int, blocks: int) -> int:
    """Column blocks an expand program covers: as many as leave at least _EXPAND_PROGRAMS
    programs (a power of two, at most MAX_COL_BLOCKS), from the grid's size alone (CUDA
    graphs)."""
    want = max(1, min(MAX_COL_BLOCKS, grid_tiles * blocks // _EXPAND_PROGRAMS))
    return 1 << (want.bit_length() - 1)


def _k_splits(k: int, want: int, block: int) -> tuple[int, int]:
    """K cut into at most `want` (at least 1) splits of whole `block`s: (splits, K per split)."""
    k_per_split = -(-(-(-k // max(1, want))) // block) * block
    return -(-k // k_per_split), k_per_split


def _bgmv(x, out, a, b, slots, bounds, mode, norm) -> None:
    t = x.shape[0]
    _, n_shrunk, k = a.shape
    n_out, r = b.shape[1], b.shape[2]
    splits, k_per_split = _k_splits(k, min(_BGMV_SPLITS, -(-k // _BGMV_BLOCK_K)), _BGMV_BLOCK_K)
    width = n_shrunk + (mode == 1)
    part = torch.empty(splits, t, width, dtype=torch.float32, device=x.device)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    pdl = _pdl.use_pdl(x)
    _bgmv_shrink_kernel[(t, splits)](
        x, x.stride(0), a, part, slots, norm_weight, k, n_shrunk, width, k_per_split,
        part.stride(0), MODE=mode, BLOCK_N=max(16, triton.next_power_of_2(n_shrunk)),
        BLOCK_K=_BGMV_BLOCK_K, PDL=pdl, **_pdl.launch_options(pdl))
    b1, b2 = (list(bounds) + [n_out, n_out])[:2]
    _bgmv_expand_kernel[(t, triton.cdiv(n_out, _BGMV_BLOCK_N))](
        part, b, out, out.stride(0), slots, r, n_shrunk, width, n_out, part.stride(0), b1, b2,
        k, eps, SLICES=len(bounds) + 1, SPLITS=splits, NORM=mode == 1,
        BLOCK_N=_BGMV_BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r)), PDL=pdl,
        **_pdl.launch_options(pdl))


def lora_expand_one_row(part: torch.Tensor, out: torch.Tensor, b: torch.Tensor,
                        slots: torch.Tensor, bounds: list[int]) -> None:
    """out[0] += part @ b[slot]^T per slice, for batch-1 decode whose GEMV computed the
    shrink (part [S*R] float32, engine/kernels/gemv.py's `lora`); nothing when slots[0] is
    -1."""
    n_out, r = b.shape[1], b.shape[2]
    pdl = _pdl.use_pdl(out)
    b1, b2 = (list(bounds) + [n_out, n_out])[:2]
    _bgmv_expand_kernel[(1, triton.cdiv(n_out, _BGMV_BLOCK_N))](
        part, b, out, out.stride(0), slots, r, part.shape[0], part.shape[0], n_out, 0, b1, b2,
        1, 0.0, SLICES=len(bounds) + 1, SPLITS=1, NORM=False, BLOCK_N=_BGMV_BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(r)), PDL=pdl, **_pdl.launch_options(pdl))


@triton.jit
def _qkv_delta_rope_store_kernel(
        qkv_ptr, k_offset, v_offset, head_stride, part_ptr, b_ptr, slots_ptr, R, N_out,
        positions_ptr, cos_sin_ptr, cos_sin_pos_stride, cos_sin_kind_stride,
        k_cache_ptr, k_cache_slot_stride, k_cache_head_stride,
        v_cache_ptr, v_cache_slot_stride, v_cache_head_stride, slot_mapping_ptr,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, CACHE_FP8: tl.constexpr,
        PDL: tl.constexpr):
    """One token (batch-1 decode), one program per head of q, k and v: the head's columns of
    the qkv projection plus the adapter's expand (part [3R]: the GEMV's shrink of q, k, v;
    b [slots, N_out, R]; nothing when the token's slot is -1), rounded to the projection's
    dtype as the expand kernel stored them; then RoPE on q and k heads, and k, v into the
    cache (engine/kernels/fused.py's `_rope_store_kv_kernel`, the same numbers). Replaces the
    expand kernel and the rope kernel of the layer: one kernel boundary fewer a layer."""
    head = tl.program_id(0)
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    is_v = head >= NUM_HEADS + NUM_KV_HEADS
    s = is_k.to(tl.int32) + 2 * is_v.to(tl.int32)  # the slice: 0 q, 1 k, 2 v
    kv_head = head - NUM_HEADS - NUM_KV_HEADS * is_v.to(tl.int32)
    # where the head's values sit: q heads from the row's start, k and v from their views'
    at = tl.where(is_v, v_offset + kv_head * head_stride,
                  tl.where(is_k, k_offset + kv_head * head_stride, head * head_stride))
    col = head * 2 * HALF  # the head's first column of the fused output: q, then k, then v
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    r = tl.arange(0, BLOCK_R)
    # the slot, B and the position come from host copies or slot writes the step waited for:
    # loaded before the PDL wait (see _bgmv_expand_kernel)
    slot = tl.load(slots_ptr)
    lora = (r < R) & (r * 0 + slot >= 0)  # a vector: the interpreter takes no scalar in a mask
    b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64) * N_out * R + r[:, None]
    b_mask = lora[:, None] & dim_ok[None, :]
    b1 = tl.load(b_rows + (col + dims)[None, :] * R, mask=b_mask, other=0.0).to(tl.float32)
    b2 = tl.load(b_rows + (col + HALF + dims)[None, :] * R, mask=b_mask, other=0.0).to(tl.float32)
    pos = tl.load(positions_ptr).to(tl.int64)
    cos1, cos2, sin1, sin2 = rope_angles(cos_sin_ptr, pos, cos_sin_pos_stride,
                                         cos_sin_kind_stride, dims, HALF)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.load(part_ptr + s * R + r, mask=lora, other=0.0)
    dtype = qkv_ptr.dtype.element_ty
    x_ptr = qkv_ptr + at + dims
    x1 = tl.load(x_ptr, mask=dim_ok, other=0.0).to(tl.float32) + tl.sum(b1 * h[:, None], axis=0)
    x2 = (tl.load(x_ptr + HALF, mask=dim_ok, other=0.0).to(tl.float32)
          + tl.sum(b2 * h[:, None], axis=0))
    x1 = x1.to(dtype).to(tl.float32)  # as the expand kernel stored it
    x2 = x2.to(dtype).to(tl.float32)
    o1 = tl.where(is_v, x1, x1 * cos1 - x2 * sin1).to(dtype)  # v is not rotated
    o2 = tl.where(is_v, x2, x2 * cos2 + x1 * sin2).to(dtype)
    tl.store(x_ptr, o1, mask=dim_ok)
    tl.store(x_ptr + HALF, o2, mask=dim_ok)
    cache_slot = tl.load(slot_mapping_ptr).to(tl.int64)
    stored = (dims * 0 + cache_slot) >= 0  # vectors: the interpreter takes no scalar in a mask
    k_ok = dim_ok & stored & ((dims * 0 + is_k.to(tl.int32)) > 0)
    v_ok = dim_ok & stored & ((dims * 0 + is_v.to(tl.int32)) > 0)
    k_at = k_cache_ptr + cache_slot * k_cache_slot_stride + kv_head * k_cache_head_stride + dims
    v_at = v_cache_ptr + cache_slot * v_cache_slot_stride + kv_head * v_cache_head_stride + dims
    tl.store(k_at, to_cache(o1, k_cache_ptr.dtype.element_ty, CACHE_FP8), mask=k_ok)
    tl.store(k_at + HALF, to_cache(o2, k_cache_ptr.dtype.element_ty, CACHE_FP8), mask=k_ok)
    tl.store(v_at, to_cache(o1, v_cache_ptr.dtype.element_ty, CACHE_FP8), mask=v_ok)
    tl.store(v_at + HALF, to_cache(o2, v_cache_ptr.dtype.element_ty, CACHE_FP8), mask=v_ok)


def qkv_delta_rope_and_store_kv(part: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                positions: torch.Tensor, cos_sin: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
    """One token's q, k, v (views of one qkv row, [1, heads, head_dim]) plus the adapter's
    expand of the GEMV's shrink `part` [3R] by `b` [slots, N_out, R] (slots[0]: the token's
    slot, -1 none), rotated and stored as `rope_and_store_kv` does (engine/kernels/fused.py,
    whose arguments these are), in one kernel. The qkv columns are q's heads, then k's, then
    v's, each head_dim wide, as the fused projection lays them out."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    n_out, r = b.shape[1], b.shape[2]
    item = q.element_size()
    if (q.shape[0] != 1 or n_out != (num_heads + 2 * num_kv_heads) * head_dim
            or q.stride(1) != head_dim or k.stride(1) != head_dim or v.stride(1) != head_dim
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
            or q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected "
                         "one token's heads, contiguous views of one qkv row of "
                         f"{n_out} columns")
    k_slots = k_cache.view(-1, num_kv_heads, head_dim)
    v_slots = v_cache.view(-1, num_kv_heads, head_dim)
    half = head_dim // 2
    pdl = _pdl.use_pdl(q)
    _qkv_delta_rope_store_kernel[(num_heads + 2 * num_kv_heads,)](
        q, (k.data_ptr() - q.data_ptr()) // item, (v.data_ptr() - q.data_ptr()) // item,
        head_dim, part, b, slots, r, n_out, positions, cos_sin, cos_sin.stride(0),
        cos_sin.stride(1), k_slots, k_slots.stride(0), k_slots.stride(1),
        v_slots, v_slots.stride(0), v_slots.stride(1), slot_mapping,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_R=max(16, triton.next_power_of_2(r)),
        CACHE_FP8=k_cache.dtype == torch.float8_e4m3fn, PDL=pdl, num_warps=2,
        **_pdl.launch_options(pdl))
