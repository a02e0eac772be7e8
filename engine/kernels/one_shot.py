"""The one-shot all-reduce of a tensor-parallel decode step, as one Triton kernel.

Each rank holds a symmetric buffer (engine/tp/allreduce.py maps every rank's into every other
rank's address space, CUDA IPC over NVLink) of two halves and a flag array. A call:

1. waits for the kernel before it (programmatic dependent launch: this kernel is already
   resident while that one finishes) and lets the kernel after it launch at once, so the next
   GEMV fetches its first weight tile while this one waits for the other ranks;
2. copies the rank's message into its buffer's half for this call (calls alternate halves);
3. meets the other ranks: each program stores its call count into its flag on every other
   rank (a release at system scope), then waits until every other rank's flag holds that
   count (an acquire);
4. reads every rank's half, rank 0 first, adds in float32, rounds once, and writes the sum.

One barrier per call, where torch's `symm_mem.one_shot_all_reduce` has two (the second keeps
a rank from overwriting its buffer while another still reads it). Alternating halves makes
the second unneeded: a rank reaches call c + 2, which writes the half call c used, only past
call c + 1's barrier, which every other rank joins only after its call c kernel finished.
The flags count calls (int64: they never wrap), one per program and rank, so nothing resets
them, and a CUDA graph replays the same kernel any number of times: each program keeps its
count in `counters` on its own GPU.

Every rank sums in the same order, so all hold bit-identical results. A rank that never
arrives makes the others trap after `timeout_ns` (the CUDA context fails, the step raises,
the engine ends) instead of spinning forever.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 2048  # elements per program: 4 KiB of bf16, two 16-byte vectors per thread
NUM_WARPS = 4


@triton.jit
def _trap_if(cond):
    """End the kernel with a trap (the context fails) where cond holds."""
    if cond:
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rank_ptr(base, deltas_ptr, r):
    """Rank r's mapping of the array at `base` (this rank's): base + deltas[r] elements. The
    deltas are multiples of 8 elements (the mappings are page-aligned), which lets the copies
    and sums move 16-byte vectors."""
    return base + tl.multiple_of(tl.load(deltas_ptr + r), 8)


@triton.jit
def _one_shot_kernel(
    x_ptr, out_ptr, buf_ptr, buf_deltas_ptr, flag_ptr, flag_deltas_ptr, counters_ptr, N, half,
    rank, timeout_ns, WORLD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[i] = sum over ranks r (in rank order) of rank r's x[i], for this program's BLOCK
    elements. buf_ptr: this rank's data buffer (2 * half elements, x's dtype); flag_ptr: its
    flags ([programs, WORLD] int64); *_deltas_ptr: [WORLD] int64, where each rank's buffer
    (flags) is mapped in this process, in elements from buf_ptr (flag_ptr); counters_ptr:
    [programs] int64 on this GPU."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    count = tl.load(counters_ptr + pid) + 1
    at = (count % 2) * half + offs
    mine = _rank_ptr(buf_ptr, buf_deltas_ptr, rank)
    tl.store(mine + at, tl.load(x_ptr + offs, mask=ok), mask=ok)
    tl.debug_barrier()  # every thread's copy is written before the flag says so
    for r in tl.static_range(WORLD):
        if r != rank:
            theirs = _rank_ptr(flag_ptr, flag_deltas_ptr, r)
            tl.atomic_xchg(theirs + pid * WORLD + rank, count, sem="release", scope="sys")
    flags = _rank_ptr(flag_ptr, flag_deltas_ptr, rank)
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
            if seen < count:  # (a rank ahead may already hold count + 1)
                start = tl.extra.cuda.globaltimer()
                while seen < count:
                    _trap_if(tl.extra.cuda.globaltimer() - start > timeout_ns)
                    seen = tl.atomic_add(flags + pid * WORLD + r, 0, sem="acquire",
                                         scope="sys")  # fmt: skip
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        theirs = _rank_ptr(buf_ptr, buf_deltas_ptr, r) + at
        acc += tl.load(theirs, mask=ok, other=0.0, volatile=True).to(tl.float32)  # not L1's
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(counters_ptr + pid, count)


def programs(numel: int) -> int:
    return triton.cdiv(numel, BLOCK)
