"""Where loading a LoRA adapter's host copy goes, in a fresh process without an engine (issue
41's load target): checking the adapter (its config and its file's header), then reading its
data and packing it for the slots, layer by layer into new host tensors (read into tensors
first), or straight from the file into a slab pinned ahead of time (on CUDA; the engine's way,
engine/lora/host.py and engine/lora/layers.py), with torch's default intra-op threads and with
one.

    python bench/scripts/lora_pack_parts.py [--model random:llama-3.1-8b] [--rank 16]

The model is built on the meta device (no weights, no GPU memory): only its LoRA layers' shapes
matter. Prints one JSON line per case: milliseconds per part, the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.lora_gpu import write_random_adapter
from engine.lora.adapter import read_adapter
from engine.lora.host import Slabs
from engine.lora.layers import LoraModel
from engine.models.llama import LlamaForCausalLM
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
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    lora = LoraModel(model, config, max_loras=1, max_rank=args.rank, max_tokens=16)
    pin = torch.cuda.is_available()
    default_threads = torch.get_num_threads()
    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        for how in ("layers-new-pageable", "chunks-slab-pinned" if pin else "chunks-slab"):
            slabs, reserve_ms = None, 0.0
            if how.startswith("chunks"):
                slabs = Slabs(lora.layout, pin=pin)
                start = time.perf_counter()
                slabs.reserve(1)
                reserve_ms = (time.perf_counter() - start) * 1e3
            reads, packs = [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                weights = read_adapter("a", path, config, args.rank)
                mid = time.perf_counter()
                slab = slabs.take() if slabs is not None else None
                lora.pack(weights, slab=slab)
                if slab is not None:
                    slabs.give(slab, None)
                reads.append((mid - start) * 1e3)
                packs.append((time.perf_counter() - mid) * 1e3)
            print(json.dumps({"threads": threads, "pack_into": how,
                              "check_ms": statistics.median(reads),
                              "read_and_pack_ms": statistics.median(packs),
                              "read_and_pack_ms_first": packs[0],
                              "slab_reserve_ms": reserve_ms,
                              "slab_mb": lora.layout.pieces * lora.layout.piece_bytes / 2**20}),
                  flush=True)


if __name__ == "__main__":
    main()
