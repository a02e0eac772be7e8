"""One Triton kernel that copies K and V rows between two KV pools, over any run of layers
(docs/benchmarks.md, "GPU: KV page copy for `cuda_ipc`").

    copy_rows(src_layers, dst_layers, src_slots, dst_slots, num_programs)

A run of layers of a pool viewed as [layers, 2, slots, row] (K and V; a row is one token's
`kv_heads * head_dim` values): row `src_slots[i]` of every layer's K and V goes to row
`dst_slots[i]` of the destination, which may be another process's pool opened by CUDA IPC. A
fixed grid of programs walks the layers * 2 * n rows, each program every `num_programs`-th:

    r = (layer * n + i) * 2 + kv:   src[layer, kv, src_slots[i]] -> dst[layer, kv, dst_slots[i]]

A GPU sender copies a whole step's KV with one launch (all layers, after the step's last layer wrote
its KV; see CudaIpcPeer): at one launch per layer the Python launches, one per layer and send, cost
more host time than the copies cost GPU time (docs/benchmarks.md, "GPU: KV page copy for
`cuda_ipc`").

Why not torch indexing (`index_select` + `index_copy_`): measured on an H100 (docs/benchmarks.md),
those two launches with a temporary in between were starved to 22 GB/s beside the forward pass's
GEMMs and slowed them 8%, where one copy kernel moved 180-330 GB/s beside them with no
measurable slowdown when its grid was sized right; the grid is the caller's, by measurement.
Why not the copy engines (`cudaMemcpyAsync`, no SMs): on one H100 (`bench.kv_copy
--beside-forward`, 2026-11-24) a step's pages as 64 contiguous memcpys moved 67-256 GB/s beside
the engine's prefill, where this kernel moved 460-1,070 GB/s in the same place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The row counts vary with every send. Specialised (Triton's default: a value of 1, or divisible by
# 16), each send of a new kind compiled a variant while the sender's step waited: three on the
# first P/D requests of a run (two H200s, 2026-11-27), which were TTFT's p99 at concurrency 1.
# `warm_up` compiles the one variant at start-up.
@triton.jit(do_not_specialize=["n", "total"])
def _copy_rows_kernel(src_ptr, dst_ptr, src_slots_ptr, dst_slots_ptr, n, total, width,
                      src_row, dst_row, src_col, dst_col,
                      src_layer_stride, dst_layer_stride, src_kv_stride, dst_kv_stride,
                      NUM_PROGRAMS: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BLOCK)[None, :]
    for first in range(tl.program_id(0) * ROWS, total, NUM_PROGRAMS * ROWS):
        r = first + tl.arange(0, ROWS)  # ROWS independent rows in flight per program
        ok = r < total
        pair, kv = r // 2, (r % 2).to(tl.int64)
        layer, i = (pair // n).to(tl.int64), pair % n
        s = tl.load(src_slots_ptr + i, mask=ok, other=0).to(tl.int64)
        d = tl.load(dst_slots_ptr + i, mask=ok, other=0).to(tl.int64)
        src = src_ptr + layer * src_layer_stride + kv * src_kv_stride + s * src_row + src_col
        dst = dst_ptr + layer * dst_layer_stride + kv * dst_kv_stride + d * dst_row + dst_col
        mask = ok[:, None] & (cols < width)
        tl.store(dst[:, None] + cols, tl.load(src[:, None] + cols, mask=mask), mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_slots: torch.Tensor,
              dst_slots: torch.Tensor, num_programs: int = 132, rows_at_once: int = 4,
              src_heads: range | None = None, dst_heads: range | None = None) -> None:
    """Copy K and V rows `src_slots` of `src` into rows `dst_slots` of `dst`.

    Args:
        src, dst: one layer of each pool, `[2, pages, page_size, heads, head_dim]`, or runs of
            as many layers (`pool[a:b]`); same dtype and row size, on the same device, each
            layer contiguous.
        src_slots, dst_slots: int64 flat slot ids (page * page_size + offset), equal lengths, on
            that device.
        num_programs: the grid; fewer programs leave more of the GPU to other streams.
        rows_at_once: rows each program moves per iteration (a power of two). One row (2 KiB
            for Llama-3.1-8B) at a time leaves the copy bound by memory latency.
        src_heads, dst_heads: copy only these KV heads of each row, as many on each side
            (pools of tensor-parallel engines split differently, kvcache/transfer/tp_peer.py);
            None: all of them.
    """
    if src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"pools differ: {src.dtype} on {src.device} vs "
                         f"{dst.dtype} on {dst.device}")
    if src.dim() not in (5, 6) or src.dim() != dst.dim() or src.shape[0] != dst.shape[0]:
        raise ValueError(f"need one layer [2, pages, page_size, heads, head_dim] of each pool "
                         f"or runs of as many layers: {tuple(src.shape)} vs {tuple(dst.shape)}")
    if src.dim() == 5:  # one layer
        src, dst = src.unsqueeze(0), dst.unsqueeze(0)
    if not (src[0].is_contiguous() and dst[0].is_contiguous()):
        raise ValueError("copy_rows needs contiguous layers")
    n = len(src_slots)
    if n != len(dst_slots):
        raise ValueError(f"{n} source slots but {len(dst_slots)} destinations")
    dim = src.shape[-1]
    src_heads = src_heads if src_heads is not None else range(src.shape[-2])
    dst_heads = dst_heads if dst_heads is not None else range(dst.shape[-2])
    if dst.shape[-1] != dim or len(src_heads) != len(dst_heads) or not (
            0 <= src_heads.start < src_heads.stop <= src.shape[-2]
            and 0 <= dst_heads.start < dst_heads.stop <= dst.shape[-2]):
        raise ValueError(f"rows differ: heads {src_heads} of {tuple(src.shape[-2:])} vs heads "
                         f"{dst_heads} of {tuple(dst.shape[-2:])}")
    width = len(src_heads) * dim
    if n == 0 or src.shape[0] == 0:
        return
    _copy_rows_kernel[(num_programs,)](
        src, dst, src_slots, dst_slots, n, src.shape[0] * 2 * n, width,
        src.shape[-2] * dim, dst.shape[-2] * dim, src_heads.start * dim, dst_heads.start * dim,
        src.stride(0), dst.stride(0), src[0, 0].numel(), dst[0, 0].numel(),
        NUM_PROGRAMS=num_programs, ROWS=rows_at_once, BLOCK=triton.next_power_of_2(width))


def warm_up(pool: torch.Tensor, num_programs: int, rows_at_once: int) -> None:
    """Compile the kernel a sender of `pool` (`[layers, 2, pages, page_size, heads, head_dim]`,
    all its layers) launches with this grid, before any request: copy slot 0 of every layer
    onto itself (its values unchanged), and wait for it."""
    slot = torch.zeros(1, dtype=torch.int64, device=pool.device)
    copy_rows(pool, pool, slot, slot, num_programs, rows_at_once)
    if pool.is_cuda:
        torch.cuda.synchronize(pool.device)
