"""Top-p / top-k sampling's cost: the candidates path (engine/sampler.py, TOP_CANDIDATES
tokens first) against sorting every row, on the logits a real model gives (SmolLM2-135M-
Instruct over a text, a batch of its positions), and at Llama-3's vocabulary size (the same
logits widened to 128,256 columns by Gaussian logits two standard deviations below them).

    python bench/scripts/sampler_top_p.py [--rows 1,32,128] [--device cpu|cuda]

Prints ms per `Sampler.sample` call for each path, and how many rows the candidates settled.
"""

from __future__ import annotations

import argparse
import time

import torch

import engine.sampler as sampler_module
from engine.sampler import Sampler
from microserve.messages import SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
        "those used for wine. Within fifty years, presses were running in more than two "
        "hundred European cities, and the price of books fell sharply. ") * 4


def model_logits(rows: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from microserve.model_files import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :rows + 8]
    with torch.no_grad():
        return model(ids).logits[0, 8 : 8 + rows].float()


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    base = model_logits(max(rows_list)).to(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tail = torch.randn(base.shape[0], 128256 - base.shape[1], generator=gen).to(args.device)
    wide = torch.cat([base, tail * base.std() + base.mean() - 2 * base.std()], dim=1)
    for name, logits in (("SmolLM2 (49,152)", base), ("128,256 columns", wide)):
        vocab = logits.shape[1]
        for rows in rows_list:
            x = logits[:rows].contiguous()
            params = [SamplingParams(max_tokens=1, temperature=0.6, top_p=0.9)] * rows
            sampler = Sampler(vocab, args.device, seed=0)
            sampler.candidates_first = True  # (on a GPU the engine's sampler does not, yet)
            reps = max(3, 200 // rows)

            def run():
                sampler.sample(x, params, [None] * rows)
                if args.device != "cpu":
                    torch.cuda.synchronize()

            fast = timed(run, reps)
            saved, sampler_module.TOP_CANDIDATES = sampler_module.TOP_CANDIDATES, vocab
            whole = timed(run, reps)
            sampler_module.TOP_CANDIDATES = saved
            scaled = x / 0.6
            _, settled = Sampler._nucleus_of_candidates(
                scaled, torch.full((rows,), vocab, device=x.device),
                torch.full((rows,), 0.9, device=x.device), saved)
            print(f"{name:18} rows {rows:4}: candidates {fast:8.2f} ms, whole sort {whole:8.2f} "
                  f"ms ({whole / fast:5.1f}x); settled {int(settled.sum())}/{rows}", flush=True)


if __name__ == "__main__":
    main()
