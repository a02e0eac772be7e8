"""The model's recommended sampling (generation_config.json) as the default of requests that
leave it out, as vLLM's `--generation-config auto` and SGLang's `--sampling-defaults model` do:
read from a model directory, given to the OpenAI frontend, and overridden by what a request
sets. In-process over a scripted backend (test_openai_app.py's)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from test_openai_app import CHAT, HI, MAX_MODEL_LEN, ScriptedBackend, steps
from test_tokenizer import make_tokenizer_dir

from microserve.model_config import sampling_defaults
from microserve.openai.app import build_openai_app, model_sampling_defaults
from microserve.tokenizer import Tokenizer

LLAMA_31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
            "temperature": 0.6, "top_p": 0.9}  # Llama-3.1-8B-Instruct's file


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def model_dir(tmp_path, generation: dict | None):
    directory = make_tokenizer_dir(tmp_path)
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def test_defaults_read_from_the_model_directory(tmp_path):
    assert sampling_defaults(model_dir(tmp_path / "llama", LLAMA_31)) == (
        {"temperature": 0.6, "top_p": 0.9}, [])
    assert sampling_defaults(model_dir(tmp_path / "none", None)) == ({}, [])
    every = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
             "repetition_penalty": 1.05, "max_new_tokens": 512}
    assert sampling_defaults(model_dir(tmp_path / "every", every))[0] == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_tokens": 512}
    bad = {"temperature": 3.0, "top_p": "0.9", "top_k": 2.5, "min_p": True, "max_new_tokens": 0,
           "repetition_penalty": 1.2}
    found, skipped = sampling_defaults(model_dir(tmp_path / "bad", bad))
    assert found == {"repetition_penalty": 1.2}
    assert [s.split("=")[0] for s in skipped] == ["temperature", "top_p", "top_k", "min_p",
                                                  "max_new_tokens"]


def test_the_setting_picks_the_file_or_openai(tmp_path, caplog):
    directory = str(model_dir(tmp_path, LLAMA_31))
    with caplog.at_level(logging.INFO, logger="microserve.openai.app"):
        assert model_sampling_defaults(directory, "auto") == {"temperature": 0.6, "top_p": 0.9}
    assert "temperature 0.6, top_p 0.9" in caplog.text and "--generation-config openai" in (
        caplog.text)
    assert model_sampling_defaults(directory, "openai") == {}
    assert model_sampling_defaults(directory, "vllm") == {}


@pytest.mark.parametrize("body, want", [
    ({}, dict(temperature=0.6, top_p=0.9, top_k=20, min_p=0.0, repetition_penalty=1.1)),
    ({"temperature": 0, "top_k": -1, "repetition_penalty": 1.0},  # a request's own win
     dict(temperature=0.0, top_p=0.9, top_k=0, min_p=0.0, repetition_penalty=1.0)),
    ({"top_p": 1, "min_p": 0.1}, dict(temperature=0.6, top_p=1.0, top_k=20, min_p=0.1,
                                       repetition_penalty=1.1)),
])
async def test_requests_get_the_defaults_they_leave_out(tok, body, want):
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                "max_tokens": 5}
    backend = ScriptedBackend(steps(tok, "hello"))
    app = build_openai_app(backend, tok, sampling_defaults=defaults)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        chat = await client.post(CHAT, json={"messages": HI, **body})
        completion = await client.post("/v1/completions", json={"prompt": "hi", **body})
        asked = await client.post(CHAT, json={"messages": HI, "max_tokens": 9, **body})
    assert (chat.status_code, completion.status_code, asked.status_code) == (200, 200, 200)
    for _, _, params in backend.calls:
        assert {k: getattr(params, k) for k in want} == want
    # max_new_tokens caps a budget left out (chat: the context left; completions: 16)
    assert [params.max_tokens for _, _, params in backend.calls] == [5, 5, 9]
    assert defaults["max_tokens"] == 5  # the caller's dict is left as it was


async def test_without_defaults_openai_applies(tok):
    backend = ScriptedBackend(steps(tok, "hello"))
    transport = httpx.ASGITransport(app=build_openai_app(backend, tok))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        await client.post(CHAT, json={"messages": HI})
    params = backend.calls[0][2]
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        1.0, 1.0, 0, 1.0)
    assert params.max_tokens > 16  # the context left
    assert MAX_MODEL_LEN > params.max_tokens
