"""One Triton kernel that copies a layer's K and V rows between two KV pools (issue 19).

    copy_rows(src_layer, dst_layer, src_slots, dst_slots, num_programs)

A layer of a pool viewed as [2, slots, row] (K and V; a row is one token's `kv_heads * head_dim`
values): row `src_slots[i]` of both halves goes to row `dst_slots[i]` of the destination, which
may be another process's pool opened by CUDA IPC. A fixed grid of programs walks the 2 * n rows,
each program every `num_programs`-th one:

    row r = 2 * i + kv:   src_layer[kv, src_slots[i], :]  ->  dst_layer[kv, dst_slots[i], :]

Why not torch indexing (`index_select` + `index_copy_`): measured on the lent GPUs (DESIGN §10),
those two launches with a temporary in between were starved to 22 GB/s beside the forward pass's
GEMMs and slowed them 8%, where one copy kernel moved 180-330 GB/s beside them with no
measurable slowdown when its grid was sized right; the grid is the caller's, by measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_slots_ptr, dst_slots_ptr, n, row,
                      src_kv_stride, dst_kv_stride, NUM_PROGRAMS: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    mask = offs < row
    for r in range(tl.program_id(0), 2 * n, NUM_PROGRAMS):
        i, kv = r // 2, r % 2
        s = tl.load(src_slots_ptr + i).to(tl.int64)
        d = tl.load(dst_slots_ptr + i).to(tl.int64)
        x = tl.load(src_ptr + kv * src_kv_stride + s * row + offs, mask=mask)
        tl.store(dst_ptr + kv * dst_kv_stride + d * row + offs, x, mask=mask)


def copy_rows(src_layer: torch.Tensor, dst_layer: torch.Tensor, src_slots: torch.Tensor,
              dst_slots: torch.Tensor, num_programs: int = 132) -> None:
    """Copy K and V rows `src_slots` of `src_layer` into rows `dst_slots` of `dst_layer`.

    Args:
        src_layer, dst_layer: one layer of each pool, contiguous, `[2, pages, page_size, heads,
            head_dim]` (any shape whose first dim is K/V and whose rest is slots x row), same
            dtype and row size, on the same device.
        src_slots, dst_slots: int64 flat slot ids (page * page_size + offset), equal lengths, on
            that device.
        num_programs: the grid; fewer programs leave more of the GPU to other streams.
    """
    if src_layer.dtype != dst_layer.dtype or src_layer.device != dst_layer.device:
        raise ValueError(f"pools differ: {src_layer.dtype} on {src_layer.device} vs "
                         f"{dst_layer.dtype} on {dst_layer.device}")
    if not (src_layer.is_contiguous() and dst_layer.is_contiguous()):
        raise ValueError("copy_rows needs contiguous layers")
    n = len(src_slots)
    if n != len(dst_slots):
        raise ValueError(f"{n} source slots but {len(dst_slots)} destinations")
    row = src_layer.shape[-1] * src_layer.shape[-2]  # kv_heads * head_dim
    if dst_layer.shape[-1] * dst_layer.shape[-2] != row:
        raise ValueError(f"rows differ: {row} vs {dst_layer.shape[-1] * dst_layer.shape[-2]}")
    if n == 0:
        return
    _copy_rows_kernel[(num_programs,)](
        src_layer, dst_layer, src_slots, dst_slots, n, row,
        src_layer[0].numel(), dst_layer[0].numel(),
        NUM_PROGRAMS=num_programs, BLOCK=triton.next_power_of_2(row))
