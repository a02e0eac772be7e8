"""The engine daemon end to end: `microserve engine` as real processes (frontend and engine
core), real HTTP, the real SmolLM2-135M-Instruct, spoken to through the official `openai` client
(raw httpx where the status line, the error JSON or the connection itself is the point).

Daemons: one shared by most tests (`engine`), a small one for KV pressure (`small_engine`: 24
pages of 16 = 384 tokens of KV), one with short steps (`short_steps_engine`), these three
started together, and a throwaway one whose engine core is killed. After every
test each live daemon must go idle, with its KV cache intact and no page held.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import DAEMON_LOGS, _hf_model, hf_generate, hf_greedy
from daemons import IDLE_KEYS, LIVE, Daemon, gone_within, serve_together

from microserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2"  # the shared daemon's --served-model-name
MAX_MODEL_LEN = 1024
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CAPITAL_ANSWER = "The capital of France is Paris."  # then eos: 7 tokens + eos
FOX = "The quick brown fox"  # greedy: " with a quick brown bear.\n\nThe original ..." (no eos soon)
FIB = "def fibonacci(n):"


@pytest.fixture(scope="module")
def daemons(smollm2_dir, tmp_path_factory) -> Iterator[tuple[Daemon, ...]]:
    """The shared daemon, the small one and the one with short steps, started together."""
    def log(name: str):
        return tmp_path_factory.mktemp(name) / "daemon.log"

    yield from serve_together(
        Daemon(smollm2_dir, log("engine"), MODEL, "--num-pages", "256",
               "--max-model-len", str(MAX_MODEL_LEN)),
        Daemon(smollm2_dir, log("small-engine"), "small", "--num-pages", "24",
               "--page-size", "16"),
        # Steps of 64 tokens: a 250-token prompt takes 4 of them to score.
        Daemon(smollm2_dir, log("short-steps"), "steps", "--num-pages", "256",
               "--max-num-batched-tokens", "64"))


@pytest.fixture(scope="module")
def engine(daemons) -> Daemon:
    return daemons[0]


@pytest.fixture(scope="module")
def small_engine(daemons) -> Daemon:
    return daemons[1]


@pytest.fixture(autouse=True)
def engines_idle_and_intact(request):
    """After every test: each live daemon is up, goes idle, passes the KV integrity check and
    holds no page (a leak shows up right after the scenario that caused it)."""
    request.node.stash[DAEMON_LOGS] = [d.log_path for d in LIVE]
    yield
    for daemon in LIVE:
        assert daemon.proc.poll() is None, f"daemon {daemon.name!r} died"
        body = daemon.wait_idle(timeout_s=30)
        assert body["integrity"] == "ok", f"daemon {daemon.name!r}: {body['integrity']}"
        assert {k: body["stats"][k] for k in IDLE_KEYS} == dict.fromkeys(IDLE_KEYS, 0), body


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


# ---- helpers ----------------------------------------------------------------------------------


def chat_prompt_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def complete(client: openai.OpenAI, prompt, max_tokens: int, **kw):
    """A greedy /v1/completions request to the shared daemon."""
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw)  # fmt: skip


def chat(client: openai.OpenAI, max_tokens: int, messages=CAPITAL, **kw):
    """A greedy /v1/chat/completions request to the shared daemon."""
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kw)  # fmt: skip


def sse_data(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def metric(text: str, series: str) -> float:
    """The value of one Prometheus series (`name` or `name{labels}`); 0 if it is not there yet."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def hf_logprobs(model_dir: str, sequences: list[list[int]]):
    """Hugging Face's log-softmax at every position of each sequence (all of one length):
    a [batch, length, vocab] tensor; row i predicts token i + 1."""
    import torch

    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor(sequences)).logits
    return torch.log_softmax(logits.float(), dim=-1)


def hf_greedy_batch(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """conftest's `hf_greedy` (eos may be chosen; generation goes on after it) for prompts of
    one length, all in one batch (no padding needed): one decode pass for all, not one each."""
    import torch

    model, ids, out = _hf_model(model_dir), torch.tensor(prompts), []
    past = None
    with torch.no_grad():
        for _ in range(n):
            step = model(ids, past_key_values=past, use_cache=True)
            past, ids = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
    return torch.cat(out, dim=1).tolist()


def hf_greedy_with_top(model_dir: str, prompt: list[int], n: int, k: int):
    """HF's greedy continuation of `prompt`, n tokens: [(token, logprob, [(id, logprob)] * k)]."""
    seq, out = list(prompt), []
    for _ in range(n):
        row = hf_logprobs(model_dir, [seq])[0, -1]
        top = row.topk(k)
        alternatives = list(zip(top.indices.tolist(), top.values.tolist()))
        out.append((alternatives[0][0], alternatives[0][1], alternatives))
        seq.append(alternatives[0][0])
    return out


# ---- 1-7: generation through the openai client ----------------------------------------------


def test_chat_answers_capital_of_france_with_consistent_usage(client, tok):
    prompt_len = len(chat_prompt_ids(tok, CAPITAL))
    first = chat(client, 32)
    assert first.model == MODEL and first.object == "chat.completion"
    assert first.id.startswith("chatcmpl-")
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == CAPITAL_ANSWER
    assert first.choices[0].finish_reason == "stop"
    completion_len = len(tok.encode(CAPITAL_ANSWER, add_special_tokens=False)) + 1  # + eos
    assert (first.usage.prompt_tokens, first.usage.completion_tokens,
            first.usage.total_tokens) == (prompt_len, completion_len, prompt_len + completion_len)
    # The same conversation again: its prompt's whole pages (all but the last token, in pages
    # of 16) now come from the prefix cache, and the answer does not change.
    again = chat(client, 32)
    assert again.choices[0].message.content == CAPITAL_ANSWER
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_len - 1) // 16 * 16


def test_batched_completions_equal_hf_greedy(client, engine, tok, smollm2_dir):
    fox_ids, fib_ids = tok.encode(FOX), tok.encode(FIB)
    fox_ref, fib_ref = (tok.decode(ids) for ids in hf_greedy(smollm2_dir, [fox_ids, fib_ids], 16))
    prompts = {"fox as text": (FOX, fox_ref), "fox as ids": (fox_ids, fox_ref),
               "fib as ids": (fib_ids, fib_ref)}  # fmt: skip
    running_seen = []
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = {name: pool.submit(complete, client, prompt, 16, extra_body={"ignore_eos": True})
                   for name, (prompt, _) in prompts.items()}  # fmt: skip
        while not all(f.done() for f in futures.values()):
            running_seen.append(engine.stats(check=False)["stats"]["running"])
            time.sleep(0.05)
    for name, (prompt, expected) in prompts.items():
        r = futures[name].result()
        assert r.choices[0].text == expected, name
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 16), name
        assert r.usage.prompt_tokens == len(fox_ids if name.startswith("fox") else fib_ids), name
    assert max(running_seen) == 3, f"the three requests never ran together: {running_seen}"


def test_streamed_chat_equals_non_streamed(client):
    plain = chat(client, 16)
    chunks = list(chat(client, 16, stream=True, stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    # One opening chunk with the role, one per token (the last, eos, has no text), then usage.
    assert len(content_chunks) == 1 + plain.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == plain.choices[0].message.content == CAPITAL_ANSWER
    finish = [c.choices[0].finish_reason for c in content_chunks]
    assert finish == [None] * (len(content_chunks) - 1) + ["stop"]
    assert [c.usage for c in content_chunks] == [None] * len(content_chunks)
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens,
            usage_chunk.usage.total_tokens) == (plain.usage.prompt_tokens,
                                                plain.usage.completion_tokens,
                                                plain.usage.total_tokens)  # fmt: skip
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_streamed_completion_equals_non_streamed(client):
    plain = complete(client, FOX, 10)
    assert plain.choices[0].finish_reason == "length"
    chunks = list(complete(client, FOX, 10, stream=True, stream_options={"include_usage": True}))
    *content_chunks, usage_chunk = chunks
    assert len(content_chunks) == 10  # one per token
    assert "".join(c.choices[0].text for c in content_chunks) == plain.choices[0].text
    finish = [c.choices[0].finish_reason for c in content_chunks]
    assert finish == [None] * 9 + ["length"]
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (4, 10)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")


def test_stop_string_ends_the_text_right_before_it(client, tok):
    full = complete(client, FOX, 8).choices[0].text
    stop = "wn be"  # inside " brown bear": spans two tokens
    expected = full[: full.index(stop)]
    assert expected == " with a quick bro"
    ids = tok.encode(full, add_special_tokens=False)
    tokens_to_stop = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    stops = ["text that never comes", stop]
    r = complete(client, FOX, 8, stop=stops)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    assert r.usage.completion_tokens == tokens_to_stop == 5
    streamed = list(complete(client, FOX, 8, stop=stops, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in streamed[:-1]] == [None] * (len(streamed) - 1)
    r = chat(client, 8, stop="Paris")
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (
        "The capital of France is ", "stop")


@pytest.mark.parametrize("max_tokens, chat_text, completion_text", [
    (1, "The", " with"),
    (5, "The capital of France is", " with a quick brown bear"),
])  # fmt: skip
def test_max_tokens_is_exact(client, max_tokens, chat_text, completion_text):
    r = chat(client, max_tokens)
    assert (r.choices[0].message.content, r.choices[0].finish_reason,
            r.usage.completion_tokens) == (chat_text, "length", max_tokens)
    r = complete(client, FOX, max_tokens)
    assert (r.choices[0].text, r.choices[0].finish_reason,
            r.usage.completion_tokens) == (completion_text, "length", max_tokens)


def test_seed_makes_sampling_reproducible_whatever_the_batch(client):
    def sample(seed, max_tokens=8, prompt="Once upon a time"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      temperature=1.0, seed=seed)  # fmt: skip
        return r.choices[0].text

    alone = sample(1234)
    with ThreadPoolExecutor(2) as pool:  # the same request next to an unseeded one
        neighbour = pool.submit(sample, None, 12, "In a galaxy far away")
        batched = pool.submit(sample, 1234)
        neighbour.result()
    assert batched.result() == alone
    assert sample(1235) != alone  # checked: a different story for this prompt and these seeds


def test_vllm_text_options_keep_the_stop_and_the_special_tokens(client):
    """include_stop_str_in_output keeps a stop string (and, with skip_special_tokens false,
    the eos token's text) in the output, as vLLM does."""
    plain = complete(client, FOX, 12, stop=[" bear"]).choices[0]
    kept = complete(client, FOX, 12, stop=[" bear"],
                    extra_body={"include_stop_str_in_output": True}).choices[0]
    assert plain.text == " with a quick brown" and plain.finish_reason == "stop"
    assert kept.text == " with a quick brown bear" and kept.finish_reason == "stop"
    answer = chat(client, 32, extra_body={"include_stop_str_in_output": True,
                                          "skip_special_tokens": False}).choices[0]
    assert (answer.message.content, answer.finish_reason) == (CAPITAL_ANSWER + "<|im_end|>",
                                                               "stop")
    assert chat(client, 32, extra_body={"include_stop_str_in_output": True}).choices[
        0].message.content == CAPITAL_ANSWER  # the eos's text is skipped as a special token


def test_vllm_prompt_options_truncate_and_continue(client, tok, smollm2_dir):
    """truncate_prompt_tokens keeps the prompt's last N tokens (the answer is Hugging Face's
    greedy one for those alone); continue_final_message leaves the assistant's last turn open
    and the model goes on from its words."""
    ids = tok.encode(FIB) + tok.encode(FOX, add_special_tokens=False)
    (want,) = hf_greedy(smollm2_dir, [ids[-5:]], 8)
    r = complete(client, ids, 8, extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == tok.decode(want)
    messages = CAPITAL + [{"role": "assistant", "content": "The capital of France is"}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False,
                                                continue_final_message=True),
                        add_special_tokens=False)  # fmt: skip
    (want,) = hf_greedy(smollm2_dir, [prompt], 3)
    r = chat(client, 3, messages=messages, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True})
    assert r.usage.prompt_tokens == len(prompt)
    assert tok.decode(prompt, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nThe capital of France is")
    assert r.choices[0].message.content == tok.decode(want)


def test_allowed_token_ids_restrict_every_token(client, tok, smollm2_dir):
    """vLLM's allowed_token_ids: greedy picks the likelier of two allowed tokens at every
    step (Hugging Face's choice between them), sampling never leaves them; an id past the
    vocabulary is a 400 naming the field."""
    a, b = tok.encode(" dog", add_special_tokens=False)[0], tok.encode(" cat",
                                                                   add_special_tokens=False)[0]
    greedy = complete(client, FOX, 4, extra_body={"allowed_token_ids": [a, b],
                                                  "ignore_eos": True})
    r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=6, temperature=1.0,
                                  seed=3, extra_body={"allowed_token_ids": [a, b],
                                                      "ignore_eos": True})
    assert set(r.choices[0].text.split()) <= {"dog", "cat"} and r.usage.completion_tokens == 6
    ids, want = tok.encode(FOX), []
    for _ in range(4):  # Hugging Face's greedy choice between the two, step by step
        logprobs = hf_logprobs(smollm2_dir, [ids + want])[0, -1]
        want.append(a if logprobs[a] >= logprobs[b] else b)
    assert greedy.choices[0].text == tok.decode(want)
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, FOX, 2, extra_body={"allowed_token_ids": [a, tok.vocab_size]})
    assert info.value.body["param"] == "allowed_token_ids"


def test_min_p_reaches_the_sampler(client, tok, smollm2_dir):
    """vLLM's `min_p` through the OpenAI client: at 1 only the most likely token survives, so
    sampling at temperature 1.5 gives Hugging Face's greedy text; at 0 (off) the same seed
    samples another story (checked for this prompt and seed)."""
    ids = tok.encode(FOX)
    (greedy_ids,) = hf_greedy(smollm2_dir, [ids], 12)

    def sample(min_p):
        r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=12, temperature=1.5,
                                      seed=7, extra_body={"min_p": min_p, "ignore_eos": True})
        return r.choices[0].text

    assert sample(1.0) == tok.decode(greedy_ids)
    assert sample(0.0) != tok.decode(greedy_ids)


def test_penalties_logit_bias_and_min_tokens_equal_hf(client, tok, smollm2_dir):
    """The engine's own server: min_tokens is HF's min_new_tokens (greedy would end after
    3 tokens), repetition_penalty HF's, a -100 logit_bias bans its token; a bias on a token
    past the vocabulary is a 400 naming logit_bias."""
    yes_no = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    want = hf_generate(smollm2_dir, chat_prompt_ids(tok, yes_no), 24, min_new_tokens=8)
    r = chat(client, 24, yes_no, extra_body={"min_tokens": 8})
    assert (r.choices[0].message.content, r.usage.completion_tokens) == (tok.decode(want),
                                                                         len(want))
    assert len(want) >= 8 and len(chat(client, 24, yes_no).choices[0].message.content) < 10
    prompt = tok.encode(FOX)
    want = hf_generate(smollm2_dir, prompt, 16, repetition_penalty=1.3)
    assert complete(client, FOX, 16, extra_body={"repetition_penalty": 1.3}).choices[0].text \
        == tok.decode(want)
    banned = hf_generate(smollm2_dir, prompt, 1)[0]
    want = hf_generate(smollm2_dir, prompt, 16, sequence_bias={(banned,): -100.0})
    r = complete(client, FOX, 16, logit_bias={str(banned): -100})
    assert r.choices[0].text == tok.decode(want) and want[0] != banned
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, FOX, 4, logit_bias={str(tok.vocab_size): 1})
    assert e.value.body["param"] == "logit_bias"


def test_completion_logprobs_are_hf_top_alternatives(client, tok, smollm2_dir):
    prompt = tok.encode(FOX)
    ref = hf_greedy_with_top(smollm2_dir, prompt, 4, 3)
    r = complete(client, prompt, 4, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.token_text(t) for t, _, _ in ref]
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert lp.token_logprobs == pytest.approx([p for _, p, _ in ref], abs=1e-3)
    for i, (_, _, alternatives) in enumerate(ref):
        top = lp.top_logprobs[i]  # best first; the greedy token is the best
        assert list(top) == [tok.token_text(t) for t, _ in alternatives], i
        assert list(top.values()) == pytest.approx([p for _, p in alternatives], abs=1e-3), i


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(client, engine, tok, smollm2_dir):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one token."""
    prompt = tok.encode(FOX + " jumps over the lazy dog")
    ref = hf_logprobs(smollm2_dir, [prompt])[0]
    want = hf_greedy_with_top(smollm2_dir, prompt, 1, 1)[0]
    r = complete(client, prompt, 1, logprobs=1, echo=True)
    choice, n = r.choices[0], len(prompt)
    lp = choice.logprobs
    assert choice.text == tok.decode(prompt) + tok.token_text(want[0])
    assert lp.tokens == [tok.token_text(t) for t in prompt + [want[0]]]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(
        [float(ref[j - 1, prompt[j]]) for j in range(1, n)], abs=1e-3)
    for j in range(1, n):  # the best token, and the scored one beside it when it is not
        best = int(ref[j - 1].argmax())
        assert list(lp.top_logprobs[j])[0] == tok.token_text(best), j
        assert tok.token_text(prompt[j]) in lp.top_logprobs[j], j
    assert lp.token_logprobs[n] == pytest.approx(want[1], abs=1e-3)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1
    # A string prompt comes back as sent; the stream says the same; without logprobs too.
    plain = complete(client, FOX, 4, echo=True).choices[0].text
    assert plain == FOX + complete(client, FOX, 4).choices[0].text
    stream = complete(client, FOX, 4, echo=True, logprobs=0, stream=True)
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == plain
    assert chunks[0].logprobs.token_logprobs[0] is None
    assert len([t for c in chunks for t in c.logprobs.tokens]) == len(tok.encode(FOX)) + 4


@pytest.fixture(scope="module")
def short_steps_engine(daemons) -> Daemon:
    return daemons[2]


def test_echo_scoring_n_choices_scores_once_and_lets_a_short_request_by(short_steps_engine,
                                                                         tok, smollm2_dir):
    """Issue 39: an echo with logprobs and n 4 scored its prompt once per choice, without
    letting others by: a one-line request waited behind all four. Now the prompt is scored
    once (choice 0, in 4 steps); the other choices take its scores and reuse its pages, and a
    request sent when choice 0's first chunk arrives is answered within a few steps of it,
    while choice 0 decodes, instead of after the other choices' 3 x 4 steps of scoring."""
    engine = short_steps_engine
    prompt = tok.encode(" ".join(f"{FOX} number {i} jumps over the lazy dog." for i in range(17)))
    assert 192 < len(prompt) <= 256
    before = engine.stats()["stats"]["prompt_tokens_computed"]
    body = {"model": "steps", "prompt": prompt, "n": 4, "echo": True, "logprobs": 1,
            "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    seen = {i: 0 for i in range(4)}  # tokens received per choice
    scores = {}
    with ThreadPoolExecutor(1) as pool, engine.http.stream(
            "POST", "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        short, tokens_when_sent, tokens_when_done = None, 0, None
        for data in sse_data(response):
            if data == "[DONE]":
                break
            for choice in json.loads(data)["choices"]:
                i, lp = choice["index"], choice["logprobs"]
                if i not in scores:
                    scores[i] = lp["token_logprobs"][:len(prompt)]
                    seen[i] -= len(prompt)  # the echoed prompt's entries
                seen[i] += len(lp["tokens"])
            if short is None and 0 in scores:  # choice 0's prompt is scored: ask for a line
                short = pool.submit(engine.http.post, "/v1/completions", json={
                    "model": "steps", "prompt": FIB, "max_tokens": 1, "temperature": 0})
                tokens_when_sent = seen[0]
            if short is not None and short.done() and tokens_when_done is None:
                tokens_when_done = seen[0]
        assert short.result().status_code == 200
    if tokens_when_done is None:  # answered after the whole stream
        tokens_when_done = seen[0]
    # Scored per choice, choice 0 decoded ~12 tokens before the short request was admitted.
    assert tokens_when_done - tokens_when_sent <= 6, (tokens_when_sent, tokens_when_done)
    assert seen == dict.fromkeys(range(4), 16)
    ref = hf_logprobs(smollm2_dir, [prompt])[0]
    want = [None] + [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    for i in range(4):
        assert scores[i] == scores[0]
    assert scores[0][1:] == pytest.approx(want[1:], abs=1e-3)
    computed = engine.wait_idle(timeout_s=30)["stats"]["prompt_tokens_computed"] - before
    short_len = len(tok.encode(FIB))
    # choice 0 the whole prompt, choices 1-3 what is past its last whole page below the
    # last token (pages of 16), and the short request its own prompt
    assert computed == len(prompt) + 3 * (len(prompt) - (len(prompt) - 1) // 16 * 16) + short_len


def test_chat_logprobs_are_hf_top_alternatives(client, tok, smollm2_dir):
    ref = hf_greedy_with_top(smollm2_dir, chat_prompt_ids(tok, CAPITAL), 3, 2)
    r = chat(client, 3, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "The capital of"
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["The", " capital", " of"]
    assert [c.bytes for c in content] == [list(tok.token_bytes(t)) for t, _, _ in ref]
    assert [c.logprob for c in content] == pytest.approx([p for _, p, _ in ref], abs=1e-3)
    for c, (_, _, alternatives) in zip(content, ref):
        assert [a.bytes for a in c.top_logprobs] == [list(tok.token_bytes(t))
                                                    for t, _ in alternatives]  # fmt: skip
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(
            [p for _, p in alternatives], abs=1e-3)


# ---- 8: errors ----------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CONTEXT_ERROR = ("This model's maximum context length is 1024 tokens. However, you requested 1100 "
                 "tokens (1000 in the prompt, 100 in the completion). Please reduce the length of "
                 "the prompt or completion.")  # fmt: skip


@pytest.mark.parametrize("path, body, status, param, code, message", [
    (CHAT, b'{"model": "smollm2", "messages": [', 400, None, None,
     ["Malformed JSON body", "EOF while parsing"]),
    (CHAT, {"model": MODEL}, 400, "messages", None, ["Missing required field 'messages'"]),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": "ten"}, 400, "max_tokens", None,
     ["Invalid value for 'max_tokens'", "valid integer", '(got "ten")']),
    (CHAT, {"model": MODEL, "messages": HI, "max_tokens": 0}, 400, "max_tokens", None,
     ["Invalid value for 'max_tokens'", "greater than or equal to 1", "(got 0)"]),
    (CHAT, {"model": MODEL, "messages": HI, "temperature": -0.5}, 400, "temperature", None,
     ["Invalid value for 'temperature'", "greater than or equal to 0", "(got -0.5)"]),
    (CHAT, {"model": MODEL, "messages": HI, "top_p": 0}, 400, "top_p", None,
     ["Invalid value for 'top_p'", "greater than 0", "(got 0)"]),
    (CHAT, {"model": MODEL, "messages": HI, "top_p": 1.5}, 400, "top_p", None,
     ["Invalid value for 'top_p'", "less than or equal to 1", "(got 1.5)"]),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", None,
     ["Invalid value for 'logprobs'", "less than or equal to 20", "(got 21)"]),
    (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model", "model_not_found",
     ["The model 'gpt-4o' does not exist"]),
    (COMPLETIONS, {"model": MODEL, "prompt": [504] * 1000, "max_tokens": 100}, 400, "max_tokens",
     None, [CONTEXT_ERROR]),
    (COMPLETIONS, {"model": MODEL, "prompt": [504] * 1030, "max_tokens": 10}, 400, "prompt", None,
     ["maximum context length is 1024 tokens", "requested 1040 tokens (1030 in the prompt"]),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 1100}]}, 400,
     "messages", None, ["maximum context length is 1024 tokens", "leaves no room"]),
    (COMPLETIONS, {"model": MODEL, "prompt": [504, 49152], "max_tokens": 2}, 400, "prompt", None,
     ["Token id 49152 at prompt position 1 is out of range for a vocabulary of 49152 tokens"]),
], ids=["malformed json", "missing messages", "max_tokens ten", "max_tokens 0",
        "temperature -0.5", "top_p 0", "top_p 1.5", "logprobs 21", "unknown model",
        "prompt + max_tokens > context", "prompt > context", "messages fill the context",
        "token id out of vocab"])  # fmt: skip
def test_bad_request_gets_openai_error(engine, path, body, status, param, code, message):
    if isinstance(body, bytes):
        r = engine.http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = engine.http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert r.json() == {"error": error}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", param, code)
    for part in message:
        assert part in error["message"]


def test_openai_client_raises_the_documented_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[504] * 1000, max_tokens=100)
    assert (info.value.status_code, info.value.param, info.value.body["message"]) == (
        400, "max_tokens", CONTEXT_ERROR)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert (info.value.status_code, info.value.code) == (404, "model_not_found")
    # OpenAI's ranges and malformed constraints, refused with the field named.
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}
    for kw, param in (({"temperature": 2.5}, "temperature"),
                      ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
                      ({"response_format": bad_schema}, "response_format.json_schema.schema"),
                      ({"tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **kw)
        assert (info.value.status_code, info.value.param) == (400, param)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "bogus", "content": "x"}])
    assert info.value.param == "messages[0].role"


# ---- 10: clients that go away ------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_the_request(engine):
    before = engine.stats()["stats"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{engine.url}{COMPLETIONS}", json=body) as response:
            assert response.status_code == 200
            events = sse_data(response)
            for _ in range(3):
                assert json.loads(next(events))["choices"][0]["finish_reason"] is None
    # Closed after 3 tokens of 1000: the core must drop the request within a few seconds.
    after = engine.wait_idle(timeout_s=10)["stats"]
    assert {k: after[k] for k in IDLE_KEYS} == dict.fromkeys(IDLE_KEYS, 0)
    assert after["preemptions"] == before["preemptions"]
    assert 3 <= after["generation_tokens"] - before["generation_tokens"] < 100


def test_client_timeout_aborts_a_non_streamed_request(engine):
    before, metrics_before = engine.stats()["stats"], engine.metrics()
    body = {"model": MODEL, "prompt": "In a galaxy far away", "max_tokens": 1000,
            "ignore_eos": True}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}{COMPLETIONS}", json=body, timeout=1.0)
    after = engine.wait_idle(timeout_s=10)["stats"]
    assert {k: after[k] for k in IDLE_KEYS} == dict.fromkeys(IDLE_KEYS, 0)
    assert after["preemptions"] == before["preemptions"]
    assert after["generation_tokens"] - before["generation_tokens"] < 100
    # The frontend answers the vanished client with 499 (nginx's "client closed request").
    series = f'microserve_requests_total{{endpoint="{COMPLETIONS}",status="499"}}'
    deadline = time.monotonic() + 5
    while metric(engine.metrics(), series) == metric(metrics_before, series):
        assert time.monotonic() < deadline, "no 499 counted for the timed-out request"
        time.sleep(0.05)
    assert metric(engine.metrics(), series) == metric(metrics_before, series) + 1
    # ... and ends it as vLLM's watchers count an aborted request
    aborted = f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="abort"}}'
    while metric(engine.metrics(), aborted) == metric(metrics_before, aborted):
        assert time.monotonic() < deadline + 5, "no abort counted for the timed-out request"
        time.sleep(0.05)
    assert metric(engine.metrics(), aborted) == metric(metrics_before, aborted) + 1


# ---- 10b: the Responses API -------------------------------------------------------------------


def test_responses_api_answers_as_the_chat_request_does(client):
    """The official client's `responses.create`, streamed and not, over the real model: the
    greedy answer is chat's (the capital of France, then eos: completed), its usage too."""
    response = client.responses.create(model=MODEL, input=CAPITAL[0]["content"],
                                       max_output_tokens=20, temperature=0)
    assert (response.status, response.output_text) == ("completed", CAPITAL_ANSWER)
    completion = chat(client, 20)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        completion.usage.prompt_tokens, completion.usage.completion_tokens)
    stream = client.responses.create(model=MODEL, input=CAPITAL, max_output_tokens=3,
                                     temperature=0, stream=True)
    events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1]
    assert done.type == "response.incomplete" and done.response.output_text == deltas
    assert CAPITAL_ANSWER.startswith(deltas) and done.response.usage.output_tokens == 3
    assert done.response.incomplete_details.reason == "max_output_tokens"


# ---- 11: models, metrics ----------------------------------------------------------------------


def test_models_lists_the_served_name_and_context(client, engine):
    models = client.models.list().data
    assert [(m.id, m.owned_by, m.max_model_len) for m in models] == [
        (MODEL, "microserve", MAX_MODEL_LEN)]
    assert client.models.retrieve(MODEL) == models[0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert f"microserve engine serving {MODEL!r} on {engine.url}/v1" in engine.log()


def test_metrics_count_requests_tokens_and_kv_pages(client, engine):
    before = engine.metrics()
    complete(client, FOX, 3)
    response = engine.http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after, stats = response.text, engine.stats()["stats"]

    def delta(series):
        return metric(after, series) - metric(before, series)

    assert delta(f'microserve_requests_total{{endpoint="{COMPLETIONS}",status="200"}}') == 1
    assert delta("microserve_time_to_first_token_seconds_count") == 1
    assert delta("microserve_time_per_output_token_seconds_count") == 1
    assert delta("microserve_prompt_tokens_total") == 4
    assert delta("microserve_generation_tokens_total") == 3
    assert delta("microserve_engine_generation_tokens_total") == 3
    # the core's steps (CPU: one per token) and what went through them
    assert delta("microserve_engine_steps_total") == 3
    assert delta("microserve_engine_tokens_sampled_total") == 3
    assert delta("microserve_engine_prompt_tokens_computed_total") == 4 - delta(
        "microserve_prefix_cache_hit_tokens_total")
    assert delta("microserve_engine_step_seconds_total") > 0
    assert metric(after, "microserve_engine_kv_pages_total") == 256
    assert metric(after, "microserve_engine_kv_pages_free") == stats["kv_pages_free"]
    assert metric(after, "microserve_engine_kv_pages_used") == 0
    assert "# TYPE microserve_time_to_first_token_seconds histogram" in after
    # The same figures under vLLM's names, for what watches vLLM servers (labelled by model)
    named = f'{{model_name="{MODEL}"}}'
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count"):
        assert delta(name + named) == 1, name
    reasons = {r: delta(f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="{r}"}}')
               for r in ("stop", "length", "abort")}  # fmt: skip
    assert reasons == {"stop": 0, "length": 1, "abort": 0}
    assert delta("vllm:request_prompt_tokens_sum" + named) == 4
    assert delta("vllm:request_generation_tokens_sum" + named) == 3
    assert delta('vllm:request_generation_tokens_bucket{model_name="%s",le="2.0"}' % MODEL) == 0
    assert delta('vllm:request_generation_tokens_bucket{model_name="%s",le="5.0"}' % MODEL) == 1
    assert delta("vllm:generation_tokens_total" + named) == 3
    assert delta("vllm:prompt_tokens_total" + named) == delta("vllm:prefix_cache_queries_total"
                                                              + named) == 4
    assert metric(after, "vllm:prefix_cache_hits_total" + named) == stats["cached_prompt_tokens"]
    assert metric(after, "vllm:num_preemptions_total" + named) == stats["preemptions"]
    assert metric(after, "vllm:num_requests_running" + named) == 0
    assert metric(after, "vllm:num_requests_waiting" + named) == 0
    held = 256 - stats["kv_pages_free"] - stats["kv_pages_cached"]
    assert metric(after, "vllm:kv_cache_usage_perc" + named) == held / 256 == 0.0
    assert metric(after, "vllm:gpu_cache_usage_perc" + named) == 0.0
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in after


# ---- 9: more work than KV pages ----------------------------------------------------------------

TOPICS = ["bees", "volcanoes", "the Roman empire", "black holes", "photosynthesis",
          "the printing press", "ocean tides", "chess openings"]  # fmt: skip
ESSAY = ("The essay should have an introduction, three paragraphs that each explain one important "
         "idea with a concrete example, and a short conclusion that sums up what the reader has "
         "learned. ")  # fmt: skip
PROMPT_LEN, NEW_TOKENS = 44, 12


def test_more_requests_than_kv_pages_all_finish_with_greedy_outputs(small_engine, tok,
                                                                   smollm2_dir):
    # 8 requests of 44 + 12 = 56 tokens (4 pages of 16 each; the topic makes every first page
    # differ, so nothing is shared): 32 pages wanted, 24 exist. Admission needs only a prompt's 3
    # pages, so 7 or 8 start together and run out of pages as they grow past 48 tokens: the
    # newest are preempted and recomputed later. (Small numbers: decoding on 2 CPU cores is slow.)
    prompts = [tok.encode(f"Write an essay about {t} for a school magazine. " + ESSAY * 2)
               [:PROMPT_LEN] for t in TOPICS]  # fmt: skip
    assert {len(p) for p in prompts} == {PROMPT_LEN}
    before = small_engine.stats()["stats"]
    seen = []
    with openai.OpenAI(base_url=f"{small_engine.url}/v1", api_key="x", max_retries=0,
                       timeout=300) as c, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(c.completions.create, model="small", prompt=p,
                               max_tokens=NEW_TOKENS, temperature=0,
                               extra_body={"ignore_eos": True})
                   for p in prompts]  # fmt: skip
        while not all(f.done() for f in futures):
            seen.append(small_engine.stats(check=False)["stats"])
            time.sleep(0.05)
        results = [f.result() for f in futures]
    after = small_engine.stats()["stats"]
    assert small_engine.proc.poll() is None
    assert after["preemptions"] > before["preemptions"]
    assert max(s["waiting"] for s in seen) > 0
    for r in results:
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", NEW_TOKENS)
    # Greedy = HF's, text for text (the text does not always re-encode to the generated tokens).
    expected = [tok.decode(ids) for ids in hf_greedy_batch(smollm2_dir, prompts, NEW_TOKENS)]
    for i, r in enumerate(results):
        assert r.choices[0].text == expected[i], TOPICS[i]


def test_request_larger_than_the_kv_pool_is_refused(small_engine):
    # max_model_len is the model's 8192, but the pool holds 384 tokens: the core refuses it.
    body = {"model": "small", "prompt": [504] * 300, "max_tokens": 100}
    for stream in (False, True):
        r = small_engine.http.post(COMPLETIONS, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert r.json() == {"error": {
            "message": "prompt (300 tokens) + max_tokens (100) = 400 exceeds the KV cache "
                       "capacity of 384 tokens",
            "type": "invalid_request_error", "param": "max_tokens", "code": None}}


# ---- 12: the engine core dies -------------------------------------------------------------------


def test_core_death_ends_open_streams_and_the_daemon(smollm2_dir, tmp_path, request):
    daemon = Daemon(smollm2_dir, tmp_path / "daemon.log", "doomed", "--num-pages", "64")
    request.node.stash[DAEMON_LOGS].append(daemon.log_path)
    try:
        daemon.wait_ready()
        core = daemon.core_pid()
        body = {"model": "doomed", "prompt": "Once upon a time", "max_tokens": 500,
                "ignore_eos": True, "stream": True}  # fmt: skip
        # A read timeout of 10 s: a stream left hanging fails the test instead of blocking it.
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", f"{daemon.url}{COMPLETIONS}", json=body) as response:
                events = sse_data(response)
                for _ in range(3):
                    assert json.loads(next(events))["choices"][0]["finish_reason"] is None
                os.kill(core, signal.SIGKILL)
                rest = list(events)
        # Tokens already on their way may still arrive; then an error event and [DONE].
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2]) == {"error": {
            "message": "Service unavailable: engine core process exited", "type": "server_error",
            "param": None, "code": "service_unavailable"}}
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in rest[:-2])
        code = daemon.proc.wait(15)
        # The daemon exits on its own, with 1: a supervisor sees the failure.
        assert code == 1
        assert "ERROR microserve.engine: engine core process exited (code -9)" in daemon.log()
        assert gone_within(core, 1)
    finally:
        daemon.stop()
