"""The engine core's host work per step at full load, with the model taken out.

    python -m bench.engine_host [--requests 1000] [--profile] [--json out.json]
        [--max-num-batched-tokens 8192] [--max-num-seqs 256] [--input-len 128:2048]
        [--output-len 128:1024]

Runs the offline workload of `bench.engine_gpu --only offline` (inputs 128-2,048, outputs
128-1,024, ignore_eos, up to 256 running sequences, an 8,192-token step budget, a KV pool of
28,000 pages of 16 tokens: an H100's with Llama-3.1-8B) through the real EngineCore on CPU,
with the forward pass and sampling replaced by stubs that return at once. What is left is the
host's part of every step: scheduling, KV page bookkeeping and the prefix cache, building the
step's metadata (the Triton attention backend's `plan`, on CPU tensors here), resolving tokens
into outputs. On a GPU this work must fit under the GPU's step time (~20 ms for a 256-sequence
decode step of an 8B model at these contexts) or the GPU waits.

`--profile` prints where the time goes (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time

import torch

from engine.attention.triton_backend import TritonAttentionBackend
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampler import SampleResult
from microserve.messages import SamplingParams

VOCAB = 256


class _Done:
    """A sample that is already on the host."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = torch.tensor(token_ids)
        self._result = SampleResult(token_ids, [None] * len(token_ids))

    def result(self) -> SampleResult:
        return self._result


class StubRunner:
    """Stands in for ModelRunner.forward/sample: plans the step's attention metadata as the
    GPU runner does, computes nothing, and samples token 7 for every row."""

    def __init__(self, runner, backend: TritonAttentionBackend):
        self.runner, self.backend = runner, backend

    def forward(self, batch, input_ids, sample_rows, copies=(), from_last=(), sends=(), **_):
        if all(s.num_new_tokens == 1 for s in batch.seqs):
            self.backend.plan_graph(batch, len(batch.seqs))
        else:
            self.backend.plan(batch)
        return len(sample_rows) or None

    def sample(self, n, params, generators, mask=None, adjust=None):
        return _Done([7] * n)


def tiny_model(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run(n: int, profile: bool, budget: int = 8192, max_seqs: int = 256,
        input_len=(128, 2048), output_len=(128, 1024)) -> dict:
    import tempfile

    config = EngineConfig(model=tiny_model(tempfile.mkdtemp()), num_pages=28000,
                          max_num_batched_tokens=budget, max_num_seqs=max_seqs, page_size=16)
    core = EngineCore(config)
    backend = TritonAttentionBackend("cpu", 4, 2, 16, max_tokens=budget, max_seqs=max_seqs,
                                     max_pages_per_seq=4096 // 16, page_size=16)
    stub = StubRunner(core.runner, backend)
    core.runner.forward, core.runner.sample = stub.forward, stub.sample
    rng = random.Random(5)
    n_out = [rng.randint(*output_len) for _ in range(n)]
    rng = random.Random(6)
    for i, o in enumerate(n_out):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*input_len))]
        core.add_request(f"o{i}", prompt, SamplingParams(max_tokens=o, ignore_eos=True))
    prof = cProfile.Profile() if profile else None
    steps, step_ms = 0, []
    start = time.perf_counter()
    if prof:
        prof.enable()
    while core.has_work():
        t = time.perf_counter()
        core.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        steps += 1
    if prof:
        prof.disable()
    wall = time.perf_counter() - start
    core.check_integrity()
    full = sorted(step_ms[: len(step_ms) // 2])  # the first half: 256 sequences running
    out = {"requests": n, "steps": steps, "wall_s": wall, "mean_step_ms": wall / steps * 1e3,
           "median_step_ms_full_batch": full[len(full) // 2],
           "output_tokens": sum(n_out), "preemptions": core.stats().preemptions}
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--input-len", default="128:2048", help="LO:HI tokens (uniform)")
    ap.add_argument("--output-len", default="128:1024", help="LO:HI tokens (uniform)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    span = lambda text: tuple(int(x) for x in text.split(":"))  # noqa: E731
    result = run(args.requests, args.profile, args.max_num_batched_tokens, args.max_num_seqs,
                 span(args.input_len), span(args.output_len))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
