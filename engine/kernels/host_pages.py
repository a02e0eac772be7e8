"""KV pages between the GPU pool and the pinned host pool, copied by a Triton kernel with a small
fixed grid that reads and writes host memory directly (the host KV tier, engine/host_swap.py).

    copy_host_pages(gpu_kv, host, pages, to_host, num_programs)   # pages: [GPU ids, host ids]

Layouts as engine/host_swap.py's: the GPU pool `[layer, K|V, page, slot, head, dim]`, the host
pool `[page, layer, K|V, slot, head, dim]` (pinned). A page is `layers x 2` fragments, each one
contiguous block on either side (`slot x head x dim` values, 32 KiB for Llama-3.1-8B), so the
copy is a list of fragment-to-fragment moves; a fixed grid of programs walks them, each program
every `num_programs`-th, a block of every fragment at a time.

Why a kernel and not the staged copy (a gather on the device, then a DMA per run of host pages):
it needs no staging buffer and no copy engine, its grid bounds the SMs it takes from the step
beside it, and it copies as fast (H200: 48-50 GB/s each way at 16 programs, against 45-50
staged). Beside a decode step a copy costs what its rate over PCIe costs (8-9% slower steps
at 16 programs, as for the staged copies' DMAs alone at the same rate; 2.5% at 4 programs, 1%
at 2), so HostSwap gives copies beside steps a narrower grid than copies the GPU waits for
(docs/benchmarks.md, "What slows a decode step beside the host tier's copies"). The host memory
is reached over PCIe through unified addressing (a pinned allocation is mapped into the
device's address space), so the kernel's loads and stores on it are the transfer.

On CPU (tests; Triton's interpreter, TRITON_INTERPRET=1) the same kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# values of a fragment moved per program and iteration: 8 KiB of bf16, 16 bytes per thread of
# 4 warps per load, several loads of host memory in flight per program
BLOCK = 4096

# the kernel moves bits, not numbers: each pool is viewed as integers of its element's size, so
# any KV dtype (bf16, fp16, fp32, fp8) takes the same path
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# The page count varies with every copy: specialised (a value of 1, or divisible by 16), a copy of
# a new kind would compile a variant in the middle of serving. The page ids come as one tensor
# (GPU ids, then host ids) so that no pointer's alignment varies with the count either.
@triton.jit(do_not_specialize=["n", "total"])
def _copy_fragments_kernel(gpu_ptr, host_ptr, pages_ptr, n, total,
                           pool_pages, fragment, layer_pairs,
                           TO_HOST: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    for f in range(tl.program_id(0), total, NUM_PROGRAMS):
        i, j = f // layer_pairs, f % layer_pairs  # page i of the list; j = layer * 2 + K|V
        g = tl.load(pages_ptr + i).to(tl.int64)
        h = tl.load(pages_ptr + n + i).to(tl.int64)
        gpu_at = (j.to(tl.int64) * pool_pages + g) * fragment
        host_at = (h * layer_pairs + j) * fragment
        for start in range(0, fragment, BLOCK):
            at = start + offs
            mask = at < fragment
            if TO_HOST:
                tl.store(host_ptr + host_at + at, tl.load(gpu_ptr + gpu_at + at, mask=mask),
                         mask=mask)
            else:
                tl.store(gpu_ptr + gpu_at + at, tl.load(host_ptr + host_at + at, mask=mask),
                         mask=mask)


def copy_host_pages(gpu_kv: torch.Tensor, host: torch.Tensor, pages: torch.Tensor,
                    to_host: bool, num_programs: int = 32) -> None:
    """Copy GPU pages `pages[0]` to host pages `pages[1]` (`to_host`), or the reverse, on the
    current stream.

    Args:
        gpu_kv: the GPU pool, `[layers, 2, pages, page_size, heads, head_dim]`, contiguous.
        host: the host pool, `[pages, layers, 2, page_size, heads, head_dim]`, contiguous, the
            same dtype (pinned on CUDA: the kernel reaches it through unified addressing).
        pages: `[2, n]` int64 page ids on gpu_kv's device, contiguous: the GPU pages, then
            the host pages, pairwise.
        num_programs: the grid; fewer programs leave more of the GPU to the steps beside it.
    """
    if gpu_kv.dim() != 6 or host.dim() != 6 or host.shape[1:3] != gpu_kv.shape[0:2] or (
            host.shape[3:] != gpu_kv.shape[3:]) or host.dtype != gpu_kv.dtype:
        raise ValueError(f"pools differ: GPU {tuple(gpu_kv.shape)} {gpu_kv.dtype}, host "
                         f"{tuple(host.shape)} {host.dtype}")
    if not (gpu_kv.is_contiguous() and host.is_contiguous()):
        raise ValueError("copy_host_pages needs contiguous pools")
    if gpu_kv.is_cuda and not host.is_pinned():
        raise ValueError("the host pool must be pinned for a GPU to reach it")
    if pages.dim() != 2 or pages.shape[0] != 2 or not pages.is_contiguous() or (
            pages.dtype != torch.int64):
        raise ValueError(f"pages must be a contiguous [2, n] int64 tensor (GPU ids, host ids), "
                         f"got {pages.dtype} {tuple(pages.shape)}")
    n = pages.shape[1]
    if n == 0:
        return
    bits = _BITS.get(gpu_kv.element_size())
    if bits is None:
        raise ValueError(f"no copy kernel for {gpu_kv.dtype} ({gpu_kv.element_size()} bytes)")
    layer_pairs = gpu_kv.shape[0] * 2
    _copy_fragments_kernel[(num_programs,)](
        gpu_kv.view(bits), host.view(bits), pages, n, n * layer_pairs, gpu_kv.shape[2],
        gpu_kv[0, 0, 0].numel(), layer_pairs,
        TO_HOST=to_host, NUM_PROGRAMS=num_programs, BLOCK=BLOCK)
