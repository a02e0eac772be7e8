"""LoRA adapters through a live deployment (`microserve up`, the tiny model, real processes and
HTTP): a prefill engine p (adapters a1 and a2, both resident: --max-loras 2) and a decode
engine d (the same two registered, one slot: a1 resident). P/D and balanced P/D carry the
adapter: PEFT's tokens, the KV sent exactly once, and d caches the prompt under a1 only. The
lora_affinity strategy sends a2's requests to p, where a2 is resident, and none to d.
/admin/migrate moves an adapter's context. The adapters are placed on the engines by the
deployment file (each engine's --lora-modules)."""

from __future__ import annotations

import os
import random
import re

import httpx
import pytest
from conftest import TINY_VOCAB
from daemons import ENGINE_AUTH
from deployments import Up, admin_session, engine_stats, stop_and_check, write_config
from lora_adapters import peft_greedy, write_adapter

pytestmark = pytest.mark.slow

ADMIN = "lora-pd-admin"
N_NEW = 8
PAGE = 16  # the engines' default page size
_rng = random.Random(41)
PROMPTS = [[_rng.randrange(3, TINY_VOCAB) for _ in range(40)] for _ in range(4)]


@pytest.fixture(scope="module")
def adapters(tiny_served_dir, tmp_path_factory):
    """a1 and a2, and PEFT's greedy tokens for each prompt (None: the base)."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = write_adapter(tiny_served_dir, root / "a1", rank=8, seed=1)
    a2 = write_adapter(tiny_served_dir, root / "a2", rank=4, seed=2, targets=("q_proj", "v_proj"))
    ref = {None: peft_greedy(a1, PROMPTS, N_NEW, base=True), "a1": peft_greedy(a1, PROMPTS, N_NEW),
           "a2": peft_greedy(a2, PROMPTS, N_NEW)}
    assert ref["a1"] != ref[None] and ref["a2"] != ref[None]
    return root, ref


@pytest.fixture(scope="module")
def up(tiny_served_dir, adapters, tmp_path_factory):
    root = adapters[0]
    tmp = tmp_path_factory.mktemp("lora-up")
    common = ["--num-pages", "64", "--max-model-len", "256", "--lora-modules",
              f"a1={root / 'a1'}", f"a2={root / 'a2'}"]
    config, port, urls = write_config(tmp / "deploy.toml", tiny_served_dir, "pd", [
        ("p", "prefill", [*common, "--max-loras", "2"]),
        ("d", "decode", [*common, "--max-loras", "1", "--kv-transfer", "shm"])])
    deployment = Up(config, port, urls, tmp / "up.log",
                    env={**os.environ, "MICROSERVE_ADMIN_TOKEN": ADMIN})
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        if deployment.proc.poll() is None:
            stop_and_check(deployment)


@pytest.fixture
def admin(up, request):
    yield from admin_session(up, request, ADMIN)


def use(admin, builtin: str, **args) -> None:
    r = admin.put("/admin/strategy", json={"builtin": builtin, "args": args})
    assert r.status_code == 200, r.text


def complete(url: str, model: str, prompt: list[int], headers=None) -> tuple[list[int], int]:
    """Greedy completion: (its tokens, its cached prompt tokens)."""
    r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": N_NEW, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = [int(t) for t in re.findall(r"<(\d+)>", body["choices"][0]["text"])]
    return tokens, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def counters(up, *keys) -> dict[tuple[str, str], float]:
    stats = {name: engine_stats(url)["stats"] for name, url in up.engine_urls.items()}
    return {(name, key): stats[name][key] for name in stats for key in keys}


def moved(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


KV = ("kv_tokens_sent", "kv_tokens_received", "prompt_tokens", "lora_slot_writes")


@pytest.mark.parametrize("strategy, args, sent", [("pd", {}, 40),
                                                   ("balanced_pd", {"ratio": 0.5}, 20)])
def test_pd_carries_the_adapter(up, admin, adapters, strategy, args, sent):
    """P computes prompt[:sent] with a1 (and with pd, samples the first token with it), d
    the rest: PEFT's tokens. d then holds the prompt in a1's tree only: a base request for it
    on d finds nothing cached, an a1 request finds its whole pages."""
    ref = adapters[1]
    i = 0 if strategy == "pd" else 1
    use(admin, strategy, **args)
    before = counters(up, *KV)
    assert complete(up.url, "a1", PROMPTS[i])[0] == ref["a1"][i]
    assert moved(before, counters(up, *KV)) == {
        ("p", "kv_tokens_sent"): sent, ("d", "kv_tokens_received"): sent,
        ("d", "prompt_tokens"): 40}  # p's send is no generation: its prompt_tokens stay
    d = up.engine_urls["d"]
    assert complete(d, "a1", PROMPTS[i], ENGINE_AUTH) == (ref["a1"][i], 32)  # prompt[:39]
    assert complete(d, "test-model", PROMPTS[i], ENGINE_AUTH) == (ref[None][i], 0)


def test_admin_migrate_moves_an_adapters_context(up, admin, adapters):
    """/admin/migrate with lora_name: p computes the context with a1, d commits it under a1."""
    ref = adapters[1]
    r = admin.post("/admin/migrate", json={"prompt": PROMPTS[3], "source": "p",
                                           "destination": "d", "lora_name": "a1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": 40, "already_cached": 0, "sent": 40, "computed": 40,
                        "reused": 0, "cached": 32, "pinned": False}
    d = up.engine_urls["d"]
    assert complete(d, "a1", PROMPTS[3], ENGINE_AUTH) == (ref["a1"][3], 32)
    assert complete(d, "test-model", PROMPTS[3], ENGINE_AUTH) == (ref[None][3], 0)
    r = admin.post("/admin/migrate", json={"prompt": PROMPTS[3], "source": "p",
                                           "destination": "d", "lora_name": "nope"})
    assert r.status_code == 404 and "no LoRA adapter named 'nope'" in r.text, r.text


def test_an_engine_without_the_adapter_refuses_by_name(up, admin):
    r = httpx.post(f"{up.engine_urls['d']}/microserving/prep_recv", headers=ENGINE_AUTH,
                   json={"request_id": "x", "prompt": PROMPTS[0], "lora_name": "nope"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_name" and "no LoRA adapter named 'nope'" in error["message"]
    assert "(loaded: a1, a2)" in error["message"]
    # /metrics answers without the key, so an engine behind one keeps its adapters' names off
    # it: vLLM's load figures are there, its adapter gauge is not
    text = httpx.get(f"{up.engine_urls['d']}/metrics").text
    assert 'vllm:num_requests_waiting{model_name="test-model"} 0.0' in text
    assert "vllm:lora_requests_info" not in text and "a1" not in text


def test_affinity_sends_an_adapter_where_it_is_resident(up, admin, adapters):
    """a2 sits in p's slots only (d's one slot holds a1): every a2 request goes to p, and d
    copies no adapter. Round robin would send half of them to d, evicting a1 there."""
    ref = adapters[1]
    use(admin, "lora_affinity")
    assert admin.get("/admin/strategy").json()["active"]["settings"] == {
        "adapter_weight": 1.0, "prefix_weight": 1.0, "load_weight": 0.5}
    assert {k[0]: v for k, v in counters(up, "lora_resident").items()} == {
        "p": ["a1", "a2"], "d": ["a1"]}
    before = counters(up, *KV)
    for _ in range(4):
        assert complete(up.url, "a2", PROMPTS[2])[0] == ref["a2"][2]
    assert moved(before, counters(up, *KV)) == {("p", "prompt_tokens"): 160}
