"""The router end to end: `microserve up` with two SmolLM2-135M engines (a prefill and a decode
engine, KV through shared memory), driven through the official `openai` client.

Every built-in strategy must give exactly Hugging Face's greedy text (which one engine alone
gives: tests/test_engine_server.py), streaming and not, chat and completions; strategies swap
under load without a request failing; broken uploads leave the old strategy; the admin API
needs its token; a context migrates. After every test both engines are idle with their KV
cache intact; at the end Ctrl-C stops the whole deployment.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat

import httpx
import pytest
from conftest import DAEMON_LOGS, hf_generate, hf_greedy
from daemons import ENGINE_AUTH
from deployments import RouterProcess, assert_quiet, engine_stats, up_prefill_decode
from openai import AsyncOpenAI

from microserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

ADMIN = "admin-s3cret"
# Greedy tokens compared with Hugging Face's per request: a wrong split or lost KV shows in the
# first few, and each one more costs ~0.1 s on the engine and as much for the reference.
N_NEW = 6
ENGINE_ARGS = ["--num-pages", "512", "--max-model-len", "4096"]
TEXT = ("Paged attention keeps the key and value cache of each sequence in fixed-size pages, "
        "so memory is allocated on demand and shared between requests that start alike. ")
GREEDY = {"temperature": 0, "max_tokens": N_NEW, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def up(smollm2_dir, tmp_path_factory):
    yield from up_prefill_decode(tmp_path_factory.mktemp("up"), smollm2_dir, ENGINE_ARGS, ADMIN)


@pytest.fixture
def admin(up):
    with httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=60) as http:
        yield http


@pytest.fixture(autouse=True)
def engines_quiet(request):
    if "up" not in request.fixturenames:
        yield
        return
    up = request.getfixturevalue("up")
    request.node.stash[DAEMON_LOGS] = [up.log_path]
    yield
    for name, url in up.engine_urls.items():
        assert_quiet(name, url)


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def client(up) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)


def use(admin, **body) -> dict:
    r = admin.put("/admin/strategy", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


async def complete(c: AsyncOpenAI, prompt, stream: bool) -> tuple[str, object]:
    if not stream:
        r = await c.completions.create(model="test-model", prompt=prompt, **GREEDY)
        return r.choices[0].text, r.usage
    text, usage = "", None
    async for chunk in await c.completions.create(
            model="test-model", prompt=prompt, stream=True,
            stream_options={"include_usage": True}, **GREEDY):
        text += "".join(ch.text for ch in chunk.choices)
        usage = chunk.usage or usage
    return text, usage


async def chat(c: AsyncOpenAI, text: str, stream: bool) -> tuple[str, object]:
    messages = [{"role": "user", "content": text}]
    if not stream:
        r = await c.chat.completions.create(model="test-model", messages=messages, **GREEDY)
        return r.choices[0].message.content, r.usage
    out, usage = "", None
    async for chunk in await c.chat.completions.create(
            model="test-model", messages=messages, stream=True,
            stream_options={"include_usage": True}, **GREEDY):
        out += "".join(ch.delta.content or "" for ch in chunk.choices)
        usage = chunk.usage or usage
    return out, usage


STRATEGIES = {
    "data_parallel": {"builtin": "data_parallel"},
    "pd": {"builtin": "pd"},
    "balanced_fixed": {"builtin": "balanced_pd", "args": {"ratio": 0.2}},
    "balanced_adaptive": {"builtin": "balanced_pd", "args": {"adaptive": True}},
    "context_migration": {"builtin": "context_migration", "args": {"min_tokens": 16}},
    "auto": {"builtin": "auto"},
    "auto_balanced": {"builtin": "auto", "args": {"kinds": ["balanced"], "ratios": [0.2]}},
}


# A strategy sees token ids and sampling parameters: chat or completion, streamed or not, is the
# router's OpenAI layer around it. So every strategy serves a token-id prompt (what P sends is
# exactly its split) and a streamed chat, and these two also a streamed text completion and a
# chat answered whole (each request ~1 s of decoding and as much for Hugging Face's reference).
EVERY_KIND = ("data_parallel", "pd")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
async def test_each_strategy_gives_the_greedy_tokens_of_one_engine(up, admin, tok, smollm2_dir,
                                                                   strategy):
    use(admin, **STRATEGIES[strategy])
    tag = f"[{strategy}] "
    ids_prompt = tok.encode(tag + "Token ids: " + TEXT, add_special_tokens=False)
    asked = [(complete, ids_prompt, False), (chat, tag + "Chat, streamed: what is a radix tree?",
                                             True)]  # (how, prompt, streamed)
    if strategy in EVERY_KIND:
        asked += [(complete, tag + "Completion: " + TEXT, True),
                  (chat, tag + "Chat: explain paged attention in one sentence.", False)]
    prompts = [chat_ids(tok, prompt) if how is chat else
               prompt if isinstance(prompt, list) else tok.encode(prompt)
               for how, prompt, _ in asked]
    want = [tok.decode(t) for t in hf_greedy(smollm2_dir, prompts, N_NEW)]
    sent_before = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    c = client(up)
    got = [await complete(c, ids_prompt, stream=False)]
    sent = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    got += [await how(c, prompt, stream=streamed) for how, prompt, streamed in asked[1:]]
    await c.close()
    assert [text for text, _ in got] == want
    for (_, usage), prompt in zip(got, prompts):
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), N_NEW)
    # The token-id prompt is new to both engines: what P sent is exactly the strategy's split
    # (pd: all of it, with the first token P sampled).
    n = len(ids_prompt)
    # auto: idle engines, so the whole request on D costs least (no handover; nobody decoding
    # on D to delay); restricted to balanced at 0.2, the fixed split's
    expected_sent = {"data_parallel": 0, "pd": n, "balanced_fixed": n - math.ceil(0.2 * n),
                     "context_migration": 0, "auto": 0,
                     "auto_balanced": n - math.ceil(0.2 * n)}
    if strategy in expected_sent:
        assert sent - sent_before == expected_sent[strategy]
    else:  # adaptive, the model without data yet (a fresh instance): the start ratio 0.2
        assert sent - sent_before == n - math.ceil(0.2 * n)


async def test_responses_through_prefill_decode_answer_as_chat_does(up, admin):
    """The Responses API through the router's P/D strategy (P prefills and sends the KV, D
    decodes): the greedy answer and usage chat gets through the same strategy, streamed and
    not (the first of the three sent the whole prompt's KV; the others, what D's prefix cache
    lacked)."""
    use(admin, **STRATEGIES["pd"])
    c = client(up)
    question = "[responses] What is a radix tree? Answer in one sentence."
    sent = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    chat_answer = await c.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": question}],
        max_tokens=N_NEW, temperature=0)
    response = await c.responses.create(model="test-model", input=question,
                                        max_output_tokens=N_NEW, temperature=0)
    events = [e async for e in await c.responses.create(
        model="test-model", input=question, max_output_tokens=N_NEW, temperature=0,
        stream=True)]
    await c.close()
    text = chat_answer.choices[0].message.content
    assert response.output_text == text == events[-1].response.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat_answer.usage.prompt_tokens, chat_answer.usage.completion_tokens)
    after = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    assert after - sent >= chat_answer.usage.prompt_tokens


def streamed_chunks(up, prompt: list[int], max_tokens: int) -> tuple[list[dict], dict]:
    """A streamed completion's chunks as the client gets them, less what differs by request
    (id, created), and the usage's cached_tokens apart (a prefix cache hit differs too)."""
    body = {"model": "test-model", "prompt": prompt, "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    chunks, cached = [], None
    with httpx.stream("POST", up.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            del chunk["id"], chunk["created"]
            if chunk.get("usage"):
                cached = chunk["usage"].pop("prompt_tokens_details", None)
            chunks.append(chunk)
    return chunks, cached


@pytest.mark.parametrize("max_tokens", [N_NEW, 1])
async def test_pd_streams_the_chunks_one_engine_streams(up, admin, tok, max_tokens):
    """P/D hands P's first token to the client before D is called, and D's stream goes on
    after it: chunk for chunk (tokens, finish, usage) what a data-parallel request streams,
    the first token once. max_tokens 1: the handed-over token is the whole answer; it went
    out before D said so, so the finish follows in a chunk of its own, with no text."""
    prompt = tok.encode(f"[pd = dp, {max_tokens}] " + TEXT, add_special_tokens=False)
    use(admin, builtin="pd")
    pd, pd_cached = streamed_chunks(up, prompt, max_tokens)
    use(admin, builtin="data_parallel")
    dp, _ = streamed_chunks(up, prompt, max_tokens)
    if max_tokens == 1:
        first, finish, usage = pd
        assert finish["choices"] == [{**dp[0]["choices"][0], "text": ""}]
        assert [first["choices"][0]["text"], first["choices"][0]["finish_reason"]] == [
            dp[0]["choices"][0]["text"], None]
        pd = [{**first, "choices": [{**first["choices"][0], "finish_reason": "length"}]},
              usage]
    assert pd == dp
    assert len([c for c in dp if c["choices"]]) == max_tokens  # one chunk per token
    assert dp[-1]["usage"]["completion_tokens"] == max_tokens
    assert pd_cached in (None, {"cached_tokens": 0})  # a new prompt: sent, not cached


@pytest.mark.parametrize("strategy", ["pd", "balanced_fixed", "context_migration"])
async def test_echo_with_logprobs_goes_whole_to_one_engine_under_any_strategy(
        up, admin, tok, smollm2_dir, strategy):
    """lm-evaluation-harness's scoring request (echo, logprobs): the prompt is computed on one
    engine, nothing is sent between them, and the scores are Hugging Face's."""
    import torch
    from conftest import _hf_model

    use(admin, **STRATEGIES[strategy])
    prompt = tok.encode(f"[{strategy}] Score me: " + TEXT, add_special_tokens=False)
    with torch.no_grad():
        ref = _hf_model(smollm2_dir)(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    sent_before = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    c = client(up)
    r = await c.completions.create(model="test-model", prompt=prompt, max_tokens=1,
                                   temperature=0, logprobs=1, echo=True)
    await c.close()
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(
        [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=1e-3)
    assert r.choices[0].text == tok.decode(prompt) + tok.token_text(int(ref[-1].argmax()))
    sent = engine_stats(up.engine_urls["p"], check=False)["stats"]["kv_tokens_sent"]
    assert sent == sent_before


async def test_pd_leaves_the_first_token_to_d_where_d_must_sample_it(up, admin, tok,
                                                                       smollm2_dir):
    """With logprobs asked for, or a seeded random sample, P sends all but the last prompt
    token and D samples the first token itself: the same tokens and logprobs as one engine."""
    use(admin, builtin="pd")
    prompt = tok.encode("[pd, sampled on D] Completion: " + TEXT, add_special_tokens=False)
    want, = hf_greedy(smollm2_dir, [prompt], N_NEW)
    n, p = len(prompt), up.engine_urls["p"]
    c = client(up)
    try:
        sent_before = engine_stats(p, check=False)["stats"]["kv_tokens_sent"]
        r = await c.completions.create(model="test-model", prompt=prompt, logprobs=1, **GREEDY)
        assert r.choices[0].text == tok.decode(want)
        assert len(r.choices[0].logprobs.token_logprobs) == N_NEW
        sent = engine_stats(p, check=False)["stats"]["kv_tokens_sent"]
        assert sent - sent_before == n - 1
        seeded = [await c.completions.create(
            model="test-model", prompt=prompt, temperature=1.0, seed=11, max_tokens=N_NEW,
            extra_body={"ignore_eos": True}) for _ in range(2)]
        assert seeded[0].choices[0].text == seeded[1].choices[0].text
        # D holds the prompt's whole pages now: P sends the rest of prompt[:-1].
        rest = (n - 1) - (n - 1) // 16 * 16
        assert engine_stats(p, check=False)["stats"]["kv_tokens_sent"] - sent == 2 * rest
    finally:
        await c.close()


async def test_logit_bias_and_repetition_penalty_through_pd(up, admin, tok, smollm2_dir):
    """Through P/D with the official client: a +100 logit_bias makes every token that token,
    streamed chat or not, sampled or greedy; repetition_penalty gives Hugging Face's tokens.
    P sends prompt[:-1] and D samples the first token itself (with the penalty's history)."""
    use(admin, builtin="pd")
    yes = tok.encode(" yes", add_special_tokens=False)[0]
    prompt = tok.encode("[pd, penalized] Completion: " + TEXT, add_special_tokens=False)
    n, p = len(prompt), up.engine_urls["p"]
    want = hf_generate(smollm2_dir, prompt, N_NEW, repetition_penalty=1.3)
    assert len(want) == N_NEW and want != hf_greedy(smollm2_dir, [prompt], N_NEW)[0]
    c = client(up)
    try:
        sent_before = engine_stats(p, check=False)["stats"]["kv_tokens_sent"]
        r = await c.completions.create(model="test-model", prompt=prompt, temperature=0,
                                       max_tokens=N_NEW,
                                       extra_body={"repetition_penalty": 1.3})
        assert r.choices[0].text == tok.decode(want)
        assert engine_stats(p, check=False)["stats"]["kv_tokens_sent"] - sent_before == n - 1
        messages = [{"role": "user", "content": "[pd, biased] Say something."}]
        r = await c.chat.completions.create(model="test-model", messages=messages,
                                            max_tokens=N_NEW, logit_bias={str(yes): 100})
        assert r.choices[0].message.content == tok.decode([yes] * N_NEW)
        assert r.usage.completion_tokens == N_NEW
        text = ""
        async for chunk in await c.chat.completions.create(
                model="test-model", messages=messages, max_tokens=N_NEW, temperature=0,
                logit_bias={str(yes): 100}, stream=True):
            text += "".join(ch.delta.content or "" for ch in chunk.choices)
        assert text == tok.decode([yes] * N_NEW)
    finally:
        await c.close()


async def test_n_choices_and_a_batch_of_prompts_through_pd(up, admin, tok, smollm2_dir):
    """n > 1 and a batch of completion prompts, through the pd strategy: each choice is its own
    request to the engines, but a prompt's KV moves from P to D once (the other choices fork
    from the first on D: router/forks.py). Greedy choices are each prompt's single-engine
    greedy text, in prompt-major order, streamed or not; seeded sampled choices differ from one
    another and repeat exactly when the request does."""
    use(admin, builtin="pd")
    prompts = [tok.encode(f"[batch {i}] " + TEXT, add_special_tokens=False) for i in range(2)]
    want = [tok.decode(t) for t in hf_greedy(smollm2_dir, prompts, N_NEW)]
    sent_before = engine_stats(up.engine_urls["p"])["stats"]["kv_tokens_sent"]
    c = client(up)
    try:
        r = await c.completions.create(model="test-model", prompt=prompts, n=3, **GREEDY)
        assert [(x.index, x.text) for x in r.choices] == list(enumerate(
            [want[0]] * 3 + [want[1]] * 3))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
            len(prompts[0]) + len(prompts[1]), 6 * N_NEW)
        # greedy: P samples the first token, so it sends each whole prompt, once
        sent = engine_stats(up.engine_urls["p"])["stats"]["kv_tokens_sent"] - sent_before
        assert sent == len(prompts[0]) + len(prompts[1])
        texts = {}
        async for chunk in await c.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "[n] " + TEXT}], n=2,
                stream=True, **GREEDY):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        chat_want = tok.decode(hf_greedy(smollm2_dir, [chat_ids(tok, "[n] " + TEXT)], N_NEW)[0])
        assert texts == {0: chat_want, 1: chat_want}
        sampled = [await c.completions.create(
            model="test-model", prompt=prompts[0], n=3, seed=5, temperature=1.0,
            max_tokens=N_NEW, extra_body={"ignore_eos": True}) for _ in range(2)]
        runs = [[x.text for x in r.choices] for r in sampled]
        assert runs[0] == runs[1] and len(set(runs[0])) == 3
    finally:
        await c.close()


async def test_hot_swap_under_load(up, admin, tok, smollm2_dir):
    """50 concurrent streams while the strategy is swapped back and forth: none fails, each
    gives the greedy text, and each finished on the instance it started on."""
    use(admin, builtin="data_parallel")
    prompts = [f"Request {i}: the capital of country number {i} is" for i in range(5)]
    want = [tok.decode(t) for t in hf_greedy(smollm2_dir, [tok.encode(p) for p in prompts], 8)]
    c = client(up)

    async def one(i: int) -> str:
        text = ""
        async for chunk in await c.completions.create(
                model="test-model", prompt=prompts[i % 5], stream=True, temperature=0,
                max_tokens=8, extra_body={"ignore_eos": True}):
            text += "".join(ch.text for ch in chunk.choices)
        return text

    async def swap_back_and_forth() -> list[int]:
        retired_inflight = []
        for builtin in ["pd", "data_parallel", "balanced_pd", "pd", "data_parallel", "pd"]:
            await asyncio.sleep(0.4)
            loaded = await asyncio.to_thread(use, admin, builtin=builtin)
            state = (await asyncio.to_thread(admin.get, "/admin/strategy")).json()
            retired_inflight += [r["inflight"] for r in state["retired"]]
            assert state["active"]["version"] == loaded["version"]
        return retired_inflight

    first_version = admin.get("/admin/strategy").json()["active"]["version"]
    results = await asyncio.gather(*(one(i) for i in range(50)), swap_back_and_forth())
    await c.close()
    texts, retired_inflight = results[:50], results[50]
    assert texts == [want[i % 5] for i in range(50)]
    assert any(retired_inflight), "no swap happened while requests were in flight"
    history = [h for h in admin.get("/admin/strategy").json()["history"]
               if h["version"] >= first_version]
    assert len(history) == 7
    assert sum(h["started"] for h in history) == 50
    assert all(h["finished"] == h["started"] and h["failed"] == 0 for h in history), history


BROKEN = {
    "syntax": ("from router.strategy import Strategy\nclass X(Strategy:\n", "SyntaxError"),
    "init": ("from router.strategy import Strategy\n"
             "class X(Strategy):\n"
             "    def __init__(self):\n"
             "        raise RuntimeError('refusing to start')\n"
             "    async def generate(self, request, engines):\n"
             "        yield None\n", "RuntimeError: refusing to start"),
}


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_upload_leaves_the_old_strategy_serving(up, admin, tok, case):
    active = use(admin, builtin="pd")
    source, why = BROKEN[case]
    r = admin.put("/admin/strategy", json={"source": source, "filename": f"{case}.py"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert why in error["message"] and error["param"] == "source"
    assert admin.get("/admin/strategy").json()["active"]["version"] == active["version"]
    c = client(up)
    text, usage = await complete(c, "Still serving after a broken upload?", stream=False)
    await c.close()
    assert usage.completion_tokens == N_NEW and text


async def test_admin_api_needs_the_token(up, smollm2_dir, tmp_path):
    for method, path in [("GET", "/admin/strategy"), ("PUT", "/admin/strategy"),
                         ("GET", "/admin/engines"), ("POST", "/admin/migrate")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, up.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(up.url + "/v1/models").status_code == 200  # no client key configured
    # The engines answer only to the deployment's engine key, which up gave them.
    for url in up.engine_urls.values():
        assert httpx.get(url + "/microserving/stats").status_code == 401
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    # A router started without an admin token makes one: printed once, kept in a file only
    # its user can read, and /admin is closed to everyone else.
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_ADMIN_TOKEN"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    router = RouterProcess(smollm2_dir, up.engine_urls, tmp_path / "router.log", env=env)
    try:
        router.wait_ready()
        token_file = tmp_path / "run" / "microserve" / f"admin-token-{router.port}"
        token = token_file.read_text().strip()
        assert len(token) >= 40 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert router.log().count(token) == 1
        for body in ({"source": "x = 1"}, {"builtin": "pd"}):
            r = httpx.put(router.url + "/admin/strategy", json=body)
            assert r.status_code == 401, r.text
        assert httpx.get(router.url + "/admin/engines").status_code == 401
        r = httpx.put(router.url + "/admin/strategy", json={"builtin": "pd"},
                      headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["class"] == "PrefillDecode"
    finally:
        router.stop()


async def test_migrate_moves_a_context_and_the_destination_shows_it_cached(up, admin, tok,
                                                                           smollm2_dir):
    context = tok.encode("Migrated context. " + TEXT * 6, add_special_tokens=False)
    question = tok.encode(" In one word, what is kept in pages?", add_special_tokens=False)
    p, d = up.engine_urls["p"], up.engine_urls["d"]
    # The context is on P (served there once), then moved to D.
    r = httpx.post(p + "/v1/completions", json={"prompt": context, "max_tokens": 1}, timeout=60,
                   headers=ENGINE_AUTH)
    assert r.status_code == 200, r.text
    r = admin.post("/admin/migrate", json={"prompt": context, "source": "p",
                                           "destination": "d"})
    assert r.status_code == 200, r.text
    moved = r.json()
    whole = len(context) // 16 * 16
    assert moved["cached"] == whole and moved["already_cached"] == 0
    assert moved["sent"] == len(context) and moved["reused"] == whole
    # The next request on D computes only what follows the cached pages.
    r = httpx.post(d + "/v1/completions", json={"prompt": context + question, "temperature": 0,
                                                "max_tokens": N_NEW, "ignore_eos": True},
                   timeout=60, headers=ENGINE_AUTH)
    body = r.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    want = tok.decode(hf_greedy(smollm2_dir, [context + question], N_NEW)[0])
    assert body["choices"][0]["text"] == want
    # The router's global policy can keep it there: pin it on d.
    r = admin.post("/admin/pin", json={"prompt": context, "engines": ["d"]})
    assert r.json() == {"tokens": {"d": whole}}
    assert engine_stats(d, check=False)["stats"]["kv_pages_pinned"] == whole // 16
    r = admin.post("/admin/unpin", json={"prompt": context, "engines": ["d"]})
    assert r.json() == {"tokens": {"d": whole}}
    assert engine_stats(d, check=False)["stats"]["kv_pages_pinned"] == 0
    # Unknown engines and bad fields are named.
    r = admin.post("/admin/migrate", json={"prompt": context, "source": "nope",
                                           "destination": "d"})
    assert r.status_code == 404 and "no engine named 'nope'" in r.json()["error"]["message"]
    r = admin.post("/admin/migrate", json={"source": "p", "destination": "d"})
    assert r.status_code == 400 and "exactly one of prompt, text" in r.json()["error"]["message"]


async def test_a_split_migration_computes_the_head_on_the_destination(up, admin, tok,
                                                                      smollm2_dir):
    """BlockLLM's split: d computes the first half of the context itself while p copies the
    rest; d ends holding the whole context, and a request there computes only what follows
    it, with Hugging Face's tokens. `auto` then goes by the times the first one measured (a
    split or a pure copy: one sample a side tells no fixed cost; tests/test_split_rates.py
    checks the rule itself)."""
    p, d = up.engine_urls["p"], up.engine_urls["d"]
    question = tok.encode(" In one word, what is kept in pages?", add_special_tokens=False)
    for i, split in enumerate([0.5, "auto"]):
        context = tok.encode(f"Split migration {i}. " + TEXT * 6, add_special_tokens=False)
        r = httpx.post(p + "/v1/completions", json={"prompt": context, "max_tokens": 1},
                       timeout=60, headers=ENGINE_AUTH)
        assert r.status_code == 200, r.text
        r = admin.post("/admin/migrate", json={"prompt": context, "source": "p",
                                               "destination": "d", "split": split})
        assert r.status_code == 200, r.text
        moved = r.json()
        whole, n = len(context) // 16 * 16, len(context)
        own = moved["own"]
        if split == 0.5:
            assert own == n // 2 // 16 * 16
        assert 0 <= own < n and own % 16 == 0 and moved["computed_on_destination"] == own
        assert moved["sent"] == n - own and moved["cached"] == whole
        r = httpx.post(d + "/v1/completions", headers=ENGINE_AUTH, timeout=60, json={
            "prompt": context + question, "temperature": 0, "max_tokens": N_NEW,
            "ignore_eos": True})
        body = r.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
        want = tok.decode(hf_greedy(smollm2_dir, [context + question], N_NEW)[0])
        assert body["choices"][0]["text"] == want
    r = admin.post("/admin/migrate", json={"prompt": context, "source": "p",
                                           "destination": "d", "split": 1.5})
    assert r.status_code == 400 and "split" in r.json()["error"]["param"]


async def test_engines_list_drain_and_undrain(up, admin):
    engines = {e["name"]: e for e in admin.get("/admin/engines").json()["engines"]}
    assert {n: (e["role"], e["source"], e["state"]) for n, e in engines.items()} == {
        "p": ("prefill", "static", "up"), "d": ("decode", "static", "up")}
    r = admin.post("/admin/engines/d/drain")
    assert r.status_code == 200 and r.json()["state"] == "draining"
    use(admin, builtin="data_parallel")
    before = {n: engine_stats(u, check=False)["stats"]["generation_tokens"]
              for n, u in up.engine_urls.items()}
    c = client(up)
    for i in range(2):
        await complete(c, f"Served by p alone while d drains ({i}).", stream=False)
    await c.close()
    after = {n: engine_stats(u, check=False)["stats"]["generation_tokens"]
             for n, u in up.engine_urls.items()}
    assert {n: after[n] - before[n] for n in after} == {"p": 2 * N_NEW, "d": 0}
    assert admin.post("/admin/engines/d/undrain").json()["state"] == "up"
    assert admin.post("/admin/engines/nope/drain").status_code == 404
    r = admin.post("/admin/engines", json={"name": "p", "url": up.engine_urls["p"]})
    assert r.status_code == 400 and "already in the pool" in r.json()["error"]["message"]
    # Out of the pool and back in.
    assert admin.delete("/admin/engines/d").json() == {"removed": "d", "open_calls": 0}
    assert [e["name"] for e in admin.get("/admin/engines").json()["engines"]] == ["p"]
    assert admin.delete("/admin/engines/d").status_code == 404
    r = admin.post("/admin/engines", json={"name": "d", "url": up.engine_urls["d"],
                                           "role": "decode"})
    assert r.status_code == 201
    assert (r.json()["role"], r.json()["source"], r.json()["state"]) == ("decode", "admin", "up")
    r = admin.post("/admin/engines", json={"name": "x", "url": up.engine_urls["d"],
                                           "role": "both"})
    assert r.status_code == 400 and "role 'both' is not one of" in r.json()["error"]["message"]


async def test_context_migration_moves_a_context_off_a_draining_engine(up, admin, tok,
                                                                       smollm2_dir):
    """context_migration: a request goes where its context is; when that engine drains, the
    next request on the context moves it (copied from the holder's cache) to the other."""
    use(admin, builtin="context_migration", args={"min_tokens": 16})
    first, second, usage, sent = await _second_question_after_p_drains(
        up, admin, tok, smollm2_dir, "A context that moves. ")
    # p sent all of second to d (its cached pages of the context, and the rest) with the first
    # token it sampled.
    assert sent == len(second)
    # Cached: what p's prefix cache served (the pages second shares with first), not the KV d
    # received.
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert usage.prompt_tokens_details.cached_tokens == common // 16 * 16
    settings = admin.get("/admin/strategy").json()["active"]["settings"]
    assert settings["migrated"] == 1


async def _second_question_after_p_drains(up, admin, tok, smollm2_dir, lead: str):
    """Two questions over one context (`lead` + TEXT): the first served by p (d drained), the
    second after p is drained instead, each answer Hugging Face's greedy one. Returns (first,
    second, second's usage, the tokens of KV p sent for it); both undrained after."""
    context = tok.encode(lead + TEXT * 3, add_special_tokens=False)
    first = context + tok.encode(" First question?", add_special_tokens=False)
    second = context + tok.encode(" Second question?", add_special_tokens=False)
    want = [tok.decode(t) for t in hf_greedy(smollm2_dir, [first, second], N_NEW)]
    p = up.engine_urls["p"]
    c = client(up)
    try:
        admin.post("/admin/engines/d/drain")
        assert (await complete(c, first, stream=False))[0] == want[0]  # served by p
        admin.post("/admin/engines/d/undrain")
        admin.post("/admin/engines/p/drain")
        sent_before = engine_stats(p, check=False)["stats"]["kv_tokens_sent"]
        text, usage = await complete(c, second, stream=False)
        assert text == want[1]
        sent = engine_stats(p, check=False)["stats"]["kv_tokens_sent"] - sent_before
        return first, second, usage, sent
    finally:
        await c.close()
        admin.post("/admin/engines/p/undrain")
        admin.post("/admin/engines/d/undrain")


async def test_context_migration_by_split_computes_half_on_the_target(up, admin, tok,
                                                                      smollm2_dir):
    """context_migration with split 0.5: when the holder drains, the target computes the first
    half of the prompt itself (a request of its own) while the holder sends the rest; the
    target samples the first token: Hugging Face's tokens, and the holder sent only the tail."""
    use(admin, builtin="context_migration", args={"min_tokens": 16, "split": 0.5})
    _, second, _, sent = await _second_question_after_p_drains(
        up, admin, tok, smollm2_dir, "A context split in two. ")
    last = len(second) - 1
    own = last // 2 // 16 * 16
    assert sent == last - own
    settings = admin.get("/admin/strategy").json()["active"]["settings"]
    assert settings["migrated"] == 1 and settings["split"] == 0.5
    assert "p->d" in settings["split_rates"]["copy_tokens_per_s"]


async def test_strategy_benchmark_swaps_strategies_and_shows_where_kv_went(up, admin):
    """bench.strategies on the running deployment: each strategy swapped in through the admin
    API, Poisson arrivals at rate x engines, every request answered, and the engines' counters
    show exactly where the prompt tokens were computed and how many KV tokens moved."""
    from bench.strategies import main_async, parser
    from bench.workloads import parse_lengths, schedule

    argv = ["--base-url", up.url, "--admin-token", ADMIN, "--rates", "4",
            "--duration-s", "1", "--min-requests", "6", "--input-len", "40:3",
            "--output-len", "5:1", "--run-timeout-s", "120", "--seed", "7"]
    for s in ("dp", "dp@d", "1p1d", "1p1d-balance-0.5"):
        argv += ["--strategy", s]
    record = await main_async(parser().parse_args(argv))
    runs = {r["strategy"] if r["engines"] == ["p", "d"] else "dp@d": r for r in record["runs"]}
    assert list(runs) == ["dp", "dp@d", "1p1d", "1p1d-balance-0.5"]
    dists = (parse_lengths("40:3"), parse_lengths("5:1"))
    for label, run in runs.items():
        gpus = len(run["engines"])
        work = schedule(max(6, round(4 * gpus)), 4 * gpus, dists, 7)
        n_in, n_out = [w[1] for w in work], [w[2] for w in work]
        assert (run["requests"], run["completed"], run["failed"], run["timed_out"]) == (
            len(work), len(work), 0, 0), label
        assert (run["input_tokens"], run["output_tokens"]) == (sum(n_in), sum(n_out)), label
        assert run["rate"] == 4 * gpus and all(run[k]["p99_ms"] > 0 for k in ("ttft", "jct"))
        c = run["engine_counters"]
        moved = {"dp": 0, "dp@d": 0, "1p1d": sum(n_in),  # greedy: P samples the first token
                 "1p1d-balance-0.5": sum(n - max(1, math.ceil(0.5 * n)) for n in n_in)}[label]
        assert (c["p"]["kv_tokens_sent"], c["d"]["kv_tokens_received"]) == (moved, moved), label
        assert c["p"]["generation_tokens"] + c["d"]["generation_tokens"] == sum(n_out)
        # each engine's steps in the run; no device timed on CPU
        assert c["d"]["steps"] > 0, label  # (under 1p1d D computes no prompt token)
        assert c["p"]["prompt_tokens_computed"] + c["d"]["prompt_tokens_computed"] > 0, label
        assert all(c[e][k] == 0 for e in ("p", "d") for k in (
            "device_busy_seconds", "device_decode_seconds", "device_decode_steps",
            "device_prompt_seconds", "device_prompt_steps", "device_prompt_tokens")), label
        if label == "dp":  # round robin: both engines served some
            assert c["p"]["generation_tokens"] > 0 and c["d"]["generation_tokens"] > 0
        else:  # P/D, or p drained: d generates every token
            assert c["d"]["generation_tokens"] == sum(n_out), label
    assert {e["state"] for e in admin.get("/admin/engines").json()["engines"]} == {"up"}
    assert admin.get("/admin/strategy").json()["active"]["class"] == "BalancedPD"


async def test_rounds_run_the_strategies_in_turn_each_round_on_its_own_arrivals(up, admin,
                                                                                capsys):
    """--rounds 2: dp then 1p1d, twice; round r's runs share the arrivals of seed 7 + r (the
    input tokens each run sent), and the comparison prints both rounds."""
    from bench.strategies import main_async, parser
    from bench.workloads import parse_lengths, schedule

    argv = ["--base-url", up.url, "--admin-token", ADMIN, "--rates", "4", "--duration-s", "1",
            "--min-requests", "4", "--input-len", "30:3", "--output-len", "3:1",
            "--run-timeout-s", "120", "--seed", "7", "--rounds", "2",
            "--strategy", "dp", "--strategy", "1p1d"]
    record = await main_async(parser().parse_args(argv))
    dists = (parse_lengths("30:3"), parse_lengths("3:1"))
    got = [(r["strategy"], r["round"], r["input_tokens"], r["completed"])
           for r in record["runs"]]
    sent = [sum(w[1] for w in schedule(8, 8, dists, seed)) for seed in (7, 8)]
    assert got == [("dp", 0, sent[0], 8), ("1p1d", 0, sent[0], 8),
                   ("dp", 1, sent[1], 8), ("1p1d", 1, sent[1], 8)]
    out = capsys.readouterr().out
    assert "# rounds at 4/GPU: P99 JCT ms per round; ratio to dp in the same round" in out


async def test_a_phased_run_reports_each_phase_for_each_strategy(up, admin):
    """bench.strategies --phases: every strategy gets the same schedule of two phases; each
    phase's requests are the ones that arrived in it, all answered, and (with an SLO every
    request meets) its goodput is its requests per second of the phase per GPU."""
    from bench.strategies import main_async, parser
    from bench.workloads import overall_goodput, parse_phases, phased_schedule

    spec = "40:3/5:1@3:1,12:2/3:1@3:1"
    argv = ["--base-url", up.url, "--admin-token", ADMIN, "--phases", spec, "--strategy", "dp",
            "--strategy", "1p1d", "--run-timeout-s", "120", "--seed", "5",
            "--slo-ttft-s", "600", "--slo-tpot-ms", "600000"]
    record = await main_async(parser().parse_args(argv))
    planned = phased_schedule(parse_phases(spec), 2, 5)
    counts = [sum(1 for p in planned if p[3] == k) for k in (0, 1)]
    assert [r["strategy"] for r in record["runs"]] == ["dp", "1p1d"]
    for run in record["runs"]:
        assert (run["requests"], run["completed"], run["failed"]) == (len(planned),) * 2 + (0,)
        rows = run["phases"]
        assert [(r["requests"], r["completed"], r["met"]) for r in rows] == [(n, n, n)
                                                                             for n in counts]
        assert [r["goodput_per_gpu"] for r in rows] == [n / 1.0 / 2 for n in counts]
        assert run["phased_goodput_per_gpu"] == overall_goodput(rows, 2)
        assert run["output_tokens"] == sum(p[2] for p in planned)


async def test_an_auto_run_keeps_a_trace_of_what_it_saw_and_a_fixed_one_none(up, admin):
    """--trace-s: while `auto` runs, GET /admin/strategy is sampled into the run's
    strategy_trace (each engine as auto's last choice saw it, its choices so far, the role
    rules holding); a fixed strategy describes none of that and gets no trace."""
    from bench.strategies import main_async, parser

    argv = ["--base-url", up.url, "--admin-token", ADMIN, "--phases", "40:3/5:1@3:2",
            "--strategy", "auto=auto{\"flip_roles\": true}", "--strategy", "dp",
            "--trace-s", "0.2", "--run-timeout-s", "120", "--seed", "3"]
    record = await main_async(parser().parse_args(argv))
    auto, dp = record["runs"]
    assert (auto["completed"], dp["completed"]) == (auto["requests"], dp["requests"])
    assert "strategy_trace" not in dp
    trace = auto["strategy_trace"]
    assert len(trace) >= 5  # a 2-s phase sampled every 0.2 s
    assert [e["t"] for e in trace] == sorted(e["t"] for e in trace)
    assert all(set(e["engines"]) == {"p", "d"} for e in trace)
    chosen = [sum(e["chosen"].values()) for e in trace]
    assert chosen == sorted(chosen) and chosen[-1] <= auto["requests"]
    assert all(isinstance(e["holding_s"], dict) for e in trace)
    # each flip once, in the sample that first saw it, named (none before the first sample)
    assert sum(len(e["flipped"]) for e in trace) == trace[-1]["flips"] - trace[0]["flips"]
    assert trace[0]["flipped"] == []
    assert all({"engine", "from", "to", "reason"} <= set(f) for e in trace for f in e["flipped"])


@pytest.mark.parametrize("strategy", ["data_parallel", "pd"])
async def test_each_request_reports_where_its_first_token_time_went(up, admin, tok, strategy):
    """router/handover.py: one request adds one observation to each stage it went through;
    P's own parts (reported in its remote_send answer) fit inside the send's round trip."""
    from bench.slo import parse_stages

    use(admin, **STRATEGIES[strategy])
    before = parse_stages(httpx.get(up.url + "/metrics").text)
    prompt = tok.encode(f"[stages {strategy}] " + TEXT, add_special_tokens=False)
    c = client(up)
    await complete(c, prompt, stream=True)
    await c.close()
    after = parse_stages(httpx.get(up.url + "/metrics").text)
    name = {"data_parallel": "DataParallel", "pd": "PrefillDecode"}[strategy]
    added = {stage: after[(s, stage)][math.inf] - before.get((s, stage), {}).get(math.inf, 0)
             for (s, stage) in after if s == name}
    added = {stage: n for stage, n in added.items() if n}
    if strategy == "data_parallel":
        assert added == {"ttft": 1, "d_first_chunk": 1}
        return
    # pd on idle engines: P starts beside D's prep_recv (an early send), so prep_recv is on
    # the path too
    assert added == {stage: 1 for stage in ("ttft", "prep_recv", "remote_send", "p_queue",
                                            "p_prefill", "p_chunks", "p_last_step",
                                            "transfer_tail", "send_hops", "handover",
                                            "d_first_chunk")}
    text = httpx.get(up.url + "/metrics").text
    sums = {line.split("stage=\"")[1].split("\"")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("microserve_router_stage_seconds_sum") and name in line}
    assert sums["p_prefill"] > 0
    assert sums["p_queue"] + sums["p_prefill"] + sums["transfer_tail"] <= sums["remote_send"]
    assert sums["p_chunks"] + sums["p_last_step"] == pytest.approx(sums["p_prefill"])
