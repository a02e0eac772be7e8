"""The host tier as the prefix cache's second level in a real engine (tiny model, CPU): a
prompt's pages are evicted from a small device pool to the host, a later request sharing the
prefix loads them back and computes only its uncached tail, with Hugging Face's greedy tokens,
KV byte-equal to the fresh computation, hits counted by tier, and nothing leaked, aborts too."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB, hf_greedy
from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.messages import SamplingParams
from test_engine_core import random_prompts

PS, PAGES, NEW = 4, 12, 4
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def make_core(model_dir, device="cpu"):
    return EngineCore(EngineConfig(model=model_dir, device=device, dtype="float32",
                                   page_size=PS, num_pages=PAGES, max_num_seqs=2,
                                   max_num_batched_tokens=64,  # a shorter start-up profile
                                   kv_host_memory_gb=0.001, kv_host_copy_gbps=1000.0))


def serve(core, request_id, prompt, params=GREEDY):
    """Run one request to the end, checking integrity after every step. Returns its tokens."""
    core.add_request(request_id, prompt, params)
    tokens = []
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
        core.check_integrity()
    return tokens


def device_pages_of(core, tokens):
    """The device pages the prefix cache holds for `tokens` (whole pages), and their KV."""
    match = core.kv.cache.match(tokens)
    return match, core.runner.kv.kv[:, :, match.pages].clone()


def nothing_held(core):
    core.check_integrity()
    kv, host = core.kv.stats(), core.host_swap.tier.pool
    assert kv.used_pages == 0
    assert host.num_free + kv.host_cached_pages == host.num_pages  # no swapped sequence


def scenario(core):
    """a's prompt is cached (6 whole pages: 21 prompt tokens + 3 outputs with KV); b needs
    all 12 device pages, so a's 6 are demoted to the host; c shares a's first 20 prompt
    tokens (5 pages), loads them back and computes its other 7."""
    a, b, tail = random_prompts([21, 44, 7], seed=11, vocab=TINY_VOCAB)
    c = a[:20] + tail
    out = {"a": serve(core, "a", a)}
    fresh = device_pages_of(core, a[:20])[1]  # a's KV, computed here
    out["b"] = serve(core, "b", b)
    demoted = core.stats().kv_host_prefix_demoted_pages
    assert core.kv.cache.match(a[:20]).host_len == 20  # all on the host now
    before = core.stats()
    out["c"] = serve(core, "c", c)
    return a, b, c, out, fresh, demoted, before


@pytest.fixture(scope="module")
def host_hit(tiny_model_dir):
    core = make_core(tiny_model_dir)
    return core, *scenario(core)


def test_a_host_hit_gives_hf_tokens_and_computes_only_the_tail(host_hit, tiny_model_dir):
    core, a, b, c, out, fresh, demoted, before = host_hit
    assert [out["a"], out["b"], out["c"]] == hf_greedy(tiny_model_dir, [a, b, c], NEW)
    after = core.stats()
    assert demoted == 6  # a's whole pages, when b took the pool
    # c: 20 prompt tokens loaded (5 pages), 7 computed, then its decode steps
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 7
    assert after.kv_host_prefix_loaded_pages - before.kv_host_prefix_loaded_pages == 5
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == 20
    assert after.cached_prompt_tokens_host - before.cached_prompt_tokens_host == 20
    nothing_held(core)


def test_loaded_pages_are_byte_equal_to_the_fresh_computation(host_hit):
    core, a, *_, fresh, demoted, before = host_hit
    match, loaded = device_pages_of(core, a[:20])
    assert match.matched_len == 20  # back on the device (c used them last)
    assert torch.equal(loaded, fresh)


def test_hits_by_tier_are_in_metrics(host_hit):
    from engine.frontend.core_client import format_core_stats

    core = host_hit[0]
    stats = core.stats()
    lines = format_core_stats(stats, core.info).splitlines()
    # a and b computed everything; c found 20 tokens on the host, none on the device
    assert 'microserve_engine_prefix_cache_hit_tokens_total{tier="host"} 20' in lines
    assert 'microserve_engine_prefix_cache_hit_tokens_total{tier="device"} 0' in lines
    assert f"microserve_engine_kv_host_pages_cached {stats.kv_host_pages_cached}" in lines
    assert "microserve_engine_kv_host_prefix_loaded_pages_total 5" in lines


def test_an_abort_after_a_host_hit_frees_everything(tiny_model_dir):
    core = make_core(tiny_model_dir)
    a, b, tail = random_prompts([21, 44, 7], seed=12, vocab=TINY_VOCAB)
    serve(core, "a", a)
    serve(core, "b", b)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    core.add_request("c", a[:20] + tail, long)
    core.step()  # admitted: a's pages loaded, its tail prefilled
    core.check_integrity()
    assert core.stats().kv_host_prefix_loaded_pages == 5
    core.abort_request("c")
    nothing_held(core)
    core.add_request("d", a[:20] + tail, long)  # waits, then is aborted before a step
    core.abort_request("d")
    nothing_held(core)
    assert serve(core, "e", a[:20] + tail) == hf_greedy(tiny_model_dir, [a[:20] + tail], NEW)[0]
    nothing_held(core)


@pytest.mark.gpu
def test_a_host_hit_on_cuda_gives_hf_tokens(tiny_model_dir):
    """The same on CUDA: demotions and loads on the compute stream, async scheduling."""
    core = make_core(tiny_model_dir, device="cuda")
    a, b, c, out, *_ = scenario(core)
    assert [out["a"], out["b"], out["c"]] == hf_greedy(tiny_model_dir, [a, b, c], NEW)
    nothing_held(core)


def test_the_host_prefix_bench_runs(host_hit):
    """bench.host_prefix's measurement on the tiny model: the host round loads the prompt's
    whole pages but the last token's (19 tokens: 4 pages), and leaves nothing cached."""
    from bench.host_prefix import measure

    core = host_hit[0]
    result = measure(core, prompt_len=19, repeats=1)
    assert set(result) == {"recompute", "device", "host", "host_over_recompute", "loaded_pages",
                           "load_gbps"}
    assert result["loaded_pages"] == 4 and result["load_gbps"] > 0
    nothing_held(core)
    assert core.kv.stats().host_cached_pages == 0


def test_pd_reuses_prefixes_held_on_the_host_tiers_of_both_engines(tiny_model_dir):
    """P holds 40 tokens of the prompt and D 8, both only on their host tiers: D's prep_recv
    counts (and loads) its 8, P loads its 40, copies 32 of them and computes the rest; D's
    tokens equal Hugging Face's, and both engines end holding nothing."""
    from microserve.messages import RemoteSendResponse
    from test_kv_exchange import N_NEW, assert_clean, generate, send
    from test_kv_exchange import make_core as make_pd_core

    p, d = (make_pd_core(tiny_model_dir, "shm", max_num_batched_tokens=64,
                         kv_host_memory_gb=0.001, kv_host_copy_gbps=1000.0) for _ in range(2))
    try:
        prompt = random_prompts([45], seed=7, vocab=TINY_VOCAB)[0]
        generate(p, "warm", prompt[:40] + [9])
        generate(d, "warm", prompt[:8] + [9])
        for core in (p, d):  # every cached page to the host tier
            core.kv.cache.evict(core.kv.cache.num_evictable())
        assert p.kv.cache.match(prompt).host_len == 40 and d.kv.cache.match(prompt).host_len == 8
        r = d.exchange.prep_recv("c", prompt, -1, None)
        assert r.matched == 8
        out = send(p, "c", prompt, 8, -1, r.kv_addr)
        assert out == RemoteSendResponse(sent=len(prompt) - 1 - 8, computed=len(prompt) - 1 - 40,
                                         reused=32)
        tokens, _ = generate(d, "c", prompt, begin=len(prompt) - 1)
        assert tokens == hf_greedy(tiny_model_dir, [prompt], N_NEW)[0]
        assert (p.stats().kv_host_prefix_loaded_pages, d.stats().kv_host_prefix_loaded_pages) == (
            10, 2)
        for core in (p, d):
            assert_clean(core)
            nothing_held(core)
    finally:
        p.close()
        d.close()


def test_a_start_from_a_cached_prefix_on_the_host_counts_it_by_tier(tiny_model_dir):
    """start_generate(begin=...) on a prefix the host tier holds (no prep_recv: the engine's
    own cache) loads it back and counts it as a host hit, as an admission does."""
    core = make_core(tiny_model_dir)
    a, b, tail = random_prompts([21, 44, 7], seed=12, vocab=TINY_VOCAB)
    serve(core, "a", a)
    serve(core, "b", b)  # a's pages to the host
    assert core.kv.cache.match(a[:20]).host_len == 20
    before = core.stats()
    core.add_request("c", a[:20] + tail, GREEDY, begin=20)
    while core.has_work():
        core.step()
    after = core.stats()
    assert after.cached_prompt_tokens - before.cached_prompt_tokens == 20
    assert after.cached_prompt_tokens_host - before.cached_prompt_tokens_host == 20
    nothing_held(core)
