"""Host <-> device copy rate of the host KV tier's layout (engine/host_swap.py), each way,
against copying every page's fragments one by one.

    python -m bench.host_copy --device cuda --pages 16,64,256 --repeats 10 [--programs 16,32,64]

The GPU pool is the engine's, layer-major: one page is `layers x 2` fragments (Llama-3.1-8B,
16-token pages, bf16: 64 fragments of 32 KiB). Two ways to move `n` pages, scattered over the
pool as a sequence's pages are:

  kernel-N   HostSwap's on a GPU: its copy kernel (engine/kernels/host_pages.py) on a grid of N
             programs, straight between the pool and the pinned host pages (--programs).
  staged     HostSwap's: one gather on the device into a page-major staging buffer, then one
             DMA per run of adjacent host pages (the host pool is page-major); the reverse in.
  fragments  one DMA per fragment straight between the pool and a layer-major host buffer.

Each line is `way method pages MiB GB/s` (the median of --repeats); on CPU the same code times
plain memory copies. The host buffers are pinned on CUDA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine.host_swap import HostSwap

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, setup=lambda: None) -> float:
    """The median seconds of `fn` (after an untimed `setup` each time), the first call a
    warm-up (allocations, the first DMA)."""
    times = []
    for _ in range(repeats + 1):
        setup()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _time_swaps(swap: HostSwap, pages: list[int], device: torch.device,
                repeats: int) -> tuple[float, float]:
    """The median seconds of `swap`'s copy of `pages` out (waited for), and back in."""
    def copy_out():
        swap.swap_out("s", pages, len(pages) * swap.tier.page_size)
        swap.settle_out("s")

    out_s = _time(copy_out, device, repeats, setup=lambda: swap.release("s"))
    in_s = _time(lambda: swap.swap_in("s", pages), device, repeats,
                 setup=lambda: (swap.release("s"), copy_out()))
    swap.release("s")
    return out_s, in_s


def measure(args, n: int, gpu_kv: torch.Tensor, rng: random.Random) -> list[str]:
    device = gpu_kv.device
    pages = rng.sample(range(gpu_kv.shape[2]), n)
    memory_gb = (n + 1) * (gpu_kv[:, :, 0].numel() * gpu_kv.element_size()) / 2**30
    rows = []
    programs = [int(k) for k in args.programs.split(",") if k] if device.type == "cuda" else []
    for k in [0, *programs]:
        swap = HostSwap(gpu_kv, memory_gb=memory_gb, copy_programs=k)
        out_s, in_s = _time_swaps(swap, pages, device, args.repeats)
        method = f"kernel-{k}" if k else "staged"
        rows += [("out", method, out_s), ("in", method, in_s)]
    nbytes = n * swap.page_bytes
    frags = torch.empty((gpu_kv.shape[0], 2, n, *gpu_kv.shape[3:]), dtype=gpu_kv.dtype,
                        pin_memory=device.type == "cuda")
    cuda = device.type == "cuda"

    def fragments(to_host: bool):
        for layer in range(gpu_kv.shape[0]):
            for kv in range(2):
                for i, p in enumerate(pages):
                    if to_host:
                        frags[layer, kv, i].copy_(gpu_kv[layer, kv, p], non_blocking=cuda)
                    else:
                        gpu_kv[layer, kv, p].copy_(frags[layer, kv, i], non_blocking=cuda)

    frag_out = _time(lambda: fragments(True), device, args.repeats)
    frag_in = _time(lambda: fragments(False), device, args.repeats)
    mib = nbytes / 2**20
    rows += [("out", "fragments", frag_out), ("in", "fragments", frag_in)]
    return [f"{way:4s} {method:9s} {n:6d} {mib:9.1f} {nbytes / s / 1e9:8.2f}"
            for way, method, s in rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=32)  # Llama-3.1-8B's KV shape
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=_DTYPES)
    ap.add_argument("--pool-pages", type=int, default=1024, help="the GPU pool's pages")
    ap.add_argument("--pages", default="16,64", help="pages per copy, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--programs", default="16,32,64",
                    help="the copy kernel's grids to time (CUDA), comma-separated")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu_kv = torch.zeros((args.layers, 2, args.pool_pages, args.page_size, args.kv_heads,
                          args.head_dim), dtype=_DTYPES[args.dtype], device=device)
    rng = random.Random(0)
    print("way  method     pages       MiB     GB/s", flush=True)
    for n in (int(x) for x in args.pages.split(",")):
        if not 1 <= n <= args.pool_pages:
            ap.error(f"--pages: {n} must be in [1, --pool-pages {args.pool_pages}]")
        for row in measure(args, n, gpu_kv, rng):
            print(row, flush=True)


if __name__ == "__main__":
    main()
