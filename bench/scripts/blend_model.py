"""What a batch's order can gain on one engine: a model of its steps (issue 42's blend target).

    python -m bench.scripts.blend_model --lines 10000 --scale 4 --templates 256 [--documents 0.2]

It builds bench/batch_workload.py's file, orders it as the router can (router/batches/order.py:
file order, the density-sorted DFS, BlendServe's blend, and `alternate`: the sorted DFS taken
one line from each end in turn, the dual scanner with a count in place of the paper's memory
shares) and runs each order through a model of one engine's step loop: lines start in order
as `--seats` free up (the router keeps that many in flight); each step decodes every sequence
whose prompt is done and fills the rest of `--budget` tokens with prompt chunks, oldest first
(the step with a prompt's last chunk samples its first token); a prompt's tokens that an
earlier line's prompt shares are cached (a cache that holds everything: the orders part on
compute and memory, not on what the pool keeps). A step takes the roofline of its work, since
a GPU step reads the weights once while it computes its prompt chunk:

    step = max(read_s + per_seq_s * decodes + per_ctx_token_s * context tokens read,
               per_token_s * (prompt tokens + decodes))

(defaults: an H100 and Llama-3.1-8B in bf16, from docs/benchmarks.md: 16 GB of weights at
~3 TB/s, 128 KiB of KV a token, ~40k prompt tokens/s). It prints each order's output
tokens/s and the ratios blend / DFS, blend / file and alternate / DFS: what reordering can gain
when nothing else differs, before what the real engine loses (attention's cost growing with
the context, the pool evicting what a long run no longer holds).
"""

from __future__ import annotations

import argparse
import bisect
from dataclasses import dataclass

from bench.batch_workload import workload
from router.batches.order import alternate, blend_order


@dataclass
class Roofline:
    read_s: float = 5.5e-3  # the weights, once a step
    per_seq_s: float = 15e-6  # a decoding sequence's own work (sampling, its row)
    per_ctx_token_s: float = 45e-9  # a context token's KV read by a decode
    per_token_s: float = 25e-6  # a token through the GEMMs

    def step(self, decodes: int, context: int, prompt: int) -> float:
        return max(self.read_s + self.per_seq_s * decodes + self.per_ctx_token_s * context,
                   self.per_token_s * (prompt + decodes))


def _common(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cached_tokens(prompts: list[list[int]], order: list[int]) -> list[int]:
    """For each line in `order`, the tokens of its prompt some earlier line's prompt shares
    (the longest common prefix with any of them: one of its neighbours in sorted order)."""
    seen: list[tuple] = []
    out = [0] * len(prompts)
    for i in order:
        p = tuple(prompts[i])
        k = bisect.bisect_left(seen, p)
        out[i] = max([_common(p, seen[j]) for j in (k - 1, k) if 0 <= j < len(seen)],
                     default=0)
        seen.insert(k, p)
    return out


def run(prompts: list[list[int]], outputs: list[int], order: list[int], seats: int,
        budget: int, model: Roofline) -> float:
    """Seconds to run every line in `order` (see the module's docstring)."""
    cached = cached_tokens(prompts, order)
    todo = list(reversed(order))  # next line to start at the end
    running: list[list[int]] = []  # [prompt tokens left, outputs left, context]
    clock = 0.0
    while todo or running:
        while todo and len(running) < seats:
            i = todo.pop()
            # the last prompt token is computed even when all is cached (its logits)
            running.append([max(1, len(prompts[i]) - cached[i]), outputs[i], len(prompts[i])])
        decoding = [r for r in running if r[0] == 0]
        room = budget - len(decoding)
        prompt, done = 0, []
        for r in running:
            if r[0] and room > 0:
                take = min(r[0], room)
                r[0] -= take
                room -= take
                prompt += take
                if not r[0]:
                    done.append(r)
        clock += model.step(len(decoding), sum(r[2] for r in decoding), prompt)
        for r in decoding + done:  # a prompt's last chunk samples its first token
            r[1] -= 1
            r[2] += 1
        running = [r for r in running if r[1] > 0]
    return clock


def compare(lines: int, templates: int, scale: int, documents: float, seats: int, budget: int,
            seed: int, model: Roofline) -> dict:
    rows = workload(lines, templates, 128_000, seed, scale, documents=documents)
    prompts = [r["body"]["prompt"] for r in rows]
    outputs = [r["body"]["max_tokens"] for r in rows]
    ordering = blend_order(prompts, outputs)
    out = {"output_tokens": sum(outputs)}
    for name, order in (("file", list(range(lines))), ("dfs", ordering.dfs),
                        ("blend", ordering.order), ("alternate", alternate(ordering.dfs))):
        seconds = run(prompts, outputs, order, seats, budget, model)
        out[name] = {"seconds": seconds, "output_tokens_per_s": sum(outputs) / seconds}
    out["blend_vs_dfs"] = out["dfs"]["seconds"] / out["blend"]["seconds"]
    out["blend_vs_file"] = out["file"]["seconds"] / out["blend"]["seconds"]
    out["alternate_vs_dfs"] = out["dfs"]["seconds"] / out["alternate"]["seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--documents", type=float, default=0.0,
                    help="bench/batch_workload.py's --documents (share of document lines)")
    ap.add_argument("--seats", type=int, default=256, help="lines in flight at once")
    ap.add_argument("--budget", type=int, default=2048, help="tokens a step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    r = compare(args.lines, args.templates, args.scale, args.documents, args.seats,
                args.budget, args.seed, Roofline())
    for name in ("file", "dfs", "blend", "alternate"):
        print(f"{name:9s} {r[name]['seconds']:9.1f} s  {r[name]['output_tokens_per_s']:9.0f} "
              "output tokens/s")
    print(f"blend / dfs {r['blend_vs_dfs']:.3f}x   blend / file {r['blend_vs_file']:.3f}x   "
          f"alternate / dfs {r['alternate_vs_dfs']:.3f}x")


if __name__ == "__main__":
    main()
