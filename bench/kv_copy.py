"""GPU KV page copy: the Triton kernel against torch indexing, alone and beside GEMMs, and the
cuda_ipc peer end to end (issue 19's page-copy target: >= 400 GB/s alone on one GPU, >= 150 GB/s
beside the forward pass with <= 2% slowdown).

    python -m bench.kv_copy [--tokens 3000] [--grids 32,66,132,264]

Layout of Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16, page size 16): a token's KV
is 128 KiB over all layers. Bandwidth counts bytes moved (read + written), each copy of a whole
prompt's KV (all layers), median of 20 after 3 warm-ups, destination slots shuffled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from kvcache.transfer import KVLayout, Window, open_peer
from kvcache.transfer.page_copy import copy_rows
from microserve.transfer_auth import transfer_key

LAYOUT = KVLayout("llama-3.1-8b", "bfloat16", 16, 32, 8, 128)


def bytes_moved(tokens: int) -> int:
    """Bytes read plus bytes written to copy `tokens` tokens' K and V of every layer."""
    return 2 * 2 * tokens * LAYOUT.num_layers * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2


def timed(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pools(tokens: int):
    pages = -(-tokens // 16) + 64
    src = torch.randn(LAYOUT.pool_shape(pages), device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    slots = torch.arange(tokens, device="cuda")
    return src, dst, slots, slots[torch.randperm(tokens, device="cuda")]


def copy_all(src, dst, s, d, grid):
    for layer in range(LAYOUT.num_layers):
        if grid is None:
            rows = (2, -1, LAYOUT.num_kv_heads * LAYOUT.head_dim)
            dst[layer].view(rows).index_copy_(1, d, src[layer].view(rows).index_select(1, s))
        else:
            copy_rows(src[layer], dst[layer], s, d, grid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--grids", default="32,66,132,264")
    args = ap.parse_args()
    src, dst, s, d = pools(args.tokens)
    nbytes = bytes_moved(args.tokens)
    out = {"device": torch.cuda.get_device_name(), "tokens": args.tokens,
           "bytes_moved": nbytes, "alone": {}, "beside_gemm": {}}
    grids = [None] + [int(g) for g in args.grids.split(",")]
    for grid in grids:
        copy_all(src, dst, s, d, grid)
        rows = (2, -1, LAYOUT.num_kv_heads * LAYOUT.head_dim)
        for layer in (0, LAYOUT.num_layers - 1):
            assert torch.equal(dst[layer].view(rows)[:, d], src[layer].view(rows)[:, s])
        sec = timed(lambda: copy_all(src, dst, s, d, grid))
        out["alone"][str(grid or "torch")] = {"ms": sec * 1e3, "GB/s": nbytes / sec / 1e9}
    # Beside GEMMs on another stream: the forward pass's kind of work.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_stream = torch.cuda.Stream()
    copy_streams = {"normal": torch.cuda.Stream(), "high": torch.cuda.Stream(priority=-1)}
    copy_stream = copy_streams["normal"]

    def gemms_with(grid, copy: bool) -> tuple[float, float]:
        """(seconds of 20 GEMMs on their stream, copy bandwidth while they ran)."""
        torch.cuda.synchronize()
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(20):
                a @ a
            done.record()
        copies, t0 = 0, time.perf_counter()
        with torch.cuda.stream(copy_stream):
            while copy and not done.query():
                copy_all(src, dst, s, d, grid)
                copy_stream.synchronize()
                copies += 1
        done.synchronize()
        return start.elapsed_time(done) / 1e3, copies * nbytes / (time.perf_counter() - t0)

    gemms_with(None, False)
    gemm_alone = statistics.median(gemms_with(None, False)[0] for _ in range(5))
    for priority, copy_stream in copy_streams.items():  # noqa: B007 (read by gemms_with)
        for grid in grids:
            gemms_with(grid, True)
            runs = [gemms_with(grid, True) for _ in range(5)]
            gemm_s = statistics.median(r[0] for r in runs)
            out["beside_gemm"][f"{grid or 'torch'}, {priority} priority"] = {
                "GB/s": statistics.median(r[1] for r in runs) / 1e9,
                "gemm_slowdown_pct": 100 * (gemm_s / gemm_alone - 1)}
        gemm_alone = statistics.median(gemms_with(None, False)[0] for _ in range(5))
    out["gemm_alone_ms"] = gemm_alone * 1e3
    out["peer"] = peer_end_to_end(args.tokens)
    print(json.dumps(out, indent=1))


RECEIVER = """
import sys, torch
from kvcache.transfer import KVLayout, make_backend
from microserve.transfer_auth import transfer_key
import json
layout = KVLayout(**json.loads(sys.argv[1]))
backend = make_backend("cuda_ipc", layout, int(sys.argv[2]), "cuda", key=transfer_key("bench"))
w = backend.open_window()
print(json.dumps({"descriptor": backend.descriptor(), "window": [w.index, w.tag]}), flush=True)
sys.stdin.read()
"""


def peer_end_to_end(tokens: int) -> dict:
    """A receiver in another process on this GPU; the sender writes every layer through the
    cuda_ipc peer, each write waiting for its copy (as the transfer thread does)."""
    pages = -(-tokens // 16) + 64
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, json.dumps(LAYOUT.to_dict()),
                             str(pages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        hello = json.loads(proc.stdout.readline())
        src = torch.randn(LAYOUT.pool_shape(pages), device="cuda").to(torch.bfloat16)
        t0 = time.perf_counter()
        peer = open_peer(hello["descriptor"], src, LAYOUT, transfer_key("bench"))
        open_s = time.perf_counter() - t0
        window = Window(*hello["window"])
        s = torch.arange(tokens, device="cuda")
        d = s[torch.randperm(tokens, device="cuda")]
        results = {}
        for grid in (32, 66, 132, 264):
            peer.num_programs = grid
            times = []
            for _ in range(8):
                t0 = time.perf_counter()
                for layer in range(LAYOUT.num_layers):
                    peer.write(window, layer, s, d)
                peer.flush(window)
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times[2:])
            results[str(grid)] = {"ms": sec * 1e3, "GB/s": bytes_moved(tokens) / sec / 1e9}
        peer.close()
        return {"open_ms": open_s * 1e3, "write_all_layers": results}
    finally:
        proc.stdin.close()
        proc.wait(30)


if __name__ == "__main__":
    main()
