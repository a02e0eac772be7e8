"""LoRA adapters end to end, on real processes serving the tiny model: two `microserve engine`
daemons (e1 starts with adapter a1; e2 with none) and a `microserve router` in front. Requests
pick an adapter with `model` and get PEFT's tokens; /v1/models lists the adapters; load and
unload at runtime, on one engine and through the router's admin API for all of them; bad
adapters and unknown names get OpenAI error JSON naming the problem."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from conftest import DAEMON_LOGS
from daemons import ENGINE_AUTH, ENGINE_KEY, Daemon, serve_together
from deployments import RouterProcess, assert_quiet
from lora_adapters import peft_greedy, write_adapter

pytestmark = pytest.mark.slow

ADMIN = "lora-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = [5, 61, 17, 200, 33, 9, 120, 47, 88, 10]
N_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_served_dir, tmp_path_factory):
    """a1 and a2 under one adapters directory, and PEFT's greedy tokens for PROMPT with each
    (None: the base)."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = write_adapter(tiny_served_dir, root / "a1", rank=8, seed=1)
    a2 = write_adapter(tiny_served_dir, root / "a2", rank=16, seed=2, targets=("q_proj", "o_proj"))
    ref = {None: peft_greedy(a1, [PROMPT], N_NEW, base=True)[0],
           "a1": peft_greedy(a1, [PROMPT], N_NEW)[0], "a2": peft_greedy(a2, [PROMPT], N_NEW)[0]}
    assert len({tuple(t) for t in ref.values()}) == 3
    return root, ref


def _engine(model_dir, tmp_path_factory, name, *args):
    log = tmp_path_factory.mktemp(name) / "daemon.log"
    return Daemon(model_dir, log, name, "--num-pages", "64", "--max-model-len", "256",
                  "--api-key", ENGINE_KEY, "--max-loras", "2", *args)


@pytest.fixture(scope="module")
def engines(tiny_served_dir, adapters, tmp_path_factory):
    root = adapters[0]
    yield from serve_together(
        _engine(tiny_served_dir, tmp_path_factory, "e1", "--lora-modules", f"a1={root / 'a1'}",
                "--lora-dir", str(root)),
        _engine(tiny_served_dir, tmp_path_factory, "e2", "--enable-lora", "--lora-dir",
                str(root)))


@pytest.fixture(scope="module")
def e1(engines):
    return engines[0]


@pytest.fixture(scope="module")
def e2(engines):
    return engines[1]


@pytest.fixture(scope="module")
def router(e1, e2, tiny_served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    process = RouterProcess(tiny_served_dir, {"e1": e1.url, "e2": e2.url}, log,
                            "--admin-token", ADMIN)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def engines_quiet(request, e1, e2):
    request.node.stash[DAEMON_LOGS] = [e1.log_path, e2.log_path]
    yield
    for e in (e1, e2):
        assert_quiet(e.name, e.url)


def complete(url: str, model: str, headers=ENGINE_AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": N_NEW, "temperature": 0,
        "ignore_eos": True})


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [int(t) for t in re.findall(r"<(\d+)>", response.json()["choices"][0]["text"])]


def models(url: str, headers=ENGINE_AUTH) -> dict[str, str | None]:
    r = httpx.get(f"{url}/v1/models", headers=headers)
    assert r.status_code == 200, r.text
    return {m["id"]: m["parent"] for m in r.json()["data"]}


def test_engine_serves_base_and_adapter_by_model_name(e1, adapters):
    ref = adapters[1]
    assert models(e1.url) == {"e1": None, "a1": "e1"}
    assert tokens(complete(e1.url, "a1")) == ref["a1"]
    assert tokens(complete(e1.url, "e1")) == ref[None]
    answer = complete(e1.url, "a1")
    assert answer.json()["model"] == "a1"
    r = complete(e1.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert "'nope' does not exist" in r.json()["error"]["message"]


def test_engine_loads_and_unloads_at_runtime(e2, adapters):
    root, ref = adapters
    load = {"lora_name": "a2", "lora_path": "a2"}
    assert httpx.post(f"{e2.url}/v1/load_lora_adapter", json=load).status_code == 401
    r = httpx.post(f"{e2.url}/v1/load_lora_adapter", json=load, headers=ENGINE_AUTH)
    assert r.status_code == 200, r.text
    assert (r.json()["lora_name"], r.json()["rank"], r.json()["resident"]) == ("a2", 16, True)
    assert models(e2.url) == {"e2": None, "a2": "e2"}
    assert tokens(complete(e2.url, "a2")) == ref["a2"]
    stats = e2.stats()["stats"]
    assert stats["lora_registered"] == ["a2"] and stats["lora_loads"] == 1
    for bad, message in (({"lora_name": "x", "lora_path": "../.."}, "outside the adapters"),
                         ({"lora_name": "a2", "lora_path": "a1"}, "already loaded"),
                         ({"lora_name": "e2", "lora_path": "a1"}, "the base model's name"),
                         ({"lora_name": "x", "lora_path": "missing"}, "no adapter_config")):
        r = httpx.post(f"{e2.url}/v1/load_lora_adapter", json=bad, headers=ENGINE_AUTH)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(f"{e2.url}/v1/unload_lora_adapter", json={"lora_name": "a2"},
                   headers=ENGINE_AUTH)
    assert r.status_code == 200 and r.json() == {"lora_name": "a2", "pending": False}, r.text
    assert models(e2.url) == {"e2": None}
    assert complete(e2.url, "a2").status_code == 404
    r = httpx.post(f"{e2.url}/v1/unload_lora_adapter", json={"lora_name": "a2"},
                   headers=ENGINE_AUTH)
    assert r.status_code == 404 and "no LoRA adapter named 'a2'" in r.text


def _wait_models(router, want: dict) -> None:
    deadline = time.monotonic() + 10
    while models(router.url, None) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert models(router.url, None) == want


def test_router_routes_adapters_to_engines_that_have_them(router, e1, e2, adapters):
    ref = adapters[1]
    _wait_models(router, {"test-model": None, "a1": "test-model"})
    before = e2.stats()["stats"]["prompt_tokens"]
    for _ in range(4):  # round robin would send two of them to e2, which lacks a1
        assert tokens(complete(router.url, "a1", None)) == ref["a1"]
    assert e2.stats()["stats"]["prompt_tokens"] == before
    # the admin API loads a2 on every engine; then both serve it
    body = {"lora_name": "a2", "lora_path": "a2"}
    assert httpx.post(f"{router.url}/admin/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(f"{router.url}/admin/load_lora_adapter", json=body, headers=AUTH)
    assert r.status_code == 200 and set(r.json()["engines"]) == {"e1", "e2"}, r.text
    _wait_models(router, {"test-model": None, "a1": "test-model", "a2": "test-model"})
    for _ in range(2):
        assert tokens(complete(router.url, "a2", None)) == ref["a2"]
    assert e2.stats()["stats"]["prompt_tokens"] > before
    r = httpx.post(f"{router.url}/admin/load_lora_adapter", json=body, headers=AUTH)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{router.url}/admin/unload_lora_adapter", json={"lora_name": "a2"},
                   headers=AUTH)
    assert r.status_code == 200, r.text
    _wait_models(router, {"test-model": None, "a1": "test-model"})
    assert complete(router.url, "a2", None).status_code == 404
