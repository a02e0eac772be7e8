"""A synthetic batch input file with shared prefixes and mixed lengths (docs/batches.md).

    python -m bench.batch_workload --lines 10000 --out batch.jsonl [--vocab 128000]

Two kinds of line, shuffled together so that file order has no locality:

- few-shot: one of --templates long templates (512-2048 tokens) and a question (32-256 tokens),
  answered briefly (16-64 tokens): compute-heavy, most of the prompt shared.
- multi-turn: turn k of one of many conversations is its history so far (each turn 64-256
  tokens) plus a new message, answered at length (256-1024 tokens): memory-heavy, its prefix
  shared with the same conversation's earlier turns.

With --documents F, a share F of the lines is a third kind, and the rest split as above:

- document: one task instruction (64 tokens, the same in every such line) and a document of
  its own (1024-4096 tokens), answered briefly (16-64 tokens): compute-heavy, nearly all of
  the prompt computed (a batch of classifications or summaries).

Prompts are token ids (`/v1/completions` with `prompt: [ids]`), so lengths are exact for any
model, and `ignore_eos` makes each answer exactly its max_tokens. Deterministic for a --seed.
"""

from __future__ import annotations

import argparse
import json
import random


def workload(lines: int, templates: int, vocab: int, seed: int, scale: int = 1,
             documents: float = 0.0) -> list[dict]:
    """`scale`: every length divided by it (16 makes a file a CPU runs in minutes);
    `documents`: the share of document lines (0: the file of the two kinds alone, as before)."""
    if not 0.0 <= documents <= 1.0:
        raise ValueError(f"documents {documents} must be a share in [0, 1]")
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(rng.randint(lo // scale, hi // scale))]

    def length(lo: int, hi: int) -> int:
        return max(1, rng.randint(lo // scale, hi // scale))

    shots = [ids(512, 2048) for _ in range(templates)]
    docs = round(lines * documents)
    requests = []
    for _ in range((lines - docs) // 2):
        requests.append((rng.choice(shots) + ids(32, 256), length(16, 64)))
    while len(requests) < lines - docs:
        history = ids(64, 256)
        for _ in range(min(rng.randint(2, 6), lines - docs - len(requests))):
            history = history + ids(64, 256)
            requests.append((history, length(256, 1024)))
    if docs:
        task = ids(64, 64)
        requests += [(task + ids(1024, 4096), length(16, 64)) for _ in range(docs)]
    rng.shuffle(requests)
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": prompt, "max_tokens": out, "temperature": 0,
                      "ignore_eos": True}}
            for i, (prompt, out) in enumerate(requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32_000, help="token ids drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=1, help="divide every length by this")
    ap.add_argument("--documents", type=float, default=0.0,
                    help="share of the lines that are documents (compute-heavy; 0: none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "w") as f:
        for line in workload(args.lines, args.templates, args.vocab, args.seed, args.scale,
                             args.documents):
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
