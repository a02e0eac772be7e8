"""Tool-call formats without a model: parsing whole and streamed outputs, rendering the
history for a template without tools, and the grammars that force calls."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microserve.openai.guided import checked
from microserve.openai.tool_parsers import MAX_PARALLEL_CALLS, make_parser
from microserve.openai.tool_schemas import calls_schema
from microserve.openai.tools import FunctionDefinition

WEATHER = FunctionDefinition(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
NOW = FunctionDefinition(name="now")
HERMES_OUTPUT = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>')


def test_hermes_parse():
    content, calls = make_parser("hermes").parse(HERMES_OUTPUT)
    assert content == "Sure.\n"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'),
                                                      ("now", "{}")]
    assert len({c.id for c in calls}) == 2
    bad = "hi <tool_call> not json </tool_call> x"  # not a call: stays content, as written
    assert make_parser("hermes").parse(bad) == (bad, [])


@pytest.mark.parametrize("cut", range(1, len(HERMES_OUTPUT)))
def test_hermes_stream_equals_whole_parse_wherever_the_text_is_cut(cut):
    stream = make_parser("hermes").stream()
    content, calls = stream.feed(HERMES_OUTPUT[:cut])
    more = [stream.feed(HERMES_OUTPUT[cut:]), stream.flush()]
    content += "".join(c for c, _ in more)
    calls += [call for _, cs in more for call in cs]
    assert content == "Sure.\n"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'),
                                                      ("now", "{}")]


def test_hermes_stream_holds_only_what_may_open_a_call():
    stream = make_parser("hermes").stream()
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box") == ("<toolbox", [])
    assert stream.feed("<tool_call>{\"name\": \"now\"") == ("", [])
    content, calls = stream.flush()  # ended inside a call whose JSON is not whole
    assert (content, calls) == ("<tool_call>{\"name\": \"now\"", [])


def test_llama3_json_parse():
    parser = make_parser("llama3_json")
    _, calls = parser.parse('{"name": "now", "parameters": {}}; '
                            '{"name": "get_weather", "parameters": {"city": "X"}}')
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}"),
                                                      ("get_weather", '{"city": "X"}')]
    assert parser.parse("hello {") == ("hello {", [])
    stream = parser.stream()
    assert stream.feed("  ") == ("", []) and stream.feed("Hi") == ("  Hi", [])


def test_inline_history_for_a_template_without_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    ]
    tools = [{"type": "function", "function": WEATHER.model_dump(exclude_none=True)}]
    out = make_parser("hermes").inline(messages, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'}
    assert out[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                 "<tool_response>\n12:00\n</tool_response>")


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_forced_call_grammar_accepts_exactly_well_formed_calls(name):
    parser = make_parser(name)
    grammar = checked(llguidance.LLMatcher.grammar_from_lark(
        parser.grammar([WEATHER, NOW], parallel=False)), "tools")
    tokenizer = llguidance.LLTokenizer("byte")  # any text, byte by byte

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
        return ok and matcher.is_accepting()

    good = parser.call_text("get_weather", {"city": "Paris"})
    assert accepts(good)
    assert parser.parse(good)[1][0].arguments == '{"city": "Paris"}'
    assert not accepts(parser.call_text("get_weather", {"town": "Paris"}))  # schema
    assert not accepts(parser.call_text("delete_all", {}))  # unknown function


def accepts_calls(grammar_lark: str):
    """accepts(text): whether the forced-call grammar takes exactly `text`."""
    grammar = checked(llguidance.LLMatcher.grammar_from_lark(grammar_lark), "tools")
    tokenizer = llguidance.LLTokenizer("byte")

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
    return accepts


# Two tools whose nested models share a name (pydantic's `$defs`, `#` for a recursive model).
SHIP = FunctionDefinition(name="ship", parameters={
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"],
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}})
BILL = FunctionDefinition(name="bill", parameters={
    "$id": "https://example.com/bill", "type": "object",
    "properties": {"to": {"$ref": "#/$defs/Address"},
                   "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["to"],
    "$defs": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}},
                          "required": ["zip"]}}})


def test_calls_schema_moves_each_tools_references_under_its_own_option():
    schema = calls_schema([SHIP, BILL], "arguments")
    ship, bill = (option["properties"]["arguments"] for option in schema["anyOf"])
    assert ship["properties"]["to"] == {"$ref": "#/anyOf/0/properties/arguments/$defs/Address"}
    assert bill["properties"] == {
        "to": {"$ref": "#/anyOf/1/properties/arguments/$defs/Address"},
        "next": {"anyOf": [{"$ref": "#/anyOf/1/properties/arguments"}, {"type": "null"}]}}
    assert "$id" not in bill
    assert bill["$defs"]["Address"]["additionalProperties"] is False  # closed (strict)
    assert "additionalProperties" not in BILL.parameters["$defs"]["Address"]  # a copy
    assert calls_schema([SHIP], "parameters")["properties"]["parameters"]["properties"] == {
        "to": {"$ref": "#/properties/parameters/$defs/Address"}}


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_forced_calls_take_nested_models_of_each_tool(name):
    parser = make_parser(name)
    accepts = accepts_calls(parser.grammar([SHIP, BILL], parallel=False))
    assert accepts(parser.call_text("ship", {"to": {"city": "Oslo"}}))
    assert accepts(parser.call_text("bill", {"to": {"zip": 1}, "next": {"to": {"zip": 2}}}))
    assert not accepts(parser.call_text("ship", {"to": {"zip": 1}}))  # bill's Address
    assert not accepts(parser.call_text("bill", {"to": {"city": "Oslo"}}))  # ship's Address


LOOSE = FunctionDefinition(name="search", parameters={  # a LangChain @tool schema
    "type": "object",
    "properties": {"query": {"type": "string"},
                   "filter": {"type": "object", "properties": {"year": {"type": "integer"}}},
                   "extra": {"type": "object", "additionalProperties": True},
                   "properties": {"const": {"description": "kept", "properties": {}}}},
    "required": ["query"]})


def test_forced_arguments_take_no_undeclared_keys_unless_strict_is_false():
    parser = make_parser("hermes")
    strict = accepts_calls(parser.grammar([LOOSE], parallel=False))
    assert strict(parser.call_text("search", {"query": "q", "filter": {"year": 1}}))
    assert strict(parser.call_text("search", {"query": "q", "extra": {"any": 1}}))
    assert strict(parser.call_text("search", {
        "query": "q", "properties": {"description": "kept", "properties": {}}}))  # a const
    assert not strict(parser.call_text("search", {"query": "q", "description": "x"}))
    assert not strict(parser.call_text("search", {"query": "q", "filter": {"month": 1}}))
    lenient = LOOSE.model_copy(update={"strict": False})
    assert calls_schema([lenient], "arguments")["properties"]["arguments"] == LOOSE.parameters
    loose = accepts_calls(parser.grammar([lenient], parallel=False))
    assert loose(parser.call_text("search", {"query": "q", "description": "x"}))
    assert loose(parser.call_text("search", {"query": "q", "filter": {"month": 1}}))


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_parallel_forced_calls_end_after_max_parallel_calls(name):
    parser = make_parser(name)
    accepts = accepts_calls(parser.grammar([NOW], parallel=True))
    separator = "\n" if name == "hermes" else "; "
    calls = [parser.call_text("now", {})] * (MAX_PARALLEL_CALLS + 1)
    assert accepts(separator.join(calls[:1]))
    assert accepts(separator.join(calls[:MAX_PARALLEL_CALLS]))
    assert not accepts(separator.join(calls))


def test_calls_only_drops_separators_and_an_unfinished_call():
    hermes = make_parser("hermes")
    cut = HERMES_OUTPUT.removeprefix("Sure.") + '\n<tool_call>\n{"name": "now", "argu'
    content, calls = hermes.parse(cut, calls_only=True)
    assert content == "" and [c.name for c in calls] == ["get_weather", "now"]
    assert hermes.parse(cut)[0] == '\n\n<tool_call>\n{"name": "now", "argu'  # "auto" keeps it
    llama = make_parser("llama3_json")
    content, calls = llama.parse('{"name": "now", "parameters": {}}; {"name": "no', True)
    assert (content, [c.name for c in calls]) == ("", ["now"])
    assert llama.parse('{"name": "now", "parameters": {}}; {"name": "no') == (
        '{"name": "now", "parameters": {}}; {"name": "no', [])


UNREADABLE = {  # argument JSON a model may write that no client could be handed
    "deep": "[" * 1050 + "]" * 1050,
    "long number": "9" * 4400,
    "out of range": "1e999",
    "NaN": "NaN",
    "Infinity": "-Infinity",
    "lone surrogate": '"\\ud800"',
    "as text": json.dumps('{"x": 1e999}'),  # arguments written as JSON text
}


@pytest.mark.parametrize("case", list(UNREADABLE))
@pytest.mark.parametrize("calls_only", [False, True])
def test_a_call_past_the_bounds_stays_text(case, calls_only):
    hermes, llama = make_parser("hermes"), make_parser("llama3_json")
    body = f'{{"name": "f", "arguments": {UNREADABLE[case]}}}'
    if case != "as text":
        body = f'{{"name": "f", "arguments": {{"x": {UNREADABLE[case]}}}}}'
    good = hermes.call_text("now", {})
    text = f"{good}\n<tool_call>\n{body}\n</tool_call>"
    content, calls = hermes.parse(text, calls_only)
    assert content == ("" if calls_only else "\n") + f"<tool_call>\n{body}\n</tool_call>"
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]
    llama_body = body.replace('"arguments"', '"parameters"')
    text = f'{{"name": "now", "parameters": {{}}}}; {llama_body}'
    if calls_only:
        assert llama.parse(text, True)[0] in (llama_body, text)  # the call, or all when deep
    else:
        assert llama.parse(text) == (text, [])


JSON_VALUES = st.recursive(  # json.dumps writes floats' nan and inf as NaN and Infinity
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3), max_leaves=8)
ARGUMENTS = st.one_of(JSON_VALUES.map(json.dumps), st.sampled_from(list(UNREADABLE.values())))
CALL = ARGUMENTS.map(lambda value: f'{{"name": "f", "arguments": {{"x": {value}}}}}')
PIECES = st.one_of(
    CALL.map(lambda call: f"<tool_call>\n{call}\n</tool_call>"), CALL,
    CALL.map(lambda call: call.replace('"arguments"', '"parameters"') + "; "),
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "\n", "{", "}", "[", "]", '"',
                     '"\\ud800"', "; ", '"arguments": "{\\"a\\": 1}"', "[" * 120]),
    st.text(max_size=8))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(PIECES, max_size=12), st.integers(1, 16), st.booleans())
def test_any_model_output_parses_without_error_into_json_arguments(pieces, step, calls_only):
    """Whatever a model writes, parsing (whole or streamed in any pieces) raises nothing, and
    every call's arguments are a JSON object that encodes as UTF-8."""
    text = "".join(pieces)
    for name in ("hermes", "llama3_json"):
        parser = make_parser(name)
        whole_content, whole_calls = parser.parse(text, calls_only)
        stream = parser.stream(calls_only)
        streamed = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)]
        streamed.append(stream.flush())
        assert "".join(c for c, _ in streamed) == whole_content
        calls = [call for _, cs in streamed for call in cs]
        assert [(c.name, c.arguments) for c in calls] == [
            (c.name, c.arguments) for c in whole_calls]
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
            call.arguments.encode("utf-8")


def test_arguments_are_an_object_where_the_schema_root_does_not_say():
    bare = FunctionDefinition(name="f", parameters={})
    untyped = FunctionDefinition(name="g", parameters={"properties": {"a": {"type": "integer"}}})
    options = calls_schema([bare, untyped], "arguments")["anyOf"]
    assert options[0]["properties"]["arguments"] == {
        "type": "object", "properties": {}, "additionalProperties": False}
    assert options[1]["properties"]["arguments"] == {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
