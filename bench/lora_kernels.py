"""The LoRA kernels alone on a GPU: the GPU time one decode step's adapter deltas add to the
base model, per kernel family and token count (issue 41's batch-1 decode target).

A CUDA graph holds one model's worth of deltas, Llama-3.1-8B's shapes (32 layers x qkv with
the norm fused in, o, gate_up with the norm, down with SiLU·mul; rank 16, 8 slots), every
token on an adapter; its replay time is what the deltas cost a step when nothing overlaps
them. Families: `bgmv` (per-token kernels, steps of up to BGMV_MAX_TOKENS tokens) and
`segmented` (tiles of up to 32 tokens sharing a slot), each with PDL on and off.

    python -m bench.lora_kernels [--tokens 1,4,16,32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.kernels import pdl
from engine.lora.kernels import lora_shrink_expand
from engine.lora.layers import LoraBatch
from engine.lora.tiles import BGMV_MAX_TOKENS

HIDDEN, INTER, RANK, SLOTS, LAYERS = 4096, 14336, 16, 8, 32
# projection: (K, slices of the output, mode: 0 plain, 1 norm fused in, 2 SiLU·mul)
PROJECTIONS = {"qkv": (HIDDEN, [4096, 1024, 1024], 1), "o": (HIDDEN, [HIDDEN], 0),
               "gate_up": (HIDDEN, [INTER, INTER], 1), "down": (INTER, [HIDDEN], 2)}


def _buffers(tokens: int, device):
    gen = torch.Generator(device=device).manual_seed(0)
    bufs = {}
    for name, (k, slices, mode) in PROJECTIONS.items():
        n = sum(slices)
        a = torch.randn(SLOTS, len(slices) * RANK, k, generator=gen, device=device) / k ** 0.5
        b = torch.randn(SLOTS, n, RANK, generator=gen, device=device) * 0.01
        width = 2 * k if mode == 2 else k
        x = torch.randn(tokens, width, generator=gen, device=device)
        bounds = [sum(slices[: i + 1]) for i in range(len(slices) - 1)]
        norm = (torch.ones(k, device=device, dtype=torch.bfloat16), 1e-5) if mode == 1 else None
        bufs[name] = (x.bfloat16(), torch.zeros(tokens, n, device=device, dtype=torch.bfloat16),
                      a.bfloat16(), b.bfloat16(), bounds, mode, norm)
    return bufs


def step_us(tokens: int, family: str, use_pdl: bool, replays: int) -> float:
    """Median microseconds of one graph replay: a decode step's LoRA deltas."""
    device = torch.device("cuda")
    pdl.configure(use_pdl)
    batch = LoraBatch(SLOTS, max(tokens, 64), device)
    batch.use_triton = True
    batch.set_slots([3] * tokens)
    slots = batch.slots if family == "bgmv" else None
    bufs = _buffers(tokens, device)

    def deltas():
        for _ in range(LAYERS):
            for x, out, a, b, bounds, mode, norm in bufs.values():
                lora_shrink_expand(x, out, a, b, batch.rows, batch.tiles, bounds, mode, norm,
                                   slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        deltas()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        deltas()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,32")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        for family in ("bgmv", "segmented"):
            if family == "bgmv" and tokens > BGMV_MAX_TOKENS:
                continue
            for use_pdl in (True, False):
                us = step_us(tokens, family, use_pdl, args.replays)
                rows.append({"tokens": tokens, "family": family, "pdl": use_pdl,
                             "step_us": us, "per_projection_us": us / (4 * LAYERS)})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
