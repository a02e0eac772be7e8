"""The OpenAI frontend alone, over a scripted fake backend (no engine, no model).

In-process through httpx's ASGI transport; the disconnect, TCP_NODELAY and `openai` client
tests run a real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket

import httpx
import openai
import pytest
import uvicorn
from test_tokenizer import byte_token_ids, make_tokenizer_dir

import microserve
from microserve.backend import BackendUnavailable, GenerateBackend
from microserve.http_limits import HttpLimits
from microserve.http_server import QuietServer, listen_socket
from microserve.metrics import Registry
from microserve.openai.app import build_openai_app
from microserve.openai.protocol import CompletionRequest
from microserve.tokenizer import Tokenizer
from microserve.messages import GenerateChunk, SamplingParams, TokenLogprob

MODEL = "tiny-chat"
MAX_MODEL_LEN = 64


class ScriptedBackend(GenerateBackend):
    """Yields one GenerateChunk per scripted step, then finishes with `finish_reason`.

    `hang`: after the script, wait until closed instead of finishing (a long generation).
    `fail`: raise this after the script instead of finishing.
    """

    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self, steps: list[list[int]], finish_reason: str = "length", *,
                 logprobs: bool = False, cached: int = 0, hang: bool = False,
                 fail: Exception | None = None):
        self.steps, self.finish_reason, self.logprobs = steps, finish_reason, logprobs
        self.cached, self.hang, self.fail = cached, hang, fail
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        self.priorities: list[int] = []  # of each call
        self.aborted: list[str] = []
        self.is_healthy = True

    async def generate(self, request_id, prompt_token_ids, params, priority=0,
                       choices_of=None):
        """Closed (or failed) before its finishing chunk, it is aborted: `aborted` says so."""
        self.calls.append((request_id, list(prompt_token_ids), params))
        self.priorities.append(priority)
        finished = False
        try:
            for i, ids in enumerate(self.steps):
                last = i == len(self.steps) - 1 and not (self.hang or self.fail)
                logprobs = [TokenLogprob(t, -0.25 * t, [(t, -0.25 * t)]) for t in ids]
                finished = last
                yield GenerateChunk(ids, logprobs if self.logprobs else None,
                                    self.finish_reason if last else None,
                                    cached_tokens=self.cached)
                await asyncio.sleep(0)
            if self.fail:
                raise self.fail
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not finished:
                self.aborted.append(request_id)

    async def healthy(self):
        return self.is_healthy

    async def metrics_text(self):
        return "# TYPE microserve_engine_pages gauge\nmicroserve_engine_pages 7.0\n"


class Unavailable(ScriptedBackend):
    async def generate(self, request_id, prompt_token_ids, params, priority=0,
                       choices_of=None):
        raise BackendUnavailable("all engines are down")
        yield  # an async generator, like a real backend


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def steps(tok: Tokenizer, *pieces: str) -> list[list[int]]:
    """One scripted backend output per piece of text."""
    return [tok.encode(p) for p in pieces]


@contextlib.asynccontextmanager
async def client_for(backend: GenerateBackend, tok: Tokenizer):
    transport = httpx.ASGITransport(app=build_openai_app(backend, tok), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


def events(response: httpx.Response) -> list:
    """The SSE body as parsed JSON payloads (and the final "[DONE]")."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1])
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks[:-1]]


def texts(chunks: list) -> list:
    """(text, finish_reason) of each completion chunk."""
    return [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks]


async def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# -- completions and chat --------------------------------------------------------------------

async def test_completion(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), cached=3)
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "the quick", "max_tokens": 5, "temperature": 0, "seed": 1,
            "stop_token_ids": [3], "ignore_eos": True, "user": "u", "unknown": 1})
    body = response.json()
    prompt_ids = tok.encode("the quick")
    assert response.status_code == 200
    assert body["id"].startswith("cmpl-") and len(body["id"]) == 5 + 32
    assert (body["object"], body["model"]) == ("text_completion", MODEL)
    assert body["choices"] == [{"index": 0, "text": "hello world", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 2,
                             "total_tokens": len(prompt_ids) + 2,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert backend.calls == [(body["id"], prompt_ids, SamplingParams(
        max_tokens=5, temperature=0.0, seed=1, stop_token_ids=(3,), ignore_eos=True))]
    assert backend.aborted == []  # the backend finished the request itself


async def test_penalties_logit_bias_and_min_tokens_reach_the_backend(tok):
    backend = ScriptedBackend(steps(tok, "hello"))
    async with client_for(backend, tok) as client:
        chat = await client.post(CHAT, json={
            "messages": HI, "max_completion_tokens": 6, "min_tokens": 6, "presence_penalty": 1,
            "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"7": -100}})
        completion = await client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 3, "logit_bias": {"0": 100, "9": 0.5}})
    assert (chat.status_code, completion.status_code) == (200, 200)
    assert backend.calls[0][2] == SamplingParams(
        max_tokens=6, min_tokens=6, presence_penalty=1.0, frequency_penalty=-0.5,
        repetition_penalty=1.1, logit_bias=((7, -100.0),))
    assert backend.calls[1][2] == SamplingParams(max_tokens=3,
                                                 logit_bias=((0, 100.0), (9, 0.5)))


async def test_priority_reaches_the_backend_for_every_choice(tok):
    """vLLM's `priority` extension field: chat and completions pass it on (default 0)."""
    backend = ScriptedBackend(steps(tok, "hello"))
    async with client_for(backend, tok) as client:
        chat = await client.post(CHAT, json={"messages": HI, "priority": -5, "n": 2})
        completion = await client.post("/v1/completions", json={"prompt": "hi", "priority": 7})
        plain = await client.post("/v1/completions", json={"prompt": "hi"})
    assert (chat.status_code, completion.status_code, plain.status_code) == (200, 200, 200)
    assert backend.priorities == [-5, -5, 7, 0]


async def test_max_tokens_defaults_as_openai_and_vllm_do(tok):
    """Left out: 16 on completions (OpenAI's and vLLM's default), fit to the context left;
    what is left of the context on chat, and on completions given as null."""
    backend = ScriptedBackend(steps(tok, "hello"))
    async with client_for(backend, tok) as client:
        await client.post("/v1/completions", json={"prompt": [5, 6, 7]})  # no model: served one
        await client.post("/v1/completions", json={"prompt": [5] * (MAX_MODEL_LEN - 5)})
        await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": None})
        await client.post("/v1/chat/completions", json={"messages": HI})
    budgets = [call[2].max_tokens for call in backend.calls]
    assert budgets[:3] == [16, 5, MAX_MODEL_LEN - 3]
    assert MAX_MODEL_LEN - 30 < budgets[3] < MAX_MODEL_LEN - 3  # the chat template's tokens


async def test_completion_stream_with_usage(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"))
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={
            "prompt": "the quick", "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(response)
    assert texts(chunks[:2]) == [("hello", None), (" world", "length")]
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 2
    assert chunks[3] == "[DONE]" and len(chunks) == 4
    assert {c["id"] for c in chunks[:3]} == {backend.calls[0][0]}


async def test_allowed_token_ids_reach_the_backend_but_not_beside_a_grammar(tok):
    backend = ScriptedBackend(steps(tok, "hello"))
    async with client_for(backend, tok) as client:
        ok = await client.post("/v1/completions", json={"prompt": "hi",
                                                        "allowed_token_ids": [7, 3, 7]})
        both = await client.post(CHAT, json={"messages": HI, "allowed_token_ids": [7],
                                             "response_format": {"type": "json_object"}})
    assert ok.status_code == 200 and backend.calls[0][2].allowed_token_ids == (7, 3)
    assert both.status_code == 400 and both.json()["error"]["param"] == "allowed_token_ids"
    assert len(backend.calls) == 1


async def test_continuous_usage_in_every_chunk(tok):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far
    (the stream opens once the first output is in: the role chunk counts it), then the usage
    chunk; without include_usage it changes nothing."""
    backend = ScriptedBackend(steps(tok, "hello", " world"))
    hello, world = (len(ids) for ids in steps(tok, "hello", " world"))
    prompt = len(tok.encode(tok.apply_chat_template(HI), add_special_tokens=False))
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with client_for(backend, tok) as client:
        chat = events(await client.post(CHAT, json={"messages": HI, "stream": True,
                                                    "stream_options": options}))
        alone = events(await client.post(CHAT, json={
            "messages": HI, "stream": True, "stream_options": {"continuous_usage_stats": True}}))
    assert [c["usage"]["completion_tokens"] for c in chat[:4]] == [hello, hello, hello + world,
                                                                    hello + world]
    assert chat[3]["choices"] == [] and chat[4] == "[DONE]"
    assert {c["usage"]["prompt_tokens"] for c in chat[:4]} == {prompt}
    assert all("usage" not in c for c in alone[:-1])


async def test_chat_stream(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"))
    messages = [{"role": "user", "content": "hi"}]
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"model": MODEL, "messages": messages, "stream": True})
    chunks = events(response)
    assert [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:3]] == [
        ({"role": "assistant", "content": ""}, None), ({"content": "hello"}, None),
        ({"content": " world"}, "length")]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[3:] == ["[DONE]"]
    prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert backend.calls[0][1] == prompt
    assert prompt[0] == tok.bos_token_id != prompt[1]  # one BOS: the template's


async def test_chat_completion(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), finish_reason="stop")
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 4})
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0,
                                "message": {"role": "assistant", "content": "hello world"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["completion_tokens"] == 2 and backend.calls[0][2].max_tokens == 4


# -- n choices and batches of prompts -------------------------------------------------------

class FailsOne(ScriptedBackend):
    """Generation `victim` (its request id ends with it) fails after the script; the others
    hang until aborted."""

    def __init__(self, steps, victim: str):
        super().__init__(steps, hang=True)
        self.victim = victim

    async def generate(self, request_id, prompt_token_ids, params, priority=0,
                       choices_of=None):
        async for chunk in super().generate(request_id, prompt_token_ids, params):
            yield chunk
            if request_id.endswith(self.victim):
                raise RuntimeError("engine died")


async def test_n_choices_each_a_generation_seeded_apart(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), cached=3)
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={
            "prompt": "the quick", "max_tokens": 5, "n": 3, "seed": 7, "temperature": 0.8})
    body = response.json()
    prompt_ids = tok.encode("the quick")
    assert response.status_code == 200
    assert body["choices"] == [{"index": i, "text": "hello world", "logprobs": None,
                                "finish_reason": "length"} for i in range(3)]
    # the prompt counted once, with what its choices found cached
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 6,
                             "total_tokens": len(prompt_ids) + 6,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    assert [(rid, ids, p.seed) for rid, ids, p in backend.calls] == [
        (f"{body['id']}-{i}", prompt_ids, 7 + i) for i in range(3)]
    assert backend.aborted == []


def test_choice_seeds_wrap_within_64_bits():
    body = CompletionRequest(prompt="hi", seed=2**63 - 1, n=2)
    assert [body.sampling_params(4, None, choice=i).seed for i in range(2)] == [2**63 - 1,
                                                                              -(2**63)]
    assert CompletionRequest(prompt="hi").sampling_params(4, None, choice=1).seed is None


async def test_a_batch_of_prompts_with_n_answers_prompt_by_prompt(tok):
    backend = ScriptedBackend(steps(tok, "ok", "ay"), logprobs=True)
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={
            "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "n": 2, "logprobs": 0})
    body = response.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(i, "okay") for i in range(4)]
    offsets = [c["logprobs"]["text_offset"] for c in body["choices"]]
    assert offsets[0][0] == 0 and offsets == [offsets[0]] * 4  # each choice counts its own
    assert [ids for _, ids, _ in backend.calls] == [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]
    per_choice = sum(len(ids) for ids in backend.steps)
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
        5, 4 * per_choice)


async def test_chat_n_choices_stream_side_by_side(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"))
    async with client_for(backend, tok) as client:
        response = await client.post(CHAT, json={
            "messages": HI, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(response)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == []
    assert chunks[-2]["usage"]["completion_tokens"] == 4
    by_index = {0: [], 1: []}
    for chunk in chunks[:-2]:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append((choice["delta"], choice["finish_reason"]))
    for index in (0, 1):
        assert by_index[index] == [({"role": "assistant", "content": ""}, None),
                                   ({"content": "hello"}, None),
                                   ({"content": " world"}, "length")]
    assert {c["id"] for c in chunks[:-1]} == {chunks[0]["id"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_one_choice_failing_fails_and_aborts_the_others(tok, stream):
    backend = FailsOne(steps(tok, "hello"), victim="-1")
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={
            "prompt": "hi", "n": 3, "stream": stream})
    ids = [rid for rid, _, _ in backend.calls]
    if stream:
        chunks = events(response)
        assert chunks[-2:] == [{"error": {"message": "Internal server error (RuntimeError)",
                                          "type": "server_error", "param": None, "code": None}},
                               "[DONE]"]
    else:
        assert response.status_code == 500
    await eventually(lambda: sorted(backend.aborted) == sorted(ids))  # the victim's too


# -- text: stop strings, stop tokens, multi-byte characters ---------------------------------

async def test_stop_string_split_across_outputs_streaming(tok):
    backend = ScriptedBackend(steps(tok, "xa", "b", "cd"))
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions",
                                     json={"prompt": "hi", "stop": "ab", "stream": True})
    chunks = events(response)
    assert texts(chunks[:-1]) == [("x", None), ("", "stop")]  # "a" was held back, then dropped
    assert chunks[-1] == "[DONE]"
    assert backend.aborted == [backend.calls[0][0]]  # the backend knows no stop strings


async def test_stop_string_non_streaming(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world", " fox"))
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stop": ["zz", "wor"]})
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(steps(tok, "hello")[0]) + len(
        steps(tok, " world")[0])  # tokens up to the one that completed the stop string
    assert backend.aborted == [body["id"]]


async def test_held_back_text_is_released_when_no_stop_follows(tok):
    backend = ScriptedBackend(steps(tok, "xa", "c"))
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions",
                                     json={"prompt": "hi", "stop": ["ab"], "stream": True})
    assert texts(events(response)[:-1]) == [("x", None), ("ac", "length")]
    assert backend.aborted == []


async def test_multibyte_characters_split_across_tokens(tok):
    backend = ScriptedBackend([[t] for t in byte_token_ids(tok, "é😀")])
    async with client_for(backend, tok) as client:
        streamed = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        whole = await client.post("/v1/completions", json={"prompt": "hi"})
    assert texts(events(streamed)[:-1]) == [("é", None), ("😀", "length")]
    assert whole.json()["choices"][0]["text"] == "é😀"
    assert whole.json()["usage"]["completion_tokens"] == 6


async def test_unfinished_character_at_the_end_is_a_replacement_char(tok):
    backend = ScriptedBackend([[t] for t in byte_token_ids(tok, "😀")[:2]])
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert response.json()["choices"][0]["text"] == "\ufffd"


async def test_stop_token_and_eos_text_are_left_out(tok):
    x = tok.encode("x")[0]
    async with client_for(ScriptedBackend([*steps(tok, "hello"), [x]], "stop"), tok) as client:
        by_stop_token = await client.post("/v1/completions",
                                          json={"prompt": "hi", "stop_token_ids": [x]})
    async with client_for(ScriptedBackend([*steps(tok, "hello"), [2]], "stop"), tok) as client:
        by_eos = await client.post("/v1/completions", json={"prompt": "hi"})
    assert by_stop_token.json()["choices"][0]["text"] == "hello"
    assert by_eos.json()["choices"][0]["text"] == "hello"
    assert by_eos.json()["usage"]["completion_tokens"] == len(steps(tok, "hello")[0]) + 1


# -- logprobs --------------------------------------------------------------------------------

async def test_completion_logprobs(tok):
    ids = [t for step in steps(tok, "hello", " world") for t in step]
    backend = ScriptedBackend([[t] for t in ids], logprobs=True)
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi", "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    names = [tok.token_text(t) for t in ids]
    assert "".join(names) == "hello world"
    assert logprobs["tokens"] == names
    assert logprobs["token_logprobs"] == [-0.25 * t for t in ids]
    assert logprobs["top_logprobs"] == [{n: -0.25 * t} for n, t in zip(names, ids)]
    assert logprobs["text_offset"] == [sum(map(len, names[:i])) for i in range(len(ids))]
    assert backend.calls[0][2].logprobs == 1


async def test_chat_logprobs(tok):
    ids = steps(tok, "é")[0]
    backend = ScriptedBackend([ids], logprobs=True)
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in content) == "é".encode()
    assert [e["logprob"] for e in content] == [-0.25 * t for t in ids]
    assert [len(e["top_logprobs"]) for e in content] == [1] * len(ids)
    assert backend.calls[0][2].logprobs == 1


async def test_logprobs_name_tokens_by_id_when_asked(tok):
    """vLLM's return_tokens_as_token_ids: each logprobs token (and alternative) is
    "token_id:ID", its bytes that string's."""
    ids = steps(tok, "hello")[0]
    backend = ScriptedBackend([ids], logprobs=True)
    async with client_for(backend, tok) as client:
        completion = (await client.post("/v1/completions", json={
            "prompt": "hi", "logprobs": 1, "return_tokens_as_token_ids": True})).json()
        chat = (await client.post(CHAT, json={
            "messages": HI, "logprobs": True, "top_logprobs": 1,
            "return_tokens_as_token_ids": True})).json()
    names = [f"token_id:{t}" for t in ids]
    logprobs = completion["choices"][0]["logprobs"]
    assert logprobs["tokens"] == names
    assert logprobs["top_logprobs"] == [{n: -0.25 * t} for n, t in zip(names, ids)]
    assert completion["choices"][0]["text"] == "hello"  # the text is still text
    content = chat["choices"][0]["logprobs"]["content"]
    assert [(e["token"], bytes(e["bytes"]).decode()) for e in content] == [(n, n) for n in names]
    assert [e["top_logprobs"][0]["token"] for e in content] == names


# -- errors ----------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def context_error(total: int, prompt: int, completion: int, where: str, field: str) -> str:
    return (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
            f"requested {total} tokens ({prompt} in the {where}, {completion} in the completion)."
            f" Please reduce the length of the {field} or completion.")


async def test_errors(tok):
    backend = ScriptedBackend(steps(tok, "hello"))
    n_prompt = len(tok.encode("the quick"))
    n_chat = len(tok.encode(tok.apply_chat_template(HI), add_special_tokens=False))
    cases = [  # (path, body, status, param, message or a part of it)
        ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model",
         "The model 'nope' does not exist"),
        ("/v1/completions", {"prompt": "the quick", "max_tokens": 63}, 400, "max_tokens",
         context_error(n_prompt + 63, n_prompt, 63, "prompt", "prompt")),
        (CHAT, {"messages": HI, "max_completion_tokens": 50}, 400, "max_completion_tokens",
         context_error(n_chat + 50, n_chat, 50, "messages", "messages")),
        ("/v1/completions", {"prompt": [5] * 64}, 400, "prompt",
         "maximum context length is 64 tokens. However, your request has 64 tokens in the prompt"),
        ("/v1/completions", {"prompt": [5] * 64, "max_tokens": 1}, 400, "prompt",
         "you requested 65 tokens (64 in the prompt, 1 in the completion)"),
        ("/v1/completions", {"prompt": [5, tok.vocab_size]}, 400, "prompt",
         f"Token id {tok.vocab_size} at prompt position 1 is out of range for a vocabulary of "
         f"{tok.vocab_size} tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt",
         "The prompt is empty after tokenization"),
        ("/v1/completions", {"prompt": ["a"] * 129}, 400, "prompt",
         "a batch of at most 128 prompts, got 129"),
        ("/v1/completions", {"prompt": ["a", [5]]}, 400, "prompt",
         "a batch is all strings or all lists of token ids"),
        ("/v1/completions", {"prompt": [[5], []]}, 400, "prompt",
         "prompt 1 of the batch must be a string or a non-empty list of token ids"),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 43}, 400, "n",
         "3 prompts x n 43 = 129 generations; at most 128 in one request"),
        ("/v1/completions", {"prompt": ["the quick", "the quick brown fox"], "max_tokens": 63},
         400, "max_tokens", context_error(n_prompt + 63, n_prompt, 63, "prompt", "prompt")),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature",
         "Invalid value for 'temperature': Input should be greater than or equal to 0 (got -1)"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n",
         "Invalid value for 'n': Input should be greater than or equal to 1 (got 0)"),
        (CHAT, {"messages": HI, "n": 129}, 400, "n",
         "Invalid value for 'n': Input should be less than or equal to 128 (got 129)"),
        (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role",
         "Invalid value for 'messages[0].role': Input should be 'system', 'developer', 'user', "
         "'assistant' or 'tool' (got \"robot\")"),
        (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content",
         "content is required in a 'user' message"),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature",
         "Input should be less than or equal to 2 (got 2.5)"),
        ("/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, "stop",
         "at most 4 stop sequences, got 5"),
        (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "foo"}}}}, 400, "response_format.json_schema.schema",
         "Invalid response_format.json_schema.schema: Invalid type: foo"),
        (CHAT, {"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format.type",
         "Invalid value for 'response_format.type'"),
        (CHAT, {"messages": HI, "guided_regex": "a(b"}, 400, "guided_regex",
         "Invalid guided_regex: "),
        (CHAT, {"messages": HI, "guided_choice": ["a"], "guided_regex": "a"}, 400,
         "guided_choice", "Only one output constraint per request; got guided_regex, "
         "guided_choice"),
        (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools[0].function",
         "Missing required field 'tools[0].function'"),
        (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice",
         "tool_choice is only allowed when tools are specified"),
        (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
         "tool_choice", "tool_choice names function 'g', which is not among the tools (f)"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
         "(got 21)"),
        # Numbers past what the code can hold (the probe's crashes) and past the vocabulary.
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, 400, "top_k",
         "Input should be less than or equal to 2147483647 (got 9223372036854775808)"),
        ("/v1/completions", {"prompt": "hi", "top_k": tok.vocab_size + 1}, 400, "top_k",
         f"top_k {tok.vocab_size + 1} exceeds the vocabulary of {tok.vocab_size} tokens"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed",
         "Input should be less than or equal to 9223372036854775807 (got 18446744073709551616)"),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, 400, "seed",
         "Input should be greater than or equal to -9223372036854775808"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 2**64]}, 400,
         "stop_token_ids[1]", "Input should be less than or equal to 2147483647"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [tok.vocab_size]}, 400,
         "stop_token_ids", f"stop token id {tok.vocab_size} is out of range for a vocabulary"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, 400, "max_tokens",
         "Input should be less than or equal to 2147483647"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"3": 1, str(tok.vocab_size): 2}},
         400, "logit_bias", f"logit_bias token id {tok.vocab_size} is out of range for a "
         f"vocabulary of {tok.vocab_size} tokens"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"1e3": 1}}, 400, "logit_bias",
         "key '1e3' is not a token id"),
        (CHAT, {"messages": HI, "presence_penalty": -3}, 400, "presence_penalty",
         "Input should be greater than or equal to -2 (got -3)"),
        (CHAT, {"messages": HI, "max_completion_tokens": 5, "min_tokens": 6}, 400, "min_tokens",
         "min_tokens (6) exceeds the completion's max_tokens (5)"),
        # without max_tokens the budget is what is left of the context
        ("/v1/completions", {"prompt": [5] * 60, "min_tokens": 5}, 400, "min_tokens",
         "min_tokens (5) exceeds the completion's max_tokens (4)"),
        ("/v1/completions", {"prompt": [5, 2**64]}, 400, "prompt",
         "Token id 18446744073709551616 at prompt position 1 is out of range"),
        (CHAT, {"messages": HI, "priority": 2**31}, 400, "priority",
         "Input should be less than or equal to 2147483647 (got 2147483648)"),
        ("/v1/completions", {"prompt": "hi", "priority": "high"}, 400, "priority",
         "Input should be a valid integer"),
    ]
    async with client_for(backend, tok) as client:
        for path, body, status, param, message in cases:
            response = await client.post(path, json=body)
            error = response.json()["error"]
            assert (response.status_code, error["param"]) == (status, param), (body, error)
            assert message in error["message"], (message, error["message"])
            assert error["type"] == "invalid_request_error"
        for field in ("temperature", "top_p"):  # JSON's Infinity and NaN, as Python writes them
            for value in ("Infinity", "NaN", "-Infinity"):
                response = await client.post("/v1/completions",
                                             content=f'{{"prompt": "hi", "{field}": {value}}}')
                error = response.json()["error"]
                assert (response.status_code, error["param"]) == (400, field), error
                assert "Input should be a finite number" in error["message"], error
        malformed = await client.post("/v1/completions", content=b'{"prompt": "hi",}')
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] is None
    assert malformed.json()["error"]["message"].startswith("Malformed JSON body: ")
    assert backend.calls == []


async def test_model_not_found_code(tok):
    async with client_for(ScriptedBackend([]), tok) as client:
        response = await client.post(CHAT, json={"model": "gpt-4", "messages": HI})
    assert response.json() == {"error": {"message": "The model 'gpt-4' does not exist",
                                         "type": "invalid_request_error", "param": "model",
                                         "code": "model_not_found"}}


@pytest.mark.parametrize("stream", [False, True])
async def test_backend_unavailable_is_503(tok, stream):
    async with client_for(Unavailable([]), tok) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
    assert response.status_code == 503
    assert response.json()["error"] == {"message": "Service unavailable: all engines are down",
                                        "type": "server_error", "param": None,
                                        "code": "service_unavailable"}


async def test_backend_failure_mid_stream_is_an_error_event(tok):
    backend = ScriptedBackend(steps(tok, "hello"), fail=RuntimeError("engine died"))
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    chunks = events(response)
    assert texts(chunks[:1]) == [("hello", None)]
    assert chunks[1:] == [{"error": {"message": "Internal server error (RuntimeError)",
                                     "type": "server_error", "param": None, "code": None}},
                          "[DONE]"]
    assert backend.aborted == [backend.calls[0][0]]


async def test_unknown_route_and_method_are_openai_errors(tok):
    async with client_for(ScriptedBackend([]), tok) as client:
        missing = await client.get("/v1/nothing")
        wrong_method = await client.get("/v1/completions")
    assert (missing.status_code, missing.json()["error"]["message"]) == (404, "Not Found")
    assert (wrong_method.status_code, wrong_method.json()["error"]["message"]) == (
        405, "Method Not Allowed")


# -- models, health, metrics -----------------------------------------------------------------

async def test_models_and_health(tok):
    backend = ScriptedBackend([])
    async with client_for(backend, tok) as client:
        models = (await client.get("/v1/models")).json()
        one = await client.get(f"/v1/models/{MODEL}")
        other = await client.get("/v1/models/org/other-model")
        healthy = await client.get("/health")
        backend.is_healthy = False
        unhealthy = await client.get("/health")
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        (MODEL, "model", MAX_MODEL_LEN)]
    assert (healthy.status_code, unhealthy.status_code) == (200, 503)
    assert one.status_code == 200 and one.json() == models["data"][0]
    assert other.status_code == 404 and other.json()["error"] == {
        "message": "The model 'org/other-model' does not exist", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}


async def test_tokenize_and_detokenize(tok):
    """vLLM's /tokenize (a prompt as a completion sends it, messages as a chat completion
    renders them, the same template options) and /detokenize, with their refusals; /version."""
    backend = ScriptedBackend([])
    conversation = HI + [{"role": "assistant", "content": "hello"}]
    async with client_for(backend, tok) as client:
        prompt = (await client.post("/tokenize", json={"prompt": "the quick",
                                                       "return_token_strs": True})).json()
        bare = (await client.post("/tokenize", json={"prompt": "the quick",
                                                     "add_special_tokens": False})).json()
        chat = (await client.post("/tokenize", json={"model": MODEL, "messages": HI})).json()
        cont = (await client.post("/tokenize", json={
            "messages": conversation, "add_generation_prompt": False,
            "continue_final_message": True})).json()
        text = (await client.post("/detokenize", json={"tokens": prompt["tokens"]})).json()
        both = await client.post("/tokenize", json={"prompt": "a", "messages": HI})
        neither = await client.post("/tokenize", json={})
        past = await client.post("/detokenize", json={"tokens": [1, tok.vocab_size]})
        other = await client.post("/detokenize", json={"model": "nope", "tokens": [1]})
        version = (await client.get("/version")).json()
    ids = tok.encode("the quick")
    assert prompt == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                      "token_strs": [tok.token_text(i) for i in ids]}
    assert bare["tokens"] == tok.encode("the quick", add_special_tokens=False)
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(HI), add_special_tokens=False)
    assert chat["token_strs"] is None
    assert cont["tokens"] == tok.encode(tok.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True),
        add_special_tokens=False)  # fmt: skip
    assert text == {"prompt": tok.decode(ids)}
    assert (both.status_code, both.json()["error"]["param"]) == (400, "messages")
    assert (neither.status_code, neither.json()["error"]["param"]) == (400, "messages")
    assert past.status_code == 400 and past.json()["error"]["param"] == "tokens"
    assert f"Token id {tok.vocab_size} at position 1 is out of range" in (
        past.json()["error"]["message"])
    assert (other.status_code, other.json()["error"]["code"]) == (404, "model_not_found")
    assert version == {"version": microserve.__version__}
    assert backend.calls == []


async def test_metrics(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), cached=3)
    n_generated = len(steps(tok, "hello")[0]) + len(steps(tok, " world")[0])
    async with client_for(backend, tok) as client:
        await client.post("/v1/completions", json={"prompt": "the quick"})
        await client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
        response = await client.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    lines = set(response.text.splitlines())
    assert {
        'microserve_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        'microserve_requests_total{endpoint="/v1/completions",status="404"} 1.0',
        f"microserve_prompt_tokens_total {float(len(tok.encode('the quick')))}",
        f"microserve_generation_tokens_total {float(n_generated)}",
        "microserve_prefix_cache_hit_tokens_total 3.0",
        "microserve_time_to_first_token_seconds_count 1",
        "microserve_time_per_output_token_seconds_count 1",
        "microserve_requests_running 0.0",
        "microserve_engine_pages 7.0",  # the backend's own metrics follow the frontend's
    } <= lines


def test_metrics_exposition_format():
    registry = Registry()
    requests = registry.counter("microserve_x_total", "Things.", ["path"])
    requests.inc(path='a"b\\c')
    requests.inc(2, path='a"b\\c')
    registry.gauge("microserve_y", "Level.").dec(0.5)
    latency = registry.histogram("microserve_z_seconds", "Latency.", [0.1, 1.0])
    for value in (0.1, 0.5, 3.0):
        latency.observe(value)
    assert registry.render() == (
        '# HELP microserve_x_total Things.\n# TYPE microserve_x_total counter\n'
        'microserve_x_total{path="a\\"b\\\\c"} 3.0\n'
        '# HELP microserve_y Level.\n# TYPE microserve_y gauge\nmicroserve_y -0.5\n'
        '# HELP microserve_z_seconds Latency.\n# TYPE microserve_z_seconds histogram\n'
        'microserve_z_seconds_bucket{le="0.1"} 1\nmicroserve_z_seconds_bucket{le="1.0"} 2\n'
        'microserve_z_seconds_bucket{le="+Inf"} 3\nmicroserve_z_seconds_sum 3.6\n'
        'microserve_z_seconds_count 3\n')
    with pytest.raises(ValueError, match="must start with 'microserve_'"):
        registry.counter("x_total", "No prefix.")
    with pytest.raises(ValueError, match=r"takes labels \['path'\], got \['route'\]"):
        requests.inc(route="/")


# -- a live uvicorn server: the openai client, disconnects, TCP_NODELAY ----------------------

@contextlib.asynccontextmanager
async def live_server(backend: GenerateBackend, tok: Tokenizer, bind: str = "listen_socket"):
    """Serve the app on a free 127.0.0.1 port in this event loop; yields (base_url, server).

    bind: "listen_socket" (ours) or "uvicorn" (uvicorn binds host and port itself).
    """
    config = uvicorn.Config(build_openai_app(backend, tok), host="127.0.0.1", port=0,
                            log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    sockets = [listen_socket("127.0.0.1", 0)] if bind == "listen_socket" else None
    task = asyncio.create_task(server.serve(sockets=sockets))
    await eventually(lambda: server.started or task.done())
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", server
    finally:
        server.should_exit = True
        await task


async def test_openai_client_parses_our_responses(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), cached=1)
    async with live_server(backend, tok) as (url, _), openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        completion = await client.completions.create(model=MODEL, prompt="the quick", max_tokens=5)
        chat = await client.chat.completions.create(model=MODEL, messages=HI)
        stream = await client.chat.completions.create(
            model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        models = await client.models.list()
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.completions.create(model="nope", prompt="hi")
        with pytest.raises(openai.BadRequestError) as bad_request:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=100)
    assert completion.choices[0].text == "hello world"
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.completion_tokens, completion.usage.prompt_tokens) == (2, 2)
    assert completion.usage.prompt_tokens_details.cached_tokens == 1
    assert (chat.choices[0].message.role, chat.choices[0].message.content) == (
        "assistant", "hello world")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello world"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 21 + 2
    assert [m.id for m in models.data] == [MODEL]
    assert (not_found.value.status_code, not_found.value.code) == (404, "model_not_found")
    assert (bad_request.value.status_code, bad_request.value.param) == (400, "max_tokens")


async def test_client_disconnect_mid_stream_aborts(tok):
    backend = ScriptedBackend(steps(tok, "hello"), hang=True)
    async with live_server(backend, tok) as (url, _), httpx.AsyncClient() as client:
        body = {"prompt": "hi", "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["text"] == "hello"
                    break  # leaving the block closes the connection mid-stream
        await eventually(lambda: backend.aborted == [backend.calls[0][0]])


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_before_the_first_token_aborts(tok, stream):
    backend = ScriptedBackend([], hang=True)  # e.g. a long queue or prefill
    async with live_server(backend, tok) as (url, _), httpx.AsyncClient() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": stream},
                              timeout=0.3)
        await eventually(lambda: backend.aborted == [backend.calls[0][0]])


@pytest.mark.parametrize("bind", ["listen_socket", "uvicorn"])
async def test_served_sockets_have_tcp_nodelay(tok, bind):
    backend = ScriptedBackend(steps(tok, "hello"))
    async with live_server(backend, tok, bind) as (url, server), httpx.AsyncClient() as client:
        await client.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": True})
        # The keep-alive connection is still open on the server side.
        sockets = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
        assert len(sockets) == 1
        assert sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_a_body_past_the_limit_gets_413_without_being_read(tok):
    from microserve.openai.middleware import MAX_BODY_BYTES

    backend = ScriptedBackend(steps(tok, "hello"))
    async with client_for(backend, tok) as client:
        big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
        r = await client.post("/v1/completions", content=big)
        assert r.status_code == 413, r.text
        assert r.json()["error"] == {
            "message": f"The request body ({len(big)} bytes) is larger than the "
                       f"{MAX_BODY_BYTES} bytes this server accepts",
            "type": "invalid_request_error", "param": None, "code": "body_too_large"}

        async def chunks():  # no Content-Length: counted as it streams in
            yield b'{"prompt": "'
            for _ in range(33):
                yield b"a" * (1 << 20)
            yield b'"}'

        r = await client.post("/v1/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200
    assert len(backend.calls) == 1


# -- the served app (QuietServer): a 500 closes its connection, a body cut short is a 499 ------

@contextlib.asynccontextmanager
async def served(backend: GenerateBackend, tok: Tokenizer, limits: HttpLimits = HttpLimits()):
    """The app as `microserve engine` and `router` serve it (QuietServer, bounded connections);
    yields (port, the frontend's metrics registry)."""
    registry = Registry()
    sock = listen_socket("127.0.0.1", 0)
    server = QuietServer.serving(build_openai_app(backend, tok, registry=registry), "warning",
                                 limits)
    server.config.lifespan = "off"
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: server.started or task.done())
    try:
        yield sock.getsockname()[1], registry
    finally:
        server.should_exit = True
        await task


@contextlib.contextmanager
def server_log(caplog):
    """Records of uvicorn's error log (which does not reach the root logger) and ours."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            yield caplog.records
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def requests_by_status(registry: Registry) -> dict[str, float]:
    found = re.findall(r'^microserve_requests_total\{endpoint="/v1/completions",status="(\d+)"\} '
                       r'(\S+)$', registry.render(), re.MULTILINE)
    return {status: float(value) for status, value in found}


async def test_a_500_says_connection_close_and_the_next_request_goes_through(tok, caplog):
    backend = ScriptedBackend(steps(tok, "hello"), fail=RuntimeError("a bug"))
    async with served(backend, tok) as (port, registry), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}") as client:
        with server_log(caplog):
            failed = await client.post("/v1/completions", json={"prompt": "hi"})
        assert (failed.status_code, failed.headers["connection"]) == (500, "close")
        assert failed.json()["error"]["message"] == "Internal server error (RuntimeError)"
        assert any(r.exc_info for r in caplog.records)  # a bug: its traceback is logged
        # The client knows to open a new connection: its next request is answered.
        assert (await client.get("/v1/models")).status_code == 200
        # On a raw connection: the 500 whole, then the server's end of the connection.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"prompt": "hi"}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        answer = await asyncio.wait_for(reader.read(), 5)  # read() ends at the server's FIN
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"\r\nconnection: close" in head.lower()
    assert json.loads(payload)["error"]["type"] == "server_error"
    assert requests_by_status(registry) == {"500": 2.0}


@pytest.mark.parametrize("how", ["gone", "too_slow"])
async def test_a_client_that_leaves_mid_body_is_a_499_without_a_traceback(tok, caplog, how):
    """A client that closes its connection halfway through its body, or that sends it so
    slowly that the body deadline cuts it off (408): 499 in the metrics, one log line."""
    backend = ScriptedBackend(steps(tok, "hello"))
    limits = HttpLimits(body_timeout_s=0.3)
    async with served(backend, tok, limits) as (port, registry):
        with server_log(caplog):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
            await writer.drain()
            if how == "gone":
                await asyncio.sleep(0.05)  # the handler is reading the body
                writer.close()
            else:
                answer = await asyncio.wait_for(reader.read(), 5)
                assert answer.startswith(b"HTTP/1.1 408 ")
                writer.close()
            await eventually(lambda: requests_by_status(registry) == {"499": 1.0})
    assert backend.calls == []
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in caplog.records if r.name == "microserve.errors"] == [
        "POST /v1/completions: the client went away while sending its body"]
