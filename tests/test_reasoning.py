"""`--reasoning-parser deepseek_r1`: thinking split from the answer (microserve/openai/
reasoning.py), whole and piece by piece, however the text is cut."""

from __future__ import annotations

import pytest

from microserve.openai.reasoning import ThinkSplitter, split

CASES = {
    "<think>\nstep 1</think>\n\nThe answer.": ("\nstep 1", "\n\nThe answer."),
    "step 1 (the template opened it)</think>Answer": ("step 1 (the template opened it)", "Answer"),
    "  <think>a < b, </th is not a tag</think>": ("a < b, </th is not a tag", ""),
    "<think>never closed": ("never closed", ""),
    "no tags at all": ("no tags at all", ""),
    "<think></think>": ("", ""),
    "x</think>y</think>z": ("x", "y</think>z"),  # only the first closes the thinking
    "<b>bold</think>": ("<b>bold", ""),
    "": ("", ""),
    "<thin": ("<thin", ""),  # a cut-off opening tag stays text
}


@pytest.mark.parametrize("text", list(CASES))
def test_whole_outputs_split_at_the_first_closing_tag(text):
    assert split(text) == CASES[text]


@pytest.mark.parametrize("text", list(CASES))
def test_every_cut_of_the_stream_gives_the_same_split(text):
    """Every way to cut the output in two and three pieces, and one character at a time."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
             for j in range(i, len(text) + 1)]
    cuts.append(list(text))
    for pieces in cuts:
        splitter, reasoning, answer = ThinkSplitter(), "", ""
        for piece in pieces:
            r, a = splitter.feed(piece)
            reasoning, answer = reasoning + r, answer + a
        r, a = splitter.flush()
        assert (reasoning + r, answer + a) == CASES[text], pieces


# -- through the OpenAI frontend (a scripted backend, the official client in-process) ------------

import httpx  # noqa: E402
import openai  # noqa: E402
from test_openai_app import MODEL, ScriptedBackend, steps  # noqa: E402
from test_tokenizer import make_tokenizer_dir  # noqa: E402

from microserve.openai.app import build_openai_app  # noqa: E402
from microserve.tokenizer import Tokenizer  # noqa: E402

THOUGHT = ["<think>", "Paris is", " the capital.", "</th", "ink>", "\n\nParis."]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def clients(backend, tok, parser="deepseek_r1"):
    app = build_openai_app(backend, tok, reasoning_parser=parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return http, openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                    max_retries=0)


HI = [{"role": "user", "content": "capital of France?"}]


async def test_chat_carries_the_thinking_apart_from_the_answer(tok):
    backend = ScriptedBackend(steps(tok, *THOUGHT), finish_reason="stop")
    backend.max_model_len = 4096
    http, client = clients(backend, tok)
    async with http:
        whole = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI})).json()["choices"][0]["message"]
        stream = await client.chat.completions.create(model=MODEL, messages=HI, stream=True)
        chunks = [c async for c in stream]
    assert whole["content"] == "\n\nParis."
    assert whole["reasoning_content"] == whole["reasoning"] == "Paris is the capital."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    assert (thought, answer) == ("Paris is the capital.", "\n\nParis.")
    # no answer chunk carries thinking, and the thinking comes before any answer
    kinds = [("r" if getattr(d, "reasoning_content", None) else "") + ("a" if d.content else "")
             for d in deltas]
    assert "ra" not in kinds and "".join(k for k in kinds if k) == "rra"


async def test_an_output_that_never_closes_its_thinking_is_all_thinking(tok):
    """As vLLM's deepseek_r1 parser: no </think>, no answer (content null)."""
    backend = ScriptedBackend(steps(tok, "Paris", " is the capital."), finish_reason="length")
    backend.max_model_len = 4096
    http, _ = clients(backend, tok)
    async with http:
        message = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI})).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is the capital.", None)


async def test_without_a_parser_the_thinking_is_text_and_no_field_appears(tok):
    backend = ScriptedBackend(steps(tok, *THOUGHT), finish_reason="stop")
    http, _ = clients(backend, tok, parser=None)
    async with http:
        message = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI})).json()["choices"][0]["message"]
    assert message["content"] == "".join(THOUGHT) and "reasoning_content" not in message


async def test_a_tool_call_after_thinking_is_read_from_the_answer(tok):
    backend = ScriptedBackend(steps(tok, "<think>need weather</think>", CALL),
                              finish_reason="stop")
    backend.max_model_len = 4096
    http, _ = clients(backend, tok)
    async with http:
        message = (await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "tools": [WEATHER]})).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "need weather"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["content"] is None


async def test_responses_put_the_thinking_in_a_reasoning_item(tok):
    backend = ScriptedBackend(steps(tok, *THOUGHT), finish_reason="stop")
    backend.max_model_len = 4096
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(model=MODEL, input="capital of France?")
        stream = await client.responses.create(model=MODEL, input="capital of France?",
                                               stream=True)
        events = [e async for e in stream]
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is the capital."
    assert (message.type, response.output_text) == ("message", "\n\nParis.")
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == "Paris is the capital."
    assert done.output_text == "\n\nParis."


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser 'qwen3' is not one of deepseek_r1"):
        build_openai_app(ScriptedBackend([]), None, reasoning_parser="qwen3")
