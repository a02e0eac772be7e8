"""Paged attention in Triton: split-KV decode (flash-decoding) and prefill/extend.

Both kernels read the KV layout of `kvcache.paged`, one layer at a time:

    k_cache, v_cache = kv[layer, 0], kv[layer, 1]    # [num_pages, page_size, kv_heads, head_dim]
    key at position t of sequence b:  k_cache[page_table[b, t // page_size], t % page_size, kvh]

K/V of the step's own tokens are already in the cache. The cache is q's dtype or float8 e4m3
(`--kv-cache-dtype fp8`, scale 1): each K/V tile is widened as it is read, and with a bf16 q both
dots then run in fp16 (`_compute_dtype`). Keys are gathered token by token through
the page table (page_size is a constexpr power of two, so `//` and `%` are shifts), so a tile of
BLOCK_N keys may span several pages (or part of one) and any page size works.

Query head h reads KV head h // group (group = heads / kv_heads, Hugging Face `repeat_kv`).
Scores are scaled by `scale * log2(e)` and exponentiated with exp2; every LSE below is base 2.

Decode: `paged_decode_attention`, one query token per sequence
-------------------------------------------------------------
Grid (batch, kv_heads, num_splits). A program holds the whole GQA group of its KV head as the
rows of its query tile, so each K/V tile is loaded once for the group. The group is padded to
GROUP_PAD = max(16, next_pow2(group)) rows because `tl.dot` needs M >= 16: decode is bound by
memory (each K/V byte is used `group` times), so the wasted tensor-core rows cost nothing, while
the alternative, an elementwise [group, BLOCK_N, head_dim] fp32 product, is 128 KiB per program
at group 4 with 64-key tiles (256 registers a thread at 4 warps): it would spill.

Each sequence's keys are cut into BLOCK_N tiles and the tiles are dealt out evenly to splits:

    kv_len = 300, BLOCK_N = 64, num_splits = 3:   num_blocks = cdiv(300, 64) = 5,
                                                  blocks_per_split = cdiv(5, 3) = 2
    keys    0         64        128       192       256    300
            |   b0    |   b1    |   b2    |   b3    | b4 |
    split   |      0            |      1            |  2 |      (a split past kv_len is empty)

A split runs online softmax (fp32) over its tiles and writes, for each head of the group,
o_s = sum_j 2^(s_j - m) v_j / l_s and lse_s = m + log2(l_s) into the fp32 workspace
[batch, heads, num_splits, head_dim + 1] (column head_dim holds lse_s; an empty split writes
o_s = 0, lse_s = -inf). The merge kernel, grid (batch, heads), combines the splits:

    LSE = log2(sum_s 2^lse_s)        out = sum_s 2^(lse_s - LSE) * o_s       (cast to q's dtype)

With num_splits == 1 the split kernel writes the normalized output straight into `out`: no
workspace, no merge launch (the large-batch case). `choose_num_splits` picks the split count.

Extend: `paged_extend_attention`, packed prefill chunks over a cached prefix
------------------------------------------------------------------------------
Grid (heads, cdiv(max_q_len, BLOCK_M), sequences): one program is BLOCK_M consecutive query
tokens of one sequence and one head (heads vary fastest so the heads sharing a KV head run side
by side and share its tiles through L2; the heaviest query tiles, the last ones, start first).
Query i of a sequence with q_len new tokens and kv_len keys sits at position
ctx + i, ctx = kv_len - q_len, and sees keys 0 .. ctx + i:

    keys   0                                              kv_len
           |------------ cached prefix (ctx) ------------|--- new tokens (q_len) ---|
    tile   rows at positions p_first = ctx + m_start .. p_last
           [ full tiles: no mask     )[ diagonal tiles: causal mask )  skipped (above diagonal)
           0                  full_end                    p_last + 1
           full_end = (p_first + 1) // BLOCK_N * BLOCK_N: tiles every row sees entirely.

Both phases use the same inner loop (`_attend_tiles`): tl.dot for Q K^T and P V, fp32
accumulators, the running max/sum rescaled per tile. With num_stages=3 Triton software-pipelines
the gather (checked by compiling for sm_90 with triton 3.9: page ids are loaded a stage ahead,
K/V tiles double-buffered through cp.async, wgmma for BLOCK_M >= 64, no register spills).

Launch parameters
-----------------
`TileConfig` holds a kernel's tiles, warps, pipeline depth and optional register cap;
`decode_config` / `extend_config` give the defaults, and every wrapper takes a `config` to
override them (`python -m bench.kernel_sweep` times candidates on a GPU). How many programs
share an SM decides how much of one program's softmax overlaps another's matrix work. Compiled
for sm_90 with triton 3.6 at head_dim 128, the extend kernel with BLOCK_M 128, BLOCK_N 64 and
8 warps takes 173 registers a thread: one program per SM; capped at 128 (`maxnreg`, the
default since it measured 29% faster) two fit.

CUDA-graph safety
-----------------
The wrappers read only shapes, strides and Python arguments on the host; kv_lens, page tables
and cu_seqlens are read by the kernels on the device, and lengths beyond a sequence's end are
masked or skipped there, so no host sync (`.item()`, `.tolist()`) and no Python branch on tensor
values. The grid depends only on shapes and the static num_splits / max_q_len. Given `out` (and
the decode workspace when num_splits > 1) they allocate nothing. Call each shape once before
capture so that Triton compiles outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import launch_options as pdl_options
from engine.kernels.pdl import use_pdl

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 64  # one decode tile: a split shorter than that is all overhead
MAX_SPLITS = 64


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one paged-attention kernel.

    block_n: keys per tile; block_m: query rows per program (extend only; decode's rows are the
    GQA group); num_warps, num_stages: Triton's; maxnreg: a register cap per thread (None: the
    compiler's choice), which trades spills for more programs per SM. All powers of two >= 16
    for the blocks.
    """

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 0
    maxnreg: int | None = None

    def launch_options(self) -> dict:
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        return opts


def decode_config(head_dim: int, kv_fp8: bool = False) -> TileConfig:
    """Default decode launch: 64-key tiles (32 above head_dim 128), 4 warps, 3 stages.

    Over an fp8 cache (kv_fp8), 2 warps and 5 stages: on an H100 at head_dim 128, batch 128 at
    context 1,024 took 116 us a layer against 138 us with the 16-bit defaults
    (`bench/scripts/fp8_kv_tiles.py`, 2026-11-24; docs/benchmarks.md, "fp8 KV cache")."""
    if kv_fp8 and head_dim <= 128:
        return TileConfig(block_n=64, num_warps=2, num_stages=5)
    return TileConfig(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=3)


def extend_config(head_dim: int, max_q_len: int, kv_fp8: bool = False) -> TileConfig:
    """Default extend launch: query tiles no taller than the longest chunk needs (16/64/128
    rows), 64-key tiles (32 above head_dim 128), 8 warps for 128-row tiles, 3 stages.

    128-row tiles at head_dim <= 128 cap registers at 128 a thread, so two programs share an
    SM (uncapped: 173 registers, one): on an H100 at head_dim 128 (`bench.kernel_sweep`,
    2026-11-23) 8 x 4,096 tokens took 2.63 ms against 3.39 ms uncapped (SDPA on contiguous KV:
    2.01 ms); the compiler spills 16 bytes for it, and it was the fastest launch at every
    extend shape swept."""
    block_m = 16 if max_q_len <= 16 else 64 if max_q_len <= 64 else 128
    if kv_fp8 and block_m == 128 and head_dim <= 128:
        # Over an fp8 cache each K/V tile is widened to fp16 in registers: 4 warps without a
        # register cap measured fastest (H100, 8 x 4,096: 3.35 ms against 4.19 ms with the
        # 16-bit launch below; 2.51 ms for a bf16 cache)
        return TileConfig(block_n=64, num_warps=4, num_stages=3, block_m=128)
    capped = block_m >= 128 and head_dim <= 128
    return TileConfig(block_n=64 if head_dim <= 128 else 32, num_warps=8 if block_m >= 128 else 4,
                      num_stages=3, block_m=block_m, maxnreg=128 if capped else None)  # fmt: skip


@triton.jit
def _compute_dtype(q, FP16_DOTS: tl.constexpr):
    """q in the dtype both dots run in. FP16_DOTS (a bf16 q over an fp8 cache): fp16, into
    which e4m3 widens in one instruction on sm_89+ (to bf16 it goes through fp32, which made
    the decode kernel conversion-bound: 145 us a layer at batch 128 against 95 for the bytes).
    A bf16 q is exact in fp16 from 2^-14 to 65,504 (clamped there; the attention probabilities,
    also fp16 then, keep 3 bits more than in bf16)."""
    if FP16_DOTS:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, k_ptr, v_ptr, table_row, stride_kp, stride_ks, stride_vp, stride_vs,
    lo, hi, pos_m, qk_scale,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the query tile `q` over keys lo .. hi-1 (lo a multiple of BLOCK_N).

    k_ptr / v_ptr already point at this program's KV head. EVEN: every key of every tile is
    < hi (no end mask). CAUSAL: row r sees key n only when n <= pos_m[r].
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        if EVEN:
            page = tl.load(table_row + offs_n // PAGE_SIZE)
        else:
            page = tl.load(table_row + offs_n // PAGE_SIZE, mask=in_range, other=0)
        page = page.to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k_offs = page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :]
        v_offs = page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :]
        if EVEN:
            k = tl.load(k_ptr + k_offs)
        else:
            k = tl.load(k_ptr + k_offs, mask=in_range[:, None], other=0.0)
        k = k.to(q.dtype)  # an fp8 cache widens to q's (compute) dtype; else a no-op
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # unscaled scores
        if CAUSAL:
            s = tl.where((offs_n[None, :] <= pos_m[:, None]) & in_range[None, :], s, float("-inf"))
        elif not EVEN:
            s = tl.where(in_range[None, :], s, float("-inf"))
        # Every row has a finite score in the first tile it meets, so m_new is finite here.
        # The scale is applied to the row max and inside exp2's argument (one FMA per score,
        # not a multiply and a subtract); qk_scale > 0, so max(s) * qk_scale = max(s * qk_scale).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN:
            v = tl.load(v_ptr + v_offs)
        else:
            v = tl.load(v_ptr + v_offs, mask=in_range[:, None], other=0.0)
        v = v.to(q.dtype)
        # P V accumulates into the rescaled acc (the tensor cores' accumulator), not into a
        # fresh zero tile added afterwards: one [rows, head_dim] fp32 tile fewer in registers.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, kv_lens_ptr, ws_ptr, out_ptr, qk_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_tb, stride_wb, stride_wh, stride_ws, stride_ob, stride_oh, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    blocks_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, kv_len)  # hi <= lo: empty split

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kvh * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None], other=0.0,
    )
    q = _compute_dtype(q, FP16_DOTS)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh,
        table_ptr + b * stride_tb, stride_kp, stride_ks, stride_vp, stride_vs,
        lo, hi, m_i, qk_scale, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, False, DOT_PRECISION,
    )  # pos_m (m_i here) is unused without CAUSAL
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT_OUT:
        out_offs = b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        base = ws_ptr + b * stride_wb + heads * stride_wh + split * stride_ws
        tl.store(base[:, None] + offs_d[None, :], o, mask=row_mask[:, None])
        lse = m_i + tl.log2(tl.where(empty, 1.0, l_i))  # an empty split keeps m_i = -inf
        tl.store(base + HEAD_DIM, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    ws_ptr, out_ptr, stride_wb, stride_wh, stride_ws, stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # wait for the previous kernel, then let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits
    base = ws_ptr + b * stride_wb + h * stride_wh + offs_s * stride_ws
    lse = tl.load(base + HEAD_DIM, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # kv_len 0: all splits empty
    weight = tl.exp2(lse - lse_max)
    total = tl.sum(weight, 0)
    weight = weight / tl.where(total == 0.0, 1.0, total)
    o = tl.load(base[:, None] + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    merged = tl.sum(o * weight[:, None], 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty))


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, cu_seqlens_ptr, kv_lens_ptr, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    h = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (last) query tiles first
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    m_start = m_block * BLOCK_M
    if m_start >= q_len:
        return
    ctx = tl.load(kv_lens_ptr + seq) - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=row_mask[:, None], other=0.0,
    )
    q = _compute_dtype(q, FP16_DOTS)
    pos_m = ctx + offs_m
    pos_first = ctx + m_start
    pos_last = ctx + tl.minimum(m_start + BLOCK_M, q_len) - 1
    full_end = (pos_first + 1) // BLOCK_N * BLOCK_N

    kvh = h // GROUP
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    table_row = table_ptr + seq * stride_tb
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head, v_head, table_row, stride_kp, stride_ks, stride_vp, stride_vs,
        0, full_end, pos_m, qk_scale, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, False, DOT_PRECISION,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_head, v_head, table_row, stride_kp, stride_ks, stride_vp, stride_vs,
        full_end, pos_last + 1, pos_m, qk_scale, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, True,
        DOT_PRECISION,
    )
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None],
    )


def choose_num_splits(
    batch: int, max_kv_len_capacity: int, num_kv_heads: int, num_sms: int = 132
) -> int:
    """Splits per sequence for decode: enough (batch * kv_heads * splits) programs to cover
    every SM once, but no split shorter than MIN_TOKENS_PER_SPLIT keys of the longest context
    the caller plans for. 1 once batch * kv_heads alone fills the GPU.

    Static per CUDA graph: pass the graph's batch size and the longest context it serves.
    """
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    by_length = triton.cdiv(max(max_kv_len_capacity, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(triton.cdiv(num_sms, programs), by_length, MAX_SPLITS))


def decode_workspace(
    batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> torch.Tensor:
    """The fp32 split workspace of `paged_decode_attention`: partial outputs and their LSE."""
    return torch.empty(batch, num_heads, num_splits, head_dim + 1, dtype=torch.float32,
                       device=device)


def _check_common(q, k_cache, v_cache, page_table, kv_lens, out) -> tuple[int, int, int]:
    """Shape/dtype checks (host metadata only). Returns (group, head_dim, page_size)."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [pages, page_size, kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.dim() != 3 or q.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q must be [tokens, heads, {head_dim}] with heads a multiple of "
                         f"kv_heads={num_kv_heads}, got {tuple(q.shape)}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q: {tuple(q.shape)} {q.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if v_cache.dtype != k_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"k_cache and v_cache must both be q's dtype or float8_e4m3fn: q "
                         f"{q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    if page_table.dtype != torch.int32 or kv_lens.dtype != torch.int32:
        raise ValueError(f"page_table and kv_lens must be int32, got {page_table.dtype}, "
                         f"{kv_lens.dtype}")
    return num_heads // num_kv_heads, head_dim, page_size


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16


def _fp16_dots(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the dots run in fp16 (`_compute_dtype`): a bf16 q over an fp8 cache."""
    return q.dtype == torch.bfloat16 and k_cache.dtype == torch.float8_e4m3fn


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV (the token's own K/V
    included, already written).

    Args:
        q: [batch, heads, head_dim]; out: same shape and dtype, written.
        k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim] of one layer.
        page_table: int32 [batch, max_pages]; entries past a sequence's kv_len are not read.
        kv_lens: int32 [batch], keys per sequence (>= 1).
        workspace: fp32 [batch, heads, num_splits, head_dim + 1] (`decode_workspace`); needed
            when num_splits > 1, allocated here when None.
        num_splits: splits per sequence; None takes workspace.shape[2], else
            `choose_num_splits` over the page table's capacity.
        config: tiles and launch options (block_m unused); None: `decode_config`'s for
            head_dim and the cache's dtype.
    Returns:
        out.
    """
    group, head_dim, page_size = _check_common(q, k_cache, v_cache, page_table, kv_lens, out)
    config = config or decode_config(head_dim, k_cache.dtype == torch.float8_e4m3fn)
    batch, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_splits is None:
        num_splits = workspace.shape[2] if workspace is not None else choose_num_splits(
            batch, page_table.shape[1] * page_size, num_kv_heads)
    if num_splits > 1:
        if workspace is None:
            workspace = decode_workspace(batch, num_heads, head_dim, num_splits, q.device)
        expected = (batch, num_heads, num_splits, head_dim + 1)
        if tuple(workspace.shape) != expected or workspace.dtype != torch.float32:
            raise ValueError(f"workspace must be fp32 {expected}, got {tuple(workspace.shape)} "
                             f"{workspace.dtype}")
    ws = workspace if num_splits > 1 else out  # unused by the kernel when DIRECT_OUT
    pdl = use_pdl(q)
    ws_strides = ws.stride()[:3] if num_splits > 1 else (0, 0, 0)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, ws, out, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        page_table.stride(0), *ws_strides, out.stride(0), out.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_N=config.block_n, DIRECT_OUT=num_splits == 1,
        DOT_PRECISION=_dot_precision(q.dtype), FP16_DOTS=_fp16_dots(q, k_cache), PDL=pdl,
        **config.launch_options(),
        **pdl_options(pdl),
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            workspace, out, *ws_strides, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits), PDL=pdl,
            num_warps=4, **pdl_options(pdl),
        )
    return out


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over each sequence's cached prefix plus themselves.

    Args:
        q: [tokens, heads, head_dim], sequence after sequence; out: same shape and dtype.
        k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim] of one layer, holding the
            new tokens' K/V already.
        page_table: int32 [seqs, max_pages].
        cu_seqlens_q: int32 [seqs + 1], sequence s owns rows cu[s] .. cu[s+1]-1 of q.
        kv_lens: int32 [seqs], prefix + new tokens; new token i of s sits at position
            kv_lens[s] - q_len_s + i.
        max_q_len: a bound on the new tokens of any sequence (sizes the grid; host int).
        config: tiles and launch options; None: `extend_config`'s for head_dim, max_q_len
            and the cache's dtype.
    Returns:
        out.
    """
    group, head_dim, page_size = _check_common(q, k_cache, v_cache, page_table, kv_lens, out)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape[0] != kv_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must be int32 [seqs + 1] = [{kv_lens.shape[0] + 1}], "
                         f"got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    num_seqs, num_heads = kv_lens.shape[0], q.shape[1]
    if num_seqs == 0 or max_q_len <= 0:
        return out
    config = config or extend_config(head_dim, max_q_len, k_cache.dtype == torch.float8_e4m3fn)
    grid = (num_heads, triton.cdiv(max_q_len, config.block_m), num_seqs)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, cu_seqlens_q, kv_lens, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), page_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, DOT_PRECISION=_dot_precision(q.dtype),
        FP16_DOTS=_fp16_dots(q, k_cache), **config.launch_options(),
    )
    return out
