"""Where loading a LoRA adapter's host copy goes, in a fresh process without an engine (issue
41's load target): reading and checking the file, then packing it for the slots into new
tensors (pinned or not) or into a slab pinned ahead of time (engine/lora/host.py), with torch's
default intra-op threads and with one.

    python bench/scripts/lora_pack_parts.py [--model random:llama-3.1-8b] [--rank 16]

Prints one JSON line per case: milliseconds per part, the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.lora_gpu import write_random_adapter
from engine.lora.adapter import module_shapes, read_adapter
from engine.lora.host import Layout, Slabs
from engine.lora.layers import _SLICES, LoraBatch, LoraLinear, _view
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    config = ModelConfig.from_dir(resolve_model(args.model))
    path = Path(tempfile.mkdtemp()) / "adapter"
    write_random_adapter(path, config, args.rank, seed=1)
    shapes = module_shapes(config)
    batch = LoraBatch(1, 16, torch.device("cpu"))
    projs = {}
    for name, modules in _SLICES.items():
        outs = [shapes[m][1] for m in modules]
        base = nn.Linear(shapes[modules[0]][0], sum(outs), bias=False, device="meta",
                         dtype=torch.bfloat16)
        projs[name] = LoraLinear(base, batch, outs, args.rank)  # slots on "meta": no memory
    layout = Layout([math.prod(s) * 2 for _ in range(config.num_layers)
                     for p in projs.values() for s in p.packed_shapes()])
    pin = torch.cuda.is_available()
    default_threads = torch.get_num_threads()

    def pack(weights, how: str, slabs: Slabs | None):
        slab = slabs.take() if slabs is not None else None
        places = iter(layout.places)
        for i in range(config.num_layers):
            for name, proj in projs.items():
                if slab is not None:
                    into = tuple(_view(slab, *next(places), s, torch.bfloat16)
                                 for s in proj.packed_shapes())
                else:
                    into = tuple(torch.empty(s, dtype=torch.bfloat16,
                                             pin_memory=how == "new-pinned")
                                 for s in proj.packed_shapes())
                proj.pack([weights.weights.get((i, m)) for m in _SLICES[name]], weights.scale,
                          into)
        if slabs is not None:
            slabs.give(slab, None)

    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        for how in (["new-pageable", "new-pinned", "slab-pinned"] if pin
                    else ["new-pageable", "slab-pageable"]):
            slabs = None
            reserve_ms = 0.0
            if how.startswith("slab"):
                slabs = Slabs(layout, pin=pin)
                start = time.perf_counter()
                slabs.reserve(1)
                reserve_ms = (time.perf_counter() - start) * 1e3
            reads, packs = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                weights = read_adapter("a", path, config, args.rank)
                mid = time.perf_counter()
                pack(weights, how, slabs)
                reads.append((mid - start) * 1e3)
                packs.append((time.perf_counter() - mid) * 1e3)
            print(json.dumps({"threads": threads, "pack_into": how, "pinned": pin,
                              "read_ms": statistics.median(reads),
                              "pack_ms": statistics.median(packs), "pack_ms_first": packs[0],
                              "slab_reserve_ms": reserve_ms,
                              "slab_mb": layout.pieces * layout.piece_bytes / 2**20}),
                  flush=True)


if __name__ == "__main__":
    main()
