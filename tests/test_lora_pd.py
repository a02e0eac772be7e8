"""LoRA adapters across the KV exchange, between two engine cores in one process (shm): the
adapter travels with prep_recv, remote_send and start_generate, P computes the KV with it, D
reserves and caches it in that adapter's prefix tree, and the tokens are PEFT's. KV reserved
for one adapter is never adopted for another or for the base; an engine without the adapter
refuses with the adapter's name. The live-process version is tests/test_lora_router.py."""

from __future__ import annotations

import pytest
from lora_adapters import peft_greedy, write_adapter
from test_engine_core import random_prompts
from test_kv_exchange import KEY, answered, assert_clean, generate_from

from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.backend import MicroservingError
from microserve.messages import (PrepRecvRequest, RemoteSendRequest, SamplingParams,
                                 UnloadLoraRequest)

N_NEW = 8
PAGE = 4


def greedy(lora_name=None):
    return SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True,
                          lora_name=lora_name)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([23, 30], seed=11)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory, prompts):
    """a1 (rank 8, every projection) and a2 (rank 4, q and v), and PEFT's greedy tokens."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = write_adapter(tiny_model_dir, root / "a1", rank=8, seed=1)
    write_adapter(tiny_model_dir, root / "a2", rank=4, seed=2, targets=("q_proj", "v_proj"))
    ref = {None: peft_greedy(a1, prompts, N_NEW, base=True), "a1": peft_greedy(a1, prompts, N_NEW)}
    assert ref["a1"] != ref[None]
    return root, ref


@pytest.fixture(scope="module")
def pair(tiny_model_dir, adapters):
    root = adapters[0]
    # P registers a2 first, so the same adapter has other ids on P and D: only names travel
    cores = [EngineCore(EngineConfig(model=tiny_model_dir, page_size=PAGE, num_pages=128,
                                     kv_transfer="shm", lora_modules=modules),
                        transfer_key=KEY)
             for modules in ((("a2", str(root / "a2")), ("a1", str(root / "a1"))),
                             (("a1", str(root / "a1")), ("a2", str(root / "a2"))))]
    yield cores
    for core in cores:
        core.close()


def reset(*cores):
    for core in cores:
        core.kv.cache.evict(core.kv.cache.num_evictable())


def prep_recv(d, rid, prompt, end, lora_name):
    return d.on_prep_recv(PrepRecvRequest(rid, prompt, end, lora_name=lora_name), None)


def remote_send(p, rid, prompt, begin, end, kv_addr, lora_name, sampling=None):
    p.on_remote_send(RemoteSendRequest(rid, prompt, begin, end, kv_addr, sampling,
                                       lora_name=lora_name), None)
    return answered(p, rid)


def generate(core, rid, prompt, lora_name, begin=0):
    core.add_request(rid, prompt, greedy(lora_name), begin)
    tokens, cached = [], None
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def cached_pages(core, tokens, lora_name):
    namespace = core.adapter_id(lora_name)
    return len(core.kv.cache.match(tokens, namespace).pages)


def test_pd_with_an_adapter_equals_peft_and_caches_under_it(pair, prompts, adapters):
    """D reserves prompt[:-1] under a1, P computes it with a1 and sends it, D computes the
    last token and decodes with a1: PEFT's tokens. Both engines then hold the prompt in a1's
    tree only: the base finds nothing of it, a1 finds it whole."""
    p, d = pair
    ref = adapters[1]
    reset(p, d)
    prompt, n = prompts[0], len(prompts[0])  # 23 tokens: 22 sent, 5 whole pages
    r = prep_recv(d, "pd", prompt, -1, "a1")
    assert (r.matched, r.kv_addr.begin, r.kv_addr.end) == (0, 0, n - 1)
    out = remote_send(p, "pd", prompt, 0, n - 1, r.kv_addr, "a1")
    assert (out.sent, out.computed, out.reused) == (n - 1, n - 1, 0)
    tokens, cached = generate(d, "pd", prompt, "a1", begin=n - 1)
    assert tokens == ref["a1"][0]
    assert cached == n - 1
    assert_clean(p, d)
    for core in (p, d):
        assert cached_pages(core, prompt, "a1") == 5
        assert cached_pages(core, prompt, None) == 0
        assert cached_pages(core, prompt, "a2") == 0
    assert generate(d, "base", prompt, None) == (ref[None][0], 0)
    assert generate(d, "again", prompt, "a1") == (ref["a1"][0], 20)
    assert_clean(p, d)


def test_the_first_token_travels_with_the_adapter(pair, prompts, adapters):
    """P computes the whole prompt with a1 and samples the first token with it; D emits it
    and decodes on with a1, computing no prompt token."""
    p, d = pair
    ref = adapters[1]
    reset(p, d)
    prompt, n = prompts[1], len(prompts[1])
    r = prep_recv(d, "f", prompt, n, "a1")
    out = remote_send(p, "f", prompt, 0, n, r.kv_addr, "a1", sampling=greedy("a1"))
    assert (out.sent, out.first_token) == (n, ref["a1"][1][0])
    tokens, outs = generate_from(d, "f", prompt, out.first_token, greedy("a1"))
    assert tokens == ref["a1"][1] and outs[0].num_cached_tokens == n
    assert_clean(p, d)
    assert cached_pages(d, prompt, "a1") == 7 and cached_pages(d, prompt, None) == 0


def test_kv_of_other_weights_is_refused_by_name(pair, prompts, tiny_model_dir):
    p, d = pair
    reset(p, d)
    prompt, n = prompts[0], len(prompts[0])
    with pytest.raises(MicroservingError, match="no LoRA adapter named 'nope'") as e:
        prep_recv(d, "x", prompt, -1, "nope")
    assert (e.value.status, e.value.param, e.value.code) == (404, "lora_name", "model_not_found")
    with pytest.raises(MicroservingError, match="no LoRA adapter named 'nope'"):
        remote_send(p, "x", prompt, 0, n - 1, None, "nope")
    with pytest.raises(MicroservingError, match="differs from the remote_send's lora_name") as e:
        p.on_remote_send(RemoteSendRequest("x", prompt, 0, n, None, greedy("a1")), None)
    assert e.value.param == "lora_name"
    # reserved for a1, generated as the base (or a2): refused, and the reservation kept for
    # the router's abort
    prep_recv(d, "r", prompt, -1, "a1")
    for other, what in ((None, "the base model"), ("a2", "LoRA adapter id 2")):
        with pytest.raises(MicroservingError, match=f"but start_generate is for {what}") as e:
            d.add_request("r", prompt, greedy(other), n - 1)
        assert (e.value.status, e.value.param) == (400, "lora_name")
    d.abort_request("r")
    # cached under the base only: a start_generate for a1 past 0 finds nothing of it
    generate(d, "warm", prompt, None)
    with pytest.raises(MicroservingError, match="beyond the 0 tokens of this prompt cached"):
        d.add_request("b", prompt, greedy("a1"), 8)
    assert_clean(p, d)
    plain = EngineCore(EngineConfig(model=tiny_model_dir, page_size=PAGE, num_pages=32,
                                    kv_transfer="shm"), transfer_key=KEY)
    with pytest.raises(MicroservingError, match="serves no LoRA adapters") as e:
        prep_recv(plain, "x", prompt, -1, "a1")
    assert (e.value.status, e.value.param) == (400, "lora_name")
    plain.close()


def test_an_adapter_unloaded_while_its_send_computes_goes_after_it(pair, prompts, adapters):
    """The send holds its adapter: unloading it is pending until the send is done."""
    p, d = pair
    reset(p, d)
    prompt, n = prompts[1], len(prompts[1])
    r = prep_recv(d, "u", prompt, -1, "a2")
    p.on_remote_send(RemoteSendRequest("u", prompt, 0, n - 1, r.kv_addr, lora_name="a2"), None)
    assert p.on_unload_lora_adapter(UnloadLoraRequest("a2"), None).pending
    p.check_integrity()
    answered(p, "u")
    assert p.stats().lora_registered == ["a1"]
    d.abort_request("u")
    assert_clean(p, d)
