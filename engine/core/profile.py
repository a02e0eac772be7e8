"""The prefill-time profile skip-join MLFQ places new requests by (engine/policies.py): the
engine times steps that compute prompts of a few lengths, each alone, at start-up, and fits a
line through them (FastServe profiles the first iteration's time by input length)."""

from __future__ import annotations

import random
import time

from engine.core.warmup import forget
from engine.policies import PrefillProfile
from microserve.messages import SamplingParams

PROFILE_LENGTHS = (1, 16, 64, 256, 1024, 2048)
REPEATS = 3  # the fastest of these per length: a CPU's timing is noisy


def measure_prefill(core) -> PrefillProfile:
    """Time one-token requests of PROFILE_LENGTHS (those within the step budget and a quarter
    of the KV pool) on `core`, an EngineCore, then forget them. On CUDA, after the warm-up
    (the kernels are compiled by then)."""
    vocab = core.runner.config.vocab_size
    rng = random.Random(1)
    capacity = core.kv.pool.num_pages * core.config.page_size
    limit = min(core.max_model_len - 1, capacity // 4, core.config.max_num_batched_tokens)
    lengths = sorted({min(n, limit) for n in PROFILE_LENGTHS if n <= limit} | {1, max(limit, 1)})
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    samples = []
    for n in lengths:
        best = float("inf")
        for r in range(REPEATS):
            core.add_request(f"profile-{n}-{r}", [rng.randrange(vocab) for _ in range(n)], params)
            start = time.perf_counter()
            while core.has_work():
                core.step()
            best = min(best, time.perf_counter() - start)
        samples.append((n, best))
    forget(core)
    return PrefillProfile.fit(samples)
