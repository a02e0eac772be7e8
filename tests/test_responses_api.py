"""OpenAI's Responses API (POST /v1/responses) over a scripted backend, through the official
`openai` client in-process (httpx's ASGI transport). The request reaches the backend as the
equivalent chat request would (same prompt token ids, same sampling); the answer parses as
the client's own Response and event types. The real model behind it: test_engine_server.py.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_openai_app import MODEL, ScriptedBackend, steps
from test_tokenizer import make_tokenizer_dir

from microserve.openai.app import build_openai_app
from microserve.tokenizer import Tokenizer

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def clients(backend, tok):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_openai_app(backend, tok)),
                             base_url="http://test")
    return http, openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http,
                                    max_retries=0)


async def test_text_answer_is_the_chat_requests_generation(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), finish_reason="stop")
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(
            model=MODEL, input="hi there", instructions="Be brief.", max_output_tokens=9,
            temperature=0, metadata={"k": "v"})
        chat = await http.post("/v1/chat/completions", json={
            "model": MODEL, "max_completion_tokens": 9, "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "hi there"}]})  # fmt: skip
    assert chat.status_code == 200
    (_, prompt, params), (_, chat_prompt, chat_params) = backend.calls
    assert prompt == chat_prompt and params.max_tokens == chat_params.max_tokens == 9
    assert params.temperature == chat_params.temperature == 0.0
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model, response.output_text) == (
        "completed", MODEL, "hello world")
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert [part.type for part in message.content] == ["output_text"]
    out = len(tok.encode("hello")) + len(tok.encode(" world"))
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (len(prompt), out, len(prompt) + out)
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"}


async def test_cut_at_max_output_tokens_is_incomplete(tok):
    backend = ScriptedBackend(steps(tok, "hello"), finish_reason="length")
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "hello"


async def test_stream_events_in_order_through_the_client(tok):
    backend = ScriptedBackend(steps(tok, "hello", " world"), finish_reason="stop")
    http, client = clients(backend, tok)
    async with http:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [event async for event in stream]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(10))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [
        "hello", " world"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert {e.item_id for e in events[3:8]} == {item_id}
    done = events[-1].response
    assert (done.status, done.output_text, done.output[0].id) == (
        "completed", "hello world", item_id)
    assert done.usage.output_tokens == len(tok.encode("hello")) + len(tok.encode(" world"))


async def test_tool_turns_render_as_the_chat_request_and_a_call_comes_back(tok):
    """function_call / function_call_output items are chat's assistant tool call and tool
    turn (the same prompt ids reach the backend); a call in the model's text comes back as a
    function_call item, streamed or not."""
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "user", "content": "And tomorrow?"}]  # fmt: skip
    chat_history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
    backend = ScriptedBackend(steps(tok, CALL), finish_reason="stop")
    backend.max_model_len = 2048  # the tools' text is in the prompt
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(model=MODEL, input=history, tools=[WEATHER])
        chat = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": chat_history, "tools": [
                {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}]})  # fmt: skip
        stream = await client.responses.create(model=MODEL, input=history, tools=[WEATHER],
                                               stream=True)
        events = [event async for event in stream]
    assert chat.status_code == 200, chat.text
    assert backend.calls[0][1] == backend.calls[1][1] == backend.calls[2][1]
    [call] = response.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and response.status == "completed"
    assert chat.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == (
        "get_weather")
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert json.loads(events[4].arguments) == {"city": "Paris"}
    assert events[-1].response.output[0].name == "get_weather"


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
    ({"input": ["hi"]}, "input"),
    ({"input": {"role": "user"}}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "hi", "text": {"format": "json"}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": 3}}}}, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.name"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": 5}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
])  # fmt: skip
async def test_refusals_name_the_responses_field(tok, body, param):
    backend = ScriptedBackend(steps(tok, "x"))
    http, _ = clients(backend, tok)
    async with http:
        response = await http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.text
    assert backend.calls == []


async def test_a_developer_turn_is_the_system_turn(tok):
    """The Responses API's `developer` role renders as chat's `system` (templates know no
    developer): the same prompt ids reach the backend."""
    backend = ScriptedBackend(steps(tok, "ok"), finish_reason="stop")
    http, client = clients(backend, tok)
    async with http:
        await client.responses.create(model=MODEL, input=[
            {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        await client.responses.create(model=MODEL, input="hi", instructions="Be brief.")
        await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]})
    assert backend.calls[0][1] == backend.calls[1][1] == backend.calls[2][1]


async def test_json_schema_format_reaches_the_backend_as_a_grammar(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    backend = ScriptedBackend(steps(tok, '{"a": 1}'), finish_reason="stop")
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(model=MODEL, input="give a", text={
            "format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"a": 1}
    assert response.text.format.type == "json_schema"
    assert backend.calls[0][2].grammar is not None


async def test_logprobs_when_asked_for_streamed_and_not(tok):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each token's logprob
    and its alternatives on the output_text part, as chat reports them; streamed, on each
    delta event, adding up to the part's."""
    backend = ScriptedBackend(steps(tok, "hello", " world"), finish_reason="stop", logprobs=True)
    http, client = clients(backend, tok)
    async with http:
        response = await client.responses.create(
            model=MODEL, input="hi", top_logprobs=1, include=["message.output_text.logprobs"])
        chat = await http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 1})
        stream = await client.responses.create(model=MODEL, input="hi", top_logprobs=1,
                                               stream=True)
        events = [event async for event in stream]
        plain = await client.responses.create(model=MODEL, input="hi")
    assert backend.calls[0][2].logprobs == 1 and backend.calls[3][2].logprobs is None
    want = chat.json()["choices"][0]["logprobs"]["content"]
    got = [lp.model_dump() for lp in response.output[0].content[0].logprobs]
    assert got == want and len(want) == len(tok.encode("hello")) + len(tok.encode(" world"))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert streamed == want
    assert [lp.model_dump() for lp in events[-1].response.output[0].content[0].logprobs] == want
    assert plain.output[0].content[0].logprobs == []


async def test_a_client_gone_mid_stream_or_before_the_first_token_aborts_the_request(tok):
    """Over a real socket: a stream closed after its first delta, and a non-streamed request
    given up before any token, each abort their generation in the backend (nothing runs on
    for nobody)."""
    from test_openai_app import eventually, live_server

    backend = ScriptedBackend(steps(tok, "hello"), hang=True)
    async with live_server(backend, tok) as (url, _), httpx.AsyncClient() as http:
        body = {"model": MODEL, "input": "hi", "stream": True}
        async with http.stream("POST", f"{url}/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and "output_text.delta" in line:
                    assert json.loads(line[6:])["delta"] == "hello"
                    break  # leaving the block closes the connection mid-stream
        await eventually(lambda: backend.aborted == [backend.calls[0][0]])
    waiting = ScriptedBackend([], hang=True)  # e.g. a long queue or prefill
    async with live_server(waiting, tok) as (url, _), httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi"},
                            timeout=0.3)
        await eventually(lambda: waiting.aborted == [waiting.calls[0][0]])
