"""GPU KV page copy: the Triton kernel against torch indexing, alone and beside GEMMs, and the
cuda_ipc peer end to end (docs/benchmarks.md, "GPU: KV page copy for `cuda_ipc`"; the target: >= 400
GB/s alone on one GPU, >= 150 GB/s beside the forward pass with <= 2% slowdown).

    python -m bench.kv_copy [--tokens 3000] [--grids 66,132,264] [--rows 1,2,4,8]
    python -m bench.kv_copy --beside-forward random:llama-3.1-8b [--step-tokens 512,2048]
        [--grids 16,32,66,132] [--rows 4,8,16]
    python -m bench.kv_copy --receiver-device cuda:1 [--grids 16,32,66,132] [--rows 8]

The third form times the cuda_ipc peer alone (one `write_layers` of every layer and its flush,
no engine, no RPC) into a receiver process's pool on another GPU: the copy kernel across NVLink,
what an engine's copy of cached pages costs beneath its calls (issue 37).

The second form is the target's own measurement: the engine's real forward pass of a prefill
step (ModelRunner, CUDA graphs as the engine runs them) on the default stream, and one step's
copy (all layers, one launch, as a cuda_ipc sender queues it when a step's last layer is
written) on a transfer stream launched with it, into a second pool on the same GPU. Per
configuration and step size: the copy's own time (events on its stream) as bandwidth, and the
forward pass's time against the same pass alone, alternated so clocks and drift hit both.

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
from kvcache.transfer.auth import transfer_key

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


def copy_all(src, dst, s, d, config):
    """Copy every layer's rows `s` to `d`: `config` is "torch" (index ops per layer), (grid,
    rows_at_once, "layer") for one Triton launch per layer, (grid, rows_at_once, "step") for one
    launch over all layers (what a cuda_ipc sender does per step)."""
    if config == "torch":
        rows = (2, -1, LAYOUT.num_kv_heads * LAYOUT.head_dim)
        for layer in range(LAYOUT.num_layers):
            dst[layer].view(rows).index_copy_(1, d, src[layer].view(rows).index_select(1, s))
        return
    grid, at_once, unit = config
    if unit == "step":
        copy_rows(src, dst, s, d, grid, at_once)
    else:
        for layer in range(LAYOUT.num_layers):
            copy_rows(src[layer], dst[layer], s, d, grid, at_once)


def name(config) -> str:
    return config if config == "torch" else "{}: {} programs x {} rows".format(
        "one launch per layer" if config[2] == "layer" else "one launch, all layers", *config[:2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--step-tokens", default="512",
                    help="beside GEMMs / the forward pass: the tokens of one step (its copy), "
                         "comma-separated")
    ap.add_argument("--grids", default="66,132,264")
    ap.add_argument("--rows", default="1,2,4,8", help="rows each program moves at once")
    ap.add_argument("--beside-forward", metavar="MODEL",
                    help="measure beside this model's real prefill steps instead")
    ap.add_argument("--repeat", type=int, default=15, help="beside the forward pass: pairs")
    ap.add_argument("--priorities", default="normal",
                    help="beside the forward pass: the copy stream's priorities (normal,high)")
    ap.add_argument("--receiver-device", default=None, metavar="cuda:N",
                    help="only the cuda_ipc peer end to end, with the receiver's pool on this "
                         "GPU (another of this host: the copy across NVLink), at --grids and "
                         "the largest of --rows")
    args = ap.parse_args()
    if args.receiver_device:
        grids = tuple(int(g) for g in args.grids.split(","))
        rows = max(int(r) for r in args.rows.split(","))
        print(json.dumps({"device": torch.cuda.get_device_name(), "tokens": args.tokens,
                          "bytes_moved": bytes_moved(args.tokens),
                          "peer": peer_end_to_end(args.tokens, grids, args.receiver_device,
                                                  rows)}, indent=1))
        return
    if args.beside_forward:
        print(json.dumps(beside_forward(args), indent=1))
        return
    src, dst, s, d = pools(args.tokens)
    nbytes = bytes_moved(args.tokens)
    out = {"device": torch.cuda.get_device_name(), "tokens": args.tokens,
           "bytes_moved": nbytes, "alone": {}, "beside_gemm": {}}
    grids, at_once = [int(g) for g in args.grids.split(",")], [int(r) for r in args.rows.split(",")]
    configs = ["torch", (132, 1, "layer"), (132, 4, "layer")] + [
        (g, r, "step") for g in grids for r in at_once]
    rows = (2, -1, LAYOUT.num_kv_heads * LAYOUT.head_dim)
    for config in configs:
        dst.zero_()
        copy_all(src, dst, s, d, config)
        for layer in (0, LAYOUT.num_layers - 1):
            assert torch.equal(dst[layer].view(rows)[:, d], src[layer].view(rows)[:, s])
        sec = timed(lambda: copy_all(src, dst, s, d, config))
        out["alone"][name(config)] = {"ms": sec * 1e3, "GB/s": nbytes / sec / 1e9}
    # Beside GEMMs on another stream (the forward pass's kind of work): one step's copy after
    # another, as fast as they go: harsher than an engine, which copies once per step.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    step = int(args.step_tokens.split(",")[0])
    step_s, step_d, step_bytes = s[:step], d[:step], bytes_moved(step)

    def gemms_with(config) -> tuple[float, float]:
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
            while config is not None and not done.query():
                copy_all(src, dst, step_s, step_d, config)
                copy_stream.synchronize()
                copies += 1
        done.synchronize()
        return start.elapsed_time(done) / 1e3, copies * step_bytes / (time.perf_counter() - t0)

    gemms_with(None)
    for config in ["torch", (132, 1, "layer")] + [(g, r, "step") for g in grids
                                                  for r in (1, max(at_once))]:
        alone = statistics.median(gemms_with(None)[0] for _ in range(5))  # adjacent: no drift
        gemms_with(config)
        runs = [gemms_with(config) for _ in range(5)]
        gemm_s = statistics.median(r[0] for r in runs)
        out["beside_gemm"][name(config)] = {
            "GB/s": statistics.median(r[1] for r in runs) / 1e9,
            "gemm_ms": gemm_s * 1e3, "gemm_alone_ms": alone * 1e3,
            "gemm_slowdown_pct": 100 * (gemm_s / alone - 1)}
    out["peer"] = peer_end_to_end(args.tokens)
    print(json.dumps(out, indent=1))


def beside_forward(args) -> dict:
    """The copy of one step's KV beside the next step's forward pass (module docstring)."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner, resolve_dtype
    from kvcache.forward import ForwardBatch, SeqForward
    from microserve.model_files import resolve_model

    steps = [int(t) for t in args.step_tokens.split(",")]
    config = EngineConfig(model=str(resolve_model(args.beside_forward)), device="cuda",
                          max_num_batched_tokens=max(steps), num_pages=64 + 3 * max(steps) // 16)
    runner = ModelRunner(config, resolve_dtype("auto", "cuda"))
    runner.allocate_kv(config.num_pages, 4 * max(steps))
    pool = runner.kv.kv  # [layers, 2, pages, page_size, kv_heads, head_dim]
    dst = torch.zeros_like(pool)
    vocab = runner.config.vocab_size
    grids, at_once = [int(g) for g in args.grids.split(",")], [int(r) for r in args.rows.split(",")]
    out = {"device": torch.cuda.get_device_name(), "model": args.beside_forward,
           "date": time.strftime("%Y-%m-%d"), "pool": list(pool.shape), "steps": {}}
    streams = [(p, torch.cuda.Stream(priority=-1 if p == "high" else 0))
               for p in args.priorities.split(",")]
    for step in steps:
        pages = step // 16
        batch = ForwardBatch([SeqForward("s", 0, step, list(range(pages)))], 16)
        ids = torch.randint(vocab, (step,)).tolist()
        # the previous step's tokens live in other pages; the copy shuffles them into D's pool
        s = torch.arange(step, 2 * step, device="cuda")
        d = torch.randperm(2 * step, device="cuda")[:step] + step
        nbytes = 2 * 2 * step * pool.shape[0] * pool[0, 0, 0, 0].numel() * pool.element_size()

        def forward():
            runner.forward(batch, ids, [])

        def memcpy():
            """The copy engines' way (cudaMemcpyAsync, no SMs): a step's pages are one run
            per layer and K/V here, so 2 x layers contiguous copies."""
            p0, n = step // 16, step // 16
            for layer in range(pool.shape[0]):
                for kv in (0, 1):
                    dst[layer, kv, p0 + n:p0 + 2 * n].copy_(pool[layer, kv, p0:p0 + n])

        def one(copy, stream):
            """(forward seconds, copy seconds or None) of one forward with `copy` beside it."""
            torch.cuda.synchronize()
            f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if copy is not None:  # queued first, so its host time does not delay the forward
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    c0.record()
                    copy()
                    c1.record()
            f0.record()
            forward()
            f1.record()
            torch.cuda.synchronize()
            return (f0.elapsed_time(f1) / 1e3,
                    None if copy is None else c0.elapsed_time(c1) / 1e3)

        for _ in range(5):
            forward()
        copy_rows(pool, dst, s, d, 132, 4)
        rows_view = (2, -1, pool.shape[-2] * pool.shape[-1])
        for layer in (0, pool.shape[0] - 1):
            assert torch.equal(dst[layer].view(rows_view)[:, d], pool[layer].view(rows_view)[:, s])
        configs = [(f"{g} programs x {r} rows", (lambda g=g, r=r: copy_rows(pool, dst, s, d, g, r)))
                   for g in grids for r in at_once] + [("cudaMemcpyAsync per layer and K/V", memcpy)]
        results = {}
        for label, copy in configs:
            for prio, stream in streams:
                copy_alone = timed(copy, 5)
                pairs = [(one(None, None)[0], one(copy, stream)) for _ in range(args.repeat)]
                fwd_alone = statistics.median(p[0] for p in pairs)
                fwd_with = statistics.median(p[1][0] for p in pairs)
                copy_s = statistics.median(p[1][1] for p in pairs)
                results[f"{label}, {prio} priority"] = {
                    "copy_ms": copy_s * 1e3, "GB/s": nbytes / copy_s / 1e9,
                    "copy_alone_GB/s": nbytes / copy_alone / 1e9,
                    "forward_ms": fwd_with * 1e3, "forward_alone_ms": fwd_alone * 1e3,
                    "slowdown_pct": 100 * (fwd_with / fwd_alone - 1)}
        out["steps"][str(step)] = {"bytes_moved": nbytes, "configs": results}
        print(json.dumps({step: results}), flush=True, file=sys.stderr)
    return out


RECEIVER = """
import sys, torch
from kvcache.transfer import KVLayout, make_backend
from kvcache.transfer.auth import transfer_key
import json
layout = KVLayout(**json.loads(sys.argv[1]))
backend = make_backend("cuda_ipc", layout, int(sys.argv[2]), sys.argv[3], key=transfer_key("bench"))
w = backend.open_window()
print(json.dumps({"descriptor": backend.descriptor(), "window": [w.index, w.tag]}), flush=True)
sys.stdin.read()
"""


def peer_end_to_end(tokens: int, grids: tuple[int, ...] = (66, 132, 264),
                    receiver_device: str = "cuda", rows_at_once: int = 8) -> dict:
    """A receiver in another process, on this GPU or `receiver_device` (another GPU of this
    host: its pool mapped here by CUDA IPC with peer access, as between two engines); the
    sender writes every layer through the cuda_ipc peer in one `write_layers` and flushes (as
    the transfer thread does): the copy kernel, its wait and the window's lock, no engine."""
    pages = -(-tokens // 16) + 64
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, json.dumps(LAYOUT.to_dict()),
                             str(pages), receiver_device], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
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
        peer.rows_at_once = rows_at_once
        for grid in grids:
            peer.num_programs = grid
            times = []
            for _ in range(8):
                t0 = time.perf_counter()
                peer.write_layers(window, range(LAYOUT.num_layers), s, d)
                peer.flush(window)
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times[2:])
            results[str(grid)] = {"ms": sec * 1e3, "GB/s": bytes_moved(tokens) / sec / 1e9}
        peer.close()
        return {"receiver": receiver_device, "open_ms": open_s * 1e3,
                "rows_at_once": rows_at_once, "write_all_layers": results}
    finally:
        proc.stdin.close()
        proc.wait(30)


if __name__ == "__main__":
    main()
