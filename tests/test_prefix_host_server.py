"""The host tier as the prefix cache's second level, end to end: a real `microserve engine`
daemon of the tiny model with 12 KV pages of 4 tokens and a host tier, real HTTP. A prompt's
pages are pushed to the host by a longer one; a third request sharing the prompt's first 20
tokens gets Hugging Face's greedy tokens, `usage.prompt_tokens_details.cached_tokens` 20 (the
total, from either tier), and /metrics counts them as host hits. The engine then holds no page
and passes its integrity check (host pages included)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from conftest import TINY_VOCAB, hf_greedy
from daemons import Daemon, serve
from test_engine_core import random_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_served_dir, tmp_path_factory) -> Iterator[Daemon]:
    log = tmp_path_factory.mktemp("host-prefix") / "daemon.log"
    yield from serve(Daemon(tiny_served_dir, log, "tiny", "--num-pages", "12", "--page-size",
                            "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
                            "--kv-host-memory-gb", "0.001", "--kv-host-copy-gbps", "1000",
                            "--dtype", "float32", "--cpu-threads", "1"))


def complete(engine: Daemon, prompt: list[int]) -> dict:
    r = engine.http.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_host_hit_over_http(engine, tiny_served_dir):
    a, b, tail = random_prompts([21, 44, 7], seed=11, vocab=TINY_VOCAB)
    c = a[:20] + tail
    complete(engine, a)
    complete(engine, b)  # takes all 12 pages: a's are demoted to the host
    body = complete(engine, c)
    text = body["choices"][0]["text"]  # the word-level tokenizer: token i is "<i>"
    assert [int(t) for t in re.findall(r"<(\d+)>", text)] == hf_greedy(tiny_served_dir, [c], 4)[0]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}
    metrics = engine.metrics().splitlines()
    assert 'microserve_engine_prefix_cache_hit_tokens_total{tier="host"} 20' in metrics
    assert 'microserve_engine_prefix_cache_hit_tokens_total{tier="device"} 0' in metrics
    assert "microserve_engine_kv_host_prefix_loaded_pages_total 5" in metrics
    idle = engine.wait_idle(timeout_s=10)
    assert idle["integrity"] == "ok" and idle["stats"]["kv_pages_used"] == 0
