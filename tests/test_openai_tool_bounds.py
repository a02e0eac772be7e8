"""Tool calls in the OpenAI frontend over a scripted backend (no engine, no model): what a model
writes past the JSON bounds stays text, a forced call list cut short leaves no call text behind,
and what a client sends past the bounds (tool-call history, schemas given as JSON text) is a 400
naming the field. In-process through httpx's ASGI transport."""

from __future__ import annotations

import json

import pytest
from test_openai_app import ScriptedBackend, client_for, events
from test_tokenizer import make_tokenizer_dir

from microserve.tokenizer import Tokenizer
from microserve.openai.tool_parsers import MAX_PARALLEL_CALLS

NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"x": {}}}}}
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


class LongContext(ScriptedBackend):
    max_model_len = 1 << 20  # room for the tools in the prompt and long scripted outputs


def pieces(tok, text: str, size: int = 7) -> list[list[int]]:
    """`text` as backend outputs of `size` characters each."""
    return [tok.encode(text[i:i + size]) for i in range(0, len(text), size)]


async def chat(backend, tok, **body) -> dict:
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def chat_stream(backend, tok, **body) -> tuple[str, list[dict], str]:
    """(content, tool-call deltas, finish_reason) of a streamed answer with no error event."""
    async with client_for(backend, tok) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"messages": ASK, "stream": True, **body})
    chunks = events(response)
    assert chunks[-1] == "[DONE]" and all("error" not in c for c in chunks[:-1]), chunks
    deltas = [c["choices"][0] for c in chunks[:-1]]
    finish = [d["finish_reason"] for d in deltas if d["finish_reason"]]
    assert len(finish) == 1
    return ("".join(d["delta"].get("content") or "" for d in deltas),
            [call for d in deltas for call in d["delta"].get("tool_calls", ())], finish[0])


UNREADABLE = {  # what a model may write as an argument, and no client can be handed
    "deep": "[" * 1050 + "]" * 1050,
    "long number": "9" * 4400,
    "out of range": "1e999",
    "NaN": "NaN",
    "lone surrogate": '"\\ud800"',
}


@pytest.mark.parametrize("case", list(UNREADABLE))
async def test_a_model_call_past_the_bounds_is_returned_as_text(tok, case):
    call = ('<tool_call>\n{"name": "now", "arguments": {"x": ' + UNREADABLE[case] +
            '}}\n</tool_call>')
    choice = await chat(LongContext(pieces(tok, call), "stop"), tok, tools=[NOW])
    assert choice["message"] == {"role": "assistant", "content": call}
    assert choice["finish_reason"] == "stop"
    content, calls, finish = await chat_stream(LongContext(pieces(tok, call), "stop"), tok,
                                               tools=[NOW])
    assert (content, calls, finish) == (call, [], "stop")


CALL = '<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n</tool_call>'
CUT = '<tool_call>\n{"name": "now", "argu'


@pytest.mark.parametrize("output,finish,want_finish", [
    (f"{CALL}\n{CALL}", "stop", "tool_calls"),  # the grammar ended the list
    (f"{CALL}\n{CUT}", "length", "length"),  # max_tokens cut the second call
])
async def test_forced_calls_leave_no_call_text_in_content(tok, output, finish, want_finish):
    body = {"tools": [NOW], "tool_choice": "required"}
    backend = LongContext(pieces(tok, output), finish)
    choice = await chat(backend, tok, **body)
    calls = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == want_finish
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == (
        [("now", '{"x": 1}')] * output.count(CALL))
    grammar = backend.calls[0][2].grammar  # at most MAX_PARALLEL_CALLS calls
    assert grammar.startswith(f'start: call ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}\n')
    content, deltas, streamed_finish = await chat_stream(LongContext(pieces(tok, output), finish),
                                                         tok, **body)
    assert (content, streamed_finish) == ("", want_finish)
    assert [d["function"]["arguments"] for d in deltas] == ["", '{"x": 1}'] * output.count(CALL)


def history(arguments: str) -> list[dict]:
    return [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function":
            {"name": "now", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]


@pytest.mark.parametrize("arguments,reason", [
    ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "JSON nested 100001 deep, more than the 100 accepted"),
    ('{"x": ' + "9" * 5000 + "}", "a JSON number of 5000 characters, more than the 4300 accepted"),
    ('{"x": 1e999}', "the number 1e999 is out of a double's range"),
    ('{"x": NaN}', "NaN is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"x": "\\udc00"}', "a lone surrogate (\\udc00) in a JSON string, which is not Unicode text"),
])
async def test_tool_call_history_past_the_bounds_is_a_400_naming_the_field(tok, arguments,
                                                                            reason):
    async with client_for(LongContext([]), tok) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": history(arguments), "tools": [NOW]})
    field = "messages[1].tool_calls[0].function.arguments"
    shown = json.dumps(arguments, ensure_ascii=False)
    shown = shown if len(shown) <= 100 else shown[:100] + "..."
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": f"Invalid value for '{field}': {reason} (got {shown})",
        "type": "invalid_request_error", "param": field, "code": None}}


async def test_history_arguments_that_are_not_json_still_render(tok):
    backend = LongContext([tok.encode("ok")], "stop")
    choice = await chat(backend, tok, messages=history("not json"), tools=[NOW])
    assert choice["message"]["content"] == "ok"
    assert "not json" in tok.decode(backend.calls[0][1])


DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 120 + "{}" + "}}" * 120


@pytest.mark.parametrize("body,field", [
    ({"guided_json": DEEP_SCHEMA}, "guided_json"),
    ({"json_schema": DEEP_SCHEMA}, "json_schema"),
    ({"structured_outputs": {"json": DEEP_SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[" * 900 + "]" * 900}}, "structured_outputs.json"),
])
async def test_a_schema_given_as_deeply_nested_json_text_is_a_400(tok, body, field):
    async with client_for(LongContext([]), tok) as client:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
    depth = 241 if "[" not in json.dumps(body) else 900
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"Invalid {field}: JSON nested {depth} deep, more than the 100 accepted",
        "type": "invalid_request_error", "param": field, "code": None}


async def test_a_schema_object_too_deep_for_llguidance_is_a_400(tok):
    schema: dict = {}
    for _ in range(90):  # 180 levels of JSON: within the body's limit, past llguidance's
        schema = {"type": "object", "properties": {"a": schema}}
    async with client_for(LongContext([]), tok) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"messages": ASK, "guided_json": schema})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "guided_json"
    assert error["message"].startswith("Invalid guided_json: recursion limit exceeded")
