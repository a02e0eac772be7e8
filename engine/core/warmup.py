"""Warm-up: serve a few start-up requests so Triton compiles before the first real request."""

from __future__ import annotations

import random
import time

from microserve.messages import SamplingParams

# The start-up requests' prompt lengths, each alone in a step: one per extend tile height
# the kernels pick by the longest chunk (16 / 64 / 128 query rows) and a long prompt; then
# a batch over a prompt-only step's token budget (a chunk over its own prefix) with
# sampled rows beside greedy ones; then each length again, arriving while two requests decode
# (a mixed step). On an H100 each first request of such a shape waited ~1 s for Triton's
# compiles without it (docs/benchmarks.md).
WARMUP_LENGTHS = (10, 40, 300, 1024)


def warm_up(core, lengths: tuple[int, ...] = WARMUP_LENGTHS) -> float:
    """Serve the start-up requests on `core` (an EngineCore; random prompts, 3 tokens each,
    and two that decode while the mixed steps' prompts arrive), then forget them: their cached pages are dropped and the counters zeroed. Returns the
    seconds it took."""
    start = time.monotonic()
    vocab = core.runner.config.vocab_size
    rng = random.Random(0)
    capacity = core.kv.pool.num_pages * core.config.page_size
    limit = min(core.max_model_len, capacity // 4)  # a small pool: short prompts
    fits = [n for n in lengths if n + 3 <= limit] or [max(1, limit - 3)]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=20,
                             logprobs=2, seed=0, ignore_eos=True)  # its own generator
    mid = fits[min(2, len(fits) - 1)]
    over = core.config.max_prefill_step_tokens // mid + 1  # past a prompt-only step's budget
    batch = [(mid, greedy)] * max(1, min(over, core.config.max_num_seqs - 2,
                                         capacity // (2 * (mid + 3))))
    batch += [(fits[0], sampled)] * 2

    def add(name: str, n: int, params: SamplingParams) -> None:
        core.add_request(name, [rng.randrange(vocab) for _ in range(n)], params)

    for r, requests in enumerate([[(n, greedy)] for n in fits] + [batch]):
        for i, (n, params) in enumerate(requests):
            add(f"warmup-{r}-{i}", n, params)
        while core.has_work():
            core.step()
    # Mixed steps: prompts arriving while others decode (what a server meets under steady
    # traffic), one per prompt length, each beside the decoding rows.
    decoding = SamplingParams(max_tokens=4 + 3 * len(fits), temperature=0.0, ignore_eos=True)
    for i in range(2):
        add(f"warmup-mixed-decode-{i}", fits[0], decoding)
    for i, n in enumerate(fits):
        for _ in range(2):  # the decoders' prefill done, or the last arrival's
            core.step()
        add(f"warmup-mixed-{i}", n, greedy)
    while core.has_work():
        core.step()
    core.runner.kv.sender.warm_up()  # the page copy a send to another engine launches
    forget(core)
    return time.monotonic() - start


def forget(core) -> None:
    """Drop what the engine's own start-up requests left: cached pages and counters."""
    core.kv.evict_cached()
    core.counters = dict.fromkeys(core.counters, 0)
    core.loop.reset()
    if core.host_swap is not None:
        core.host_swap.counters = dict.fromkeys(core.host_swap.counters, 0)
    core.scheduler.num_preemptions = 0
    core.scheduler.preemptions_by_reason.clear()
