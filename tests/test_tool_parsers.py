"""Tool-call formats without a model: parsing whole and streamed outputs, rendering the
history for a template without tools, and the grammars that force calls."""

from __future__ import annotations

import json

import llguidance
import pytest

from microserve.guided import checked
from microserve.tool_parsers import make_parser
from microserve.tools import FunctionDefinition

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
