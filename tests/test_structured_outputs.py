"""Structured outputs and tool calls end to end, through the official `openai` client.

One `microserve up` with a prefill and a decode SmolLM2-135M engine (KV through shared memory):
every constrained output parses against its schema, greedy and streamed or not, whichever
strategy carries it (the grammar travels with the sampling parameters to the engine that
samples; P/D gives the tokens data parallel gives). Tool calls with `required` and a named
function come back as calls whose arguments follow the function's schema, and a follow-up with
the assistant's calls and the tool's answer renders and runs. Forced calls take nested pydantic
models (`openai.pydantic_function_tool`, instructor's TOOLS mode), hold only declared keys
unless `strict: false`, and a "required" call list with parallel calls ends on its own. Bad
schemas and tool choices are 400s naming the field. The engine core frees a request's grammar
however it ends.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, create_model
from deployments import assert_quiet, up_prefill_decode

from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.openai.guided import json_schema_grammar
from microserve.tokenizer import Tokenizer
from microserve.messages import SamplingParams

pytestmark = pytest.mark.slow

ADMIN = "admin-s3cret"
ENGINE_ARGS = ["--num-pages", "256", "--max-model-len", "2048"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Describe Bob, a 30 year old admin from Paris, as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY = {"model": "test-model", "temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def up(smollm2_dir, tmp_path_factory):
    yield from up_prefill_decode(tmp_path_factory.mktemp("up"), smollm2_dir, ENGINE_ARGS, ADMIN)


@pytest.fixture
def client(up):
    yield openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)
    for name, url in up.engine_urls.items():
        assert_quiet(name, url)  # idle, KV intact: nothing held by a finished request


def use_strategy(up, builtin: str, args: dict | None = None) -> None:
    r = httpx.put(up.url + "/admin/strategy", json={"builtin": builtin, "args": args or {}},
                  headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200, r.text


def chat(client, stream: bool, **kw) -> tuple[str, str]:
    """(content, finish_reason), streamed or not."""
    if not stream:
        r = client.chat.completions.create(**GREEDY, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**GREEDY, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.fixture(scope="module")
def data_parallel_person(up) -> tuple[str, str]:
    """(content, finish_reason) of ASK_PERSON under PERSON_FORMAT, not streamed, through the
    deployment's first strategy, data_parallel: asked once for the tests below (each answer is
    ~40 constrained tokens, ~5 s on the 2-core machine)."""
    with openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0) as c:
        return chat(c, False, messages=ASK_PERSON, response_format=PERSON_FORMAT)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_follows_the_schema(up, client, data_parallel_person, stream):
    text, finish = (chat(client, stream, messages=ASK_PERSON, response_format=PERSON_FORMAT)
                    if stream else data_parallel_person)
    person = json.loads(text)
    jsonschema.validate(person, PERSON)
    assert finish == "stop"  # the grammar ended the request, before max_tokens
    assert person["name"] == "Bob" and person["age"] == 30
    assert text == data_parallel_person[0]  # streamed or not, the same tokens


# The strategy never sees whether the client streams (the router's OpenAI layer does): one
# strategy answers streamed, the other whole, each ~40 constrained tokens.
@pytest.mark.parametrize("strategy,args,stream", [("pd", None, False),
                                                  ("balanced_pd", {"ratio": 0.5}, True)])
def test_pd_strategies_give_the_data_parallel_json(up, client, data_parallel_person, strategy,
                                                   args, stream):
    expected, _ = data_parallel_person
    use_strategy(up, strategy, args)
    try:
        text, finish = chat(client, stream, messages=ASK_PERSON, response_format=PERSON_FORMAT)
        assert (text, finish) == (expected, "stop")
    finally:
        use_strategy(up, "data_parallel")
    jsonschema.validate(json.loads(expected), PERSON)


def test_json_object_choice_and_regex(up, client):
    text, finish = chat(client, False, messages=[
        {"role": "user", "content": 'Answer in JSON with one key, "answer": what is 6 times 7?'}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict) and finish == "stop", text
    choices = ["positive", "negative", "neutral"]
    for stream in (False, True):
        text, finish = chat(client, stream, messages=[
            {"role": "user", "content": "Classify the sentiment: I love this library!"}],
            extra_body={"guided_choice": choices})
        assert text in choices and finish == "stop"
    date = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
    text, finish = chat(client, True, messages=[
        {"role": "user", "content": "When did the first moon landing happen?"}],
        extra_body={"guided_regex": date})
    assert re.fullmatch(date, text) and finish == "stop"
    r = client.completions.create(model="test-model", prompt="The answer is", temperature=0,
                                  max_tokens=10, extra_body={"guided_regex": "(yes|no)"})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


def _arguments(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_round_trip(up, client, tool_choice):
    r = client.chat.completions.create(**GREEDY, messages=ASK_WEATHER, tools=[TIME, WEATHER],
                                       tool_choice=tool_choice, parallel_tool_calls=False)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    arguments = _arguments(message.tool_calls[0], WEATHER)
    assert arguments["city"] == "Paris"

    follow_up = [*ASK_WEATHER, message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                  "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    r = client.chat.completions.create(**GREEDY, messages=follow_up, tools=[TIME, WEATHER])
    assert r.choices[0].finish_reason in ("stop", "tool_calls")
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_streamed_tool_call_equals_the_whole_one(up, client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**GREEDY, messages=ASK_WEATHER, tools=[WEATHER],
                                           tool_choice=forced).choices[0].message.tool_calls
    deltas, finish = [], None
    for chunk in client.chat.completions.create(**GREEDY, messages=ASK_WEATHER, tools=[WEATHER],
                                                tool_choice=forced, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    first = deltas[0]  # OpenAI's shape: id, type and name first, then argument fragments
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_")
    assert all(d.index == 0 and d.id is None for d in deltas[1:]), deltas
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert len(whole) == 1 and arguments == whole[0].function.arguments


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    """Save a person."""

    name: str
    age: int
    address: Address


class Shipment(BaseModel):
    """Ship a parcel."""

    item: str
    to: create_model("Address", street=(str, ...), zip_code=(int, ...))  # a second Address


ASK_SAVE = [{"role": "user", "content": "Save Bob, 30 years old, who lives in Paris, France."}]
BOB = Person(name="Bob", age=30, address=Address(city="Paris", country="France"))


def test_forced_calls_take_nested_pydantic_models(up, client):
    """pydantic's `$defs`/`$ref` in both tools, each defining its own `Address`: the calls
    follow each tool's own, and the client parses them into the models."""
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Shipment)]
    shipment = Shipment.model_validate({"item": "Shipment",
                                        "to": {"street": "Paris", "zip_code": 1234567890}})
    for tool_choice, expected in [
            ({"type": "function", "function": {"name": "Person"}}, BOB),
            ({"type": "function", "function": {"name": "Shipment"}}, shipment),
            ("required", shipment)]:  # the model's own pick
        r = client.chat.completions.parse(**GREEDY, messages=ASK_SAVE, tools=tools,
                                          tool_choice=tool_choice, parallel_tool_calls=False)
        message = r.choices[0].message
        assert (r.choices[0].finish_reason, message.content) == ("tool_calls", None)
        assert [call.function.parsed_arguments for call in message.tool_calls] == [expected]


def test_instructor_tools_mode_with_a_nested_model(up, client):
    instructor = pytest.importorskip(
        "instructor", reason="instructor is not installed (not in the test extra: its pins "
        "hold openai back to 3.3)")
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    person, completion = patched.chat.completions.create_with_completion(
        **GREEDY, messages=ASK_SAVE, response_model=Person, max_retries=0)
    assert person.model_dump() == BOB.model_dump()  # instructor's subclass of Person
    assert completion.choices[0].finish_reason == "tool_calls"


SEARCH = {"type": "function", "function": {  # a LangChain @tool schema: no additionalProperties
    "name": "search", "description": "Search the web.", "parameters": {
        "properties": {"query": {"type": "string"},
                       "options": {"type": "object",
                                   "properties": {"max_results": {"type": "integer"}}}},
        "required": ["query", "options"], "type": "object"}}}


def test_forced_arguments_hold_only_declared_keys_unless_strict_is_false(up, client):
    ask = [{"role": "user", "content": "Find recent news about the Mars rover."}]
    r = client.chat.completions.create(**GREEDY, messages=ask, tools=[SEARCH],
                                       tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == [
        '{"query": "Mars rover", "options": {"max_results": 10}}']
    # As written, the model fills "options" with keys of its own ("type", "properties", ...)
    # until max_tokens cuts the call, which is dropped rather than left as text. (It never
    # closes the call within GREEDY's 120 tokens: greedy, so not within the first 40 either.)
    lenient = {"type": "function", "function": {**SEARCH["function"], "strict": False}}
    r = client.chat.completions.create(**{**GREEDY, "max_tokens": 40}, messages=ask,
                                       tools=[lenient], tool_choice="required",
                                       parallel_tool_calls=False)
    message = r.choices[0].message
    assert (r.choices[0].finish_reason, message.content, message.tool_calls) == ("length", "",
                                                                                 None)


@pytest.mark.parametrize("stream", [False, True])
def test_required_parallel_calls_end_with_the_list(up, client, stream):
    """OpenAI's default parallel_tool_calls: the list ends (the grammar allows at most
    MAX_PARALLEL_CALLS), no call text is content, finish_reason "tool_calls"."""
    kw = dict(**{**GREEDY, "max_tokens": 400}, tools=[WEATHER], tool_choice="required",
              messages=[{"role": "user", "content": "What is the weather in Paris and London?"}])
    if not stream:
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        content, finish = message.content, r.choices[0].finish_reason
    else:
        deltas, content, finish = [], "", None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                deltas += choice.delta.tool_calls or []
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        calls = [(opening.function.name, arguments.function.arguments)  # two chunks a call
                 for opening, arguments in zip(deltas[0::2], deltas[1::2])]
        content = content or None
    assert (content, finish) == (None, "tool_calls")
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ("get_weather", '{"city": "London", "unit": "fahrenheit"}')]


def test_auto_and_none_leave_the_model_free(up, client):
    """Unconstrained: the tools are in the prompt; "auto" parses what the model wrote (calls
    and finish reason agree), "none" parses nothing."""
    for tool_choice in ("auto", "none"):
        r = client.chat.completions.create(**{**GREEDY, "max_tokens": 40}, messages=ASK_PERSON,
                                           tools=[WEATHER], tool_choice=tool_choice)
        choice = r.choices[0]
        assert (choice.message.tool_calls is not None) == (choice.finish_reason == "tool_calls")
        if tool_choice == "none":
            assert choice.message.tool_calls is None and choice.message.content
            assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema", "Invalid type: nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "unclosed group"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "tool_choice names function 'nope'"),
    ({"tool_choice": "required"}, "tool_choice",
     "tool_choice is only allowed when tools are specified"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
      "tool_choice": "required"}, "tools", "Invalid tools"),
])
def test_bad_constraints_are_400s_naming_the_field(up, client, body, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**GREEDY, messages=ASK_PERSON, **body)
    error = caught.value.body
    assert error["param"] == param and message in error["message"], error


def run_core(smollm2_dir, overlap: bool):
    """Three requests on one core, two of them constrained, one aborted mid-way; the core's
    steps overlap the host with the device (async scheduling) when `overlap`."""
    tok = Tokenizer.from_dir(smollm2_dir)
    core = EngineCore(EngineConfig(model=smollm2_dir, num_pages=64, page_size=16,
                                   async_scheduling=overlap))
    prompt = tok.encode(tok.apply_chat_template(ASK_PERSON), add_special_tokens=False)
    grammar = json_schema_grammar(PERSON, "schema")
    params = SamplingParams(max_tokens=100, temperature=0.0, grammar=grammar)
    core.add_request("done", prompt, params)
    core.add_request("aborted", prompt, params)
    core.add_request("free", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    tokens, finish = {"done": [], "aborted": [], "free": []}, {}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        if len(tokens["aborted"]) >= 5 and "aborted" not in finish:
            finish["aborted"] = core.abort_request("aborted").finish_reason
    return tok, core, prompt, tokens, finish


def test_engine_core_frees_grammars_however_a_request_ends(smollm2_dir):
    """Finished by the grammar, aborted mid-generation, or refused: no matcher is left. With
    async scheduling (the GPU's default) the constrained tokens are the same."""
    tok, core, prompt, tokens, finish = run_core(smollm2_dir, overlap=False)
    assert finish == {"done": "stop", "aborted": "abort", "free": "length"}
    jsonschema.validate(json.loads(tok.decode(tokens["done"])), PERSON)
    assert len(tokens["free"]) == 3 and len(core.grammars) == 0
    with pytest.raises(ValueError, match="invalid grammar"):
        core.add_request("bad", prompt, SamplingParams(max_tokens=5, grammar="start: /a(/"))
    assert len(core.grammars) == 0 and len(core.requests) == 0
    core.check_integrity()
    core.close()
    _, overlapped, _, tokens_async, finish_async = run_core(smollm2_dir, overlap=True)
    assert finish_async == finish
    assert tokens_async["done"] == tokens["done"] and tokens_async["free"] == tokens["free"]
    assert len(overlapped.grammars) == 0
    overlapped.check_integrity()
    overlapped.close()
