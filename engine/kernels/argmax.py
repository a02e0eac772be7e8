"""Greedy sampling's argmax over each row of the logits, in two Triton passes (docs/benchmarks.md,
"GPU: engine on H100").

torch's `argmax(dim=-1)` reduces a row in one block: over a 128,256-entry fp32 row of
Llama-3.1-8B's logits at batch 1 it took 29.6 us on an H100 (2026-11-23, `bench.engine_gpu
--only overhead1`), on the critical path between two batch-1 decode steps (the next step's input
is this token). Here the row is cut into CHUNK-entry pieces, one program each (63 programs for
128k entries): each writes its piece's maximum and the first index holding it; one program per
row then picks the first piece with the row's maximum.

Same answer as `torch.argmax` for every row without NaN, ties included (the lowest index wins).
A NaN counts as larger than any number, as in torch; a row holding both +inf and NaN before it
may differ (torch takes the NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # entries per first-pass program: 8 KB of fp32, one load per thread of 4 warps
_MAX_CHUNKS = 4096  # second-pass width: rows up to 8M entries


@triton.jit
def _chunk_max_kernel(x_ptr, max_ptr, idx_ptr, n, stride_row, num_chunks,
                      CHUNK: tl.constexpr):  # fmt: skip
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < n,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.where(x != x, float("inf"), x)  # noqa: PLR0124  (NaN: above every number, as in torch)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * CHUNK + at)


@triton.jit
def _row_argmax_kernel(max_ptr, idx_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    maxes = tl.load(max_ptr + row * num_chunks + offs, mask=offs < num_chunks,
                    other=float("-inf"))  # fmt: skip
    _, first = tl.max(maxes, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + first).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for a [B, V] tensor with a contiguous last dimension: int64 [B]."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with a contiguous last dim, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    rows, n = logits.shape
    num_chunks = triton.cdiv(n, CHUNK)
    if not 0 < num_chunks <= _MAX_CHUNKS:
        raise ValueError(f"rows of {n} entries: argmax_rows takes 1 to {_MAX_CHUNKS * CHUNK}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    maxes = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(rows, num_chunks)](logits, maxes, idx, n, logits.stride(0), num_chunks,
                                          CHUNK=CHUNK, num_warps=4)  # fmt: skip
    _row_argmax_kernel[(rows,)](maxes, idx, out, num_chunks,
                                BLOCK=triton.next_power_of_2(num_chunks), num_warps=4)  # fmt: skip
    return out
