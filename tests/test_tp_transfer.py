"""KV transfer between engines of different tensor-parallel sizes, on the CPU (gloo; shm and tcp).

P at TP 2 sends to D at TP 1 (each head gathered from the rank that holds it), and P at TP 1
sends to D at TP 2 (split into each rank's heads): D's greedy tokens equal Hugging Face's, and
the KV D received is byte-equal to what P's ranks hold, head by head. Two engines in one test
process, one of them tensor-parallel at a time (a process joins one group). The copy plan is
checked on its own for every split, including KV heads replicated over more ranks than heads.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import hf_greedy
from test_engine_core import random_prompts
from test_kv_exchange import N_NEW, assert_clean, generate, make_core, reset, send

from engine.core import EngineCore
from kvcache.transfer.tp_peer import HeadRun, head_plan
from microserve.messages import KVLayout, RemoteSendResponse


def layout(tp: int, heads: int = 8) -> KVLayout:
    per = max(1, heads // tp)
    return KVLayout("m", "float32", 4, 2, per, 16, tp, heads)


def test_the_plan_gathers_splits_and_maps_rank_to_rank():
    assert head_plan(layout(2), layout(1)) == [
        HeadRun(0, range(0, 4), 0, range(0, 4)), HeadRun(1, range(0, 4), 0, range(4, 8))]
    assert head_plan(layout(1), layout(2)) == [
        HeadRun(0, range(0, 4), 0, range(0, 4)), HeadRun(0, range(4, 8), 1, range(0, 4))]
    assert head_plan(layout(2), layout(2)) == [
        HeadRun(0, range(0, 4), 0, range(0, 4)), HeadRun(1, range(0, 4), 1, range(0, 4))]
    assert head_plan(layout(4), layout(2)) == [
        HeadRun(0, range(0, 2), 0, range(0, 2)), HeadRun(1, range(0, 2), 0, range(2, 4)),
        HeadRun(2, range(0, 2), 1, range(0, 2)), HeadRun(3, range(0, 2), 1, range(2, 4))]
    # 2 KV heads over 4 ranks: each head on two ranks; the first that holds it sends it,
    # every rank that holds it receives it
    two = layout(4, heads=2)
    assert [two.rank_heads(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2),
                                                     range(1, 2)]
    assert head_plan(two, layout(1, heads=2)) == [
        HeadRun(0, range(0, 1), 0, range(0, 1)), HeadRun(2, range(0, 1), 0, range(1, 2))]
    assert head_plan(layout(1, heads=2), two) == [
        HeadRun(0, range(0, 1), 0, range(0, 1)), HeadRun(0, range(0, 1), 1, range(0, 1)),
        HeadRun(0, range(1, 2), 2, range(0, 1)), HeadRun(0, range(1, 2), 3, range(0, 1))]


def test_layouts_of_one_model_split_otherwise_agree_and_other_models_do_not():
    assert layout(2).mismatch(layout(1)) is None
    assert "total_kv_heads" in layout(2, heads=8).mismatch(layout(1, heads=4))


def rank_pools(core: EngineCore) -> list[torch.Tensor]:
    return core.runner.rank_pools if core.config.tensor_parallel_size > 1 else [core.transfer.kv]


def whole_heads(core: EngineCore, slots: torch.Tensor) -> torch.Tensor:
    """K and V of every layer at `slots`, with all the model's heads, from the core's ranks:
    [layers, 2, len(slots), heads, dim]."""
    lay = core.exchange.layout
    parts = []
    for head in range(lay.model_kv_heads):
        rank = next(r for r in range(lay.tensor_parallel_size) if head in lay.rank_heads(r))
        pool = rank_pools(core)[rank].flatten(2, 3)  # [layers, 2, slots, heads, dim]
        parts.append(pool[:, :, slots, lay.rank_heads(rank).index(head)])
    return torch.stack(parts, dim=3)


def pd_between(p: EngineCore, d: EngineCore, prompts: list[list[int]], ref: list[list[int]],
               tag: str) -> None:
    """P/D of each prompt from p to d: D's greedy tokens are `ref`'s, and the KV D received,
    every head of every rank, is P's to the byte (P cached the prompt's whole pages where it
    computed them). Nothing is held afterwards."""
    page = p.config.page_size
    for i, prompt in enumerate(prompts):
        rid = f"{tag}-{i}"
        r = d.exchange.prep_recv(rid, prompt, -1, None)
        out = send(p, rid, prompt, 0, -1, r.kv_addr)
        n = len(prompt) - 1
        assert out == RemoteSendResponse(sent=n, computed=n, reused=0)
        slots = torch.tensor([s + k for s, c in r.kv_addr.ranges for k in range(c)])
        got = whole_heads(d, slots)
        match = p.kv.cache.match(prompt[:n])
        assert match.matched_len == n // page * page
        p_slots = torch.tensor([pg * page + k for pg in match.pages for k in range(page)])
        assert torch.equal(got[:, :, : match.matched_len].cpu(), whole_heads(p, p_slots).cpu())
        assert got.abs().sum() > 0  # KV was written, not left zero
        tokens, cached = generate(d, rid, prompt, begin=n)
        assert tokens == ref[i], f"prompt {i}"
        assert cached == n
    assert_clean(p, d)


@pytest.fixture(scope="module")
def ones(tiny_model_dir):
    """An engine of one rank per transfer kind, made when first asked for."""
    cores: dict[str, EngineCore] = {}
    yield lambda kind: cores.get(kind) or cores.setdefault(kind, make_core(tiny_model_dir, kind))
    for core in cores.values():
        core.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("p_size,d_size", [(2, 1), (1, 2)], ids=["gather", "split"])
def test_pd_between_tensor_parallel_sizes(tiny_model_dir, ones, p_size, d_size, kind):
    """Two engines in this process, the tensor-parallel one with its worker rank beside. shm:
    the sender writes every rank's pool of the receiver; tcp: each frame carries every head,
    gathered from the sender's ranks and split into the receiver's by its connection thread."""
    one = ones(kind)
    tp = make_core(tiny_model_dir, kind, tensor_parallel_size=2, cpu_threads=1)
    reset(one)
    try:
        assert tp.info.kv_transfer == kind
        prompts = random_prompts([45, 23], seed=11)
        pd_between(*((tp, one) if p_size == 2 else (one, tp)), prompts,
                   hf_greedy(tiny_model_dir, prompts, N_NEW), f"{kind}-{p_size}to{d_size}")
    finally:
        tp.close()


# ---- through the router: microserve up with a TP 2 prefill engine and a TP 1 decode engine ----

LIVE_STRATEGIES = {
    "pd": {"builtin": "pd"},
    "balanced": {"builtin": "balanced_pd", "args": {"ratio": 0.5}},
}


@pytest.fixture(scope="module")
def tp_up(tiny_served_dir, tmp_path_factory):
    from deployments import Up, stop_and_check, write_config

    tmp = tmp_path_factory.mktemp("tp-up")
    common = ["--num-pages", "256", "--cpu-threads", "1"]
    config, port, urls = write_config(tmp / "deploy.toml", tiny_served_dir, "pd", [
        ("p", "prefill", [*common, "--tensor-parallel-size", "2"]),
        ("d", "decode", common)])
    up = Up(config, port, urls, tmp / "up.log",
            env={**os.environ, "MICROSERVE_ADMIN_TOKEN": "tp-admin"})
    try:
        up.wait_ready()
        yield up
    finally:
        if up.proc.poll() is None:
            stop_and_check(up)


def test_strategies_move_kv_from_a_tp2_prefill_engine_to_a_tp1_decode_engine(
        tp_up, tiny_served_dir):
    """Through the router and the official client: each P/D strategy gives Hugging Face's
    greedy tokens and the prefill engine (TP 2) sent the KV; a context migrates the other way
    (TP 1 to TP 2) and is served from the cache there; both engines end quiet with their
    caches intact."""
    import httpx
    from daemons import ENGINE_AUTH
    from deployments import assert_quiet, engine_stats
    from openai import OpenAI

    client = OpenAI(base_url=tp_up.url + "/v1", api_key="unused", max_retries=0)
    admin = httpx.Client(base_url=tp_up.url, headers={"Authorization": "Bearer tp-admin"},
                         timeout=60)
    for i, (name, strategy) in enumerate(LIVE_STRATEGIES.items()):
        assert admin.put("/admin/strategy", json=strategy).status_code == 200
        prompt = random_prompts([60], seed=100 + i)[0]
        [want] = hf_greedy(tiny_served_dir, [prompt], N_NEW)
        sent = engine_stats(tp_up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
        r = client.completions.create(model="test-model", prompt=prompt, max_tokens=N_NEW,
                                      temperature=0, extra_body={"ignore_eos": True})
        # the placeholder tokenizer's token i is "<i>"
        assert [int(t) for t in re.findall(r"<(\d+)>", r.choices[0].text)] == want, name
        after = engine_stats(tp_up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
        assert after > sent, f"{name}: the TP 2 engine sent no KV"
        for engine, url in tp_up.engine_urls.items():
            assert_quiet(engine, url)
    # /admin/migrate the other way: a context served on d (TP 1) moves into p's (TP 2) cache,
    # split over its ranks; p then computes only what follows it
    context, question = random_prompts([70, 9], seed=200)
    d, p = tp_up.engine_urls["d"], tp_up.engine_urls["p"]
    assert httpx.post(d + "/v1/completions", json={"prompt": context, "max_tokens": 1},
                      headers=ENGINE_AUTH, timeout=60).status_code == 200
    r = admin.post("/admin/migrate", json={"prompt": context, "source": "d",
                                           "destination": "p"})
    assert r.status_code == 200, r.text
    whole = len(context) // 16 * 16
    assert r.json()["cached"] == whole
    r = httpx.post(p + "/v1/completions", headers=ENGINE_AUTH, timeout=60, json={
        "prompt": context + question, "temperature": 0, "max_tokens": N_NEW, "ignore_eos": True})
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    [want] = hf_greedy(tiny_served_dir, [context + question], N_NEW)
    assert [int(t) for t in re.findall(r"<(\d+)>", body["choices"][0]["text"])] == want
    for engine, url in tp_up.engine_urls.items():
        assert_quiet(engine, url)
    admin.close()


# ---- tcp frames between splits, KV heads replicated over more ranks than heads ---------------


def _pools(lay: KVLayout, pages: int, seed: int | None) -> list[torch.Tensor]:
    """One pool per rank of `lay`: zeros, or (seed) each head's values set from the model's
    head number, so that a replicated head holds the same values on each rank holding it."""
    if seed is None:
        return [torch.zeros(lay.pool_shape(pages)) for _ in range(lay.tensor_parallel_size)]
    whole = torch.randn(lay.num_layers, 2, pages, lay.page_size, lay.model_kv_heads,
                        lay.head_dim, generator=torch.Generator().manual_seed(seed))
    return [whole[..., lay.rank_heads(r).start:lay.rank_heads(r).stop, :].clone()
            for r in range(lay.tensor_parallel_size)]


@pytest.mark.parametrize("src_tp,dst_tp", [(4, 1), (1, 4), (4, 2), (2, 4)])
def test_tcp_frames_carry_every_head_between_any_two_splits(src_tp, dst_tp):
    """Two KV heads: at TP 4 each is on two ranks. A tcp sender gathers each head from the
    first rank holding it, the receiver writes it into every rank holding it; the slots
    written on each receiving rank equal the sender's model heads exactly, the rest stay 0."""
    from kvcache.transfer.backends import open_peer
    from kvcache.transfer.tcp import TcpBackend
    from test_kv_exchange import KEY

    src_lay, dst_lay = layout(src_tp, heads=2), layout(dst_tp, heads=2)
    pages = 8
    src = _pools(src_lay, pages, seed=3)
    backend = TcpBackend(dst_lay, pages, key=KEY)
    dst = [backend.kv] + _pools(dst_lay, pages, None)[1:]
    if dst_tp > 1:
        backend.add_ranks({}, dst)
    peer = open_peer(backend.descriptor(), src[0], src_lay, KEY,
                     local_ranks=src if src_tp > 1 else None)
    try:
        src_slots, dst_slots = torch.tensor([1, 2, 9, 30]), torch.tensor([4, 5, 6, 20])
        window = backend.open_window(dst_slots)
        for layer in range(src_lay.num_layers):
            peer.write(window, layer, src_slots, dst_slots)
        peer.flush(window)
        assert backend.close_window(window) is None  # no seal was sent
    finally:
        peer.close()
        backend.close()
    sent = torch.cat([p.flatten(2, 3)[:, :, src_slots] for p in src], dim=3)  # every rank's
    sent_heads = [h for r in range(src_tp) for h in src_lay.rank_heads(r)]
    for rank, pool in enumerate(dst):
        got = pool.flatten(2, 3)
        for i, head in enumerate(dst_lay.rank_heads(rank)):
            want = sent[:, :, :, sent_heads.index(head)]
            assert torch.equal(got[:, :, dst_slots, i], want), (rank, head)
        rest = torch.ones(got.shape[2], dtype=torch.bool)
        rest[dst_slots] = False
        assert not got[:, :, rest].any(), rank
