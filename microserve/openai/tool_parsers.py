"""Tool-call formats: how calls look in a model's text, rendered, forced and parsed back.

`--tool-call-parser` picks one (as in vLLM):

  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one block per call
               (Hermes 2 Pro, Qwen 2.5 and later, and the fallback for templates without tools)
  llama3_json  {"name": "f", "parameters": {...}}, calls separated by "; " (Llama 3.1 and later)

A parser does four things:
  - `inline(messages, tools)`: for a chat template that does not render tools, put the tool
    definitions into the system prompt, earlier calls into the assistant turns and tool
    results into user turns, all in this format (a template that knows tools gets them as is);
  - `grammar(functions, parallel)`: the Lark grammar (llguidance's dialect) whose sentences
    are exactly well-formed calls of these functions with schema-valid arguments;
  - `parse(text, calls_only)`: (content, calls) of a whole output; a call that does not parse
    stays content;
  - `stream(calls_only)`: the same incrementally, for streamed responses: content is released as soon as
    it cannot be the start of a call, and each call as soon as it is complete.

A model may write anything. Call JSON is read by bounded_json: a call nested too deep, with a
number too long, `NaN`, `Infinity`, a number out of a double's range or a lone surrogate is
not a call and stays content, as text, so every `arguments` handed out is valid JSON (and
UTF-8). With `calls_only` (the output was forced to be calls: tool_choice "required" or a named
function) nothing but calls is content: the separators between calls and an unfinished call
(cut by max_tokens or a stop string) are dropped; only a finished call that cannot be read
stays content.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from microserve import bounded_json
from microserve.bounded_json import JSONBoundsError
from microserve.openai.tool_schemas import calls_schema
from microserve.openai.tools import FunctionDefinition

# Calls one forced output may make when parallel calls are allowed: the grammar ends the list
# there (a small model would otherwise repeat its call until max_tokens).
MAX_PARALLEL_CALLS = 8


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call_from_json(text: str, arguments_key: str) -> ParsedCall | None:
    """A call from one call's JSON text, or None if it is not one (not JSON, not a call, or
    JSON past bounded_json's bounds: those stay text)."""
    try:
        return _call_from_value(bounded_json.loads(text), arguments_key)
    except (json.JSONDecodeError, JSONBoundsError):
        return None


def _call_from_value(value: object, arguments_key: str) -> ParsedCall | None:
    """A call from one call's parsed JSON (read by bounded_json), or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = bounded_json.loads(arguments)
        except (json.JSONDecodeError, JSONBoundsError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _as_object(arguments: dict | str) -> dict | str:
    """Arguments from the history as an object where they parse as one (else the text)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return bounded_json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, JSONBoundsError):
        return arguments


def _repeated(item: str, separator: str, parallel: bool) -> str:
    """Lark for one `item`, or (parallel) 1 to MAX_PARALLEL_CALLS of them."""
    if not parallel:
        return item
    return f'{item} ("{separator}" {item}){{0,{MAX_PARALLEL_CALLS - 1}}}'


class ToolParser(ABC):
    name: str
    arguments_key: str  # what the format calls the arguments object

    def inline(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The conversation with tools, calls and results written as text, for a template
        that renders only roles and content."""
        out: list[dict] = []
        for message in messages:
            role, content = message["role"], message.get("content") or ""
            if role == "tool":
                text = self.result_text(content)
                if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "tool_results": True})
                continue
            calls = [self.call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in message.get("tool_calls") or ()]
            message = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
            if calls:
                message["content"] = "\n".join([content, *calls] if content else calls)
            out.append(message)
        out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
        if tools:
            prompt = self.system_prompt(tools)
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    @abstractmethod
    def system_prompt(self, tools: list[dict]) -> str: ...

    @abstractmethod
    def call_text(self, name: str, arguments: dict | str) -> str: ...

    def result_text(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    @abstractmethod
    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str: ...

    def parse(self, text: str, calls_only: bool = False) -> tuple[str, list[ParsedCall]]:
        stream = self.stream(calls_only)
        content, calls = stream.feed(text)
        more_content, more_calls = stream.flush()
        return content + more_content, calls + more_calls

    @abstractmethod
    def stream(self, calls_only: bool = False) -> "CallStream": ...


class CallStream(ABC):
    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """New output text in; the content safe to release and the calls now complete."""

    @abstractmethod
    def flush(self) -> tuple[str, list[ParsedCall]]:
        """The output ended: whatever was held back."""


class HermesParser(ToolParser):
    name = "hermes"
    arguments_key = "arguments"
    START, END = "<tool_call>", "</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        definitions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                "The function signatures are inside <tools></tools> tags:\n<tools>\n"
                f"{definitions}\n</tools>\n\nTo call a function, write a JSON object with its "
                "name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def call_text(self, name: str, arguments: dict | str) -> str:
        arguments = _as_object(arguments)
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.START}\n{body}\n{self.END}"

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        schema = json.dumps(calls_schema(functions, self.arguments_key))
        calls = _repeated("call", "\\n", parallel)
        return (f"start: {calls}\n"
                f'call: "{self.START}\\n" %json {schema} "\\n{self.END}"\n')

    def stream(self, calls_only: bool = False) -> "CallStream":
        return TaggedCallStream(self.START, self.END, self.arguments_key, calls_only)


class TaggedCallStream(CallStream):
    """Calls between a start and an end tag; text outside them is content.

        "Sure.<tool_call>{...}</tool_call>"  ->  content "Sure.", one call
        "a <tool"                            ->  content "a ", "<tool" held (may open a call)
    """

    def __init__(self, start: str, end: str, arguments_key: str, calls_only: bool = False):
        self.start, self.end, self.arguments_key = start, end, arguments_key
        self.calls_only = calls_only  # text outside calls and unfinished calls are dropped
        self._buffer = ""
        self._in_call = False
        self._searched = 0  # inside a call: where the search for the end tag resumes

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(self.end, self._searched)
                if end == -1:  # a long call streamed token by token is searched once
                    self._searched = max(len(self._buffer) - len(self.end) + 1, 0)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.end):]
                self._in_call, self._searched = False, 0
                self._close(body, content, calls)
            else:
                start = self._buffer.find(self.start)
                if start == -1:
                    keep = _partial_suffix(self._buffer, self.start)
                    self._content(self._buffer[:len(self._buffer) - keep], content)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._content(self._buffer[:start], content)
                self._buffer = self._buffer[start + len(self.start):]
                self._in_call = True
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ParsedCall]]:
        content, calls = [], []
        if self._in_call and not self.calls_only:  # it counts if its JSON is whole
            self._close(self._buffer, content, calls, closed=False)
        elif not self._in_call:
            self._content(self._buffer, content)
        self._buffer, self._in_call, self._searched = "", False, 0
        return "".join(content), calls

    def _content(self, text: str, content: list[str]) -> None:
        if not self.calls_only:
            content.append(text)

    def _close(self, body: str, content: list[str], calls: list[ParsedCall],
               closed: bool = True) -> None:
        call = _call_from_json(body.strip(), self.arguments_key)
        if call is not None:
            calls.append(call)
        else:  # not a call after all: give the text back as it was
            content.append(self.start + body + (self.end if closed else ""))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    SEPARATOR = "; "

    def system_prompt(self, tools: list[dict]) -> str:
        definitions = "\n\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in "
                'the format {"name": function name, "parameters": dictionary of argument name '
                "and its value}. Do not use variables.\n\n" + definitions)

    def call_text(self, name: str, arguments: dict | str) -> str:
        arguments = _as_object(arguments)
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def grammar(self, functions: list[FunctionDefinition], parallel: bool) -> str:
        schema = json.dumps(calls_schema(functions, self.arguments_key))
        calls = _repeated("call", self.SEPARATOR, parallel)
        return f"start: {calls}\ncall: %json {schema}\n"

    def parse(self, text: str, calls_only: bool = False) -> tuple[str, list[ParsedCall]]:
        """Calls only when the whole output is calls (the format has no tags to find). With
        `calls_only`, the calls before one that is unfinished or cannot be read: the unfinished
        one is dropped, one that cannot be read is content with all that follows it."""
        if not text.lstrip().startswith("{"):
            return ("", []) if calls_only else (text, [])
        try:
            bounded_json.check_depth(text)
        except JSONBoundsError:
            return text, []
        calls, at = [], len(text) - len(text.lstrip())
        while at < len(text):
            try:
                value, end = bounded_json.raw_decode(text, at)
                call = _call_from_value(value, self.arguments_key)
            except json.JSONDecodeError:  # not JSON, or (forced) cut off
                return ("", calls) if calls_only else (text, [])
            except JSONBoundsError:
                call = None
            if call is None:
                return (text[at:], calls) if calls_only else (text, [])
            calls.append(call)
            at = end
            while at < len(text) and text[at] in "; \n\t":
                at += 1
        return "", calls

    def stream(self, calls_only: bool = False) -> "CallStream":
        return WholeOutputStream(self, calls_only)


class WholeOutputStream(CallStream):
    """For formats whose calls are the whole output: text that starts with "{" is held to the
    end and parsed there; any other text streams as content."""

    def __init__(self, parser: ToolParser, calls_only: bool = False):
        self.parser, self.calls_only = parser, calls_only
        self._held: list[str] | None = []  # None once the output is known to be content
        self._calls = False  # the held text starts with "{": held to the end

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._held is None:
            return ("" if self.calls_only else text), []
        self._held.append(text)
        if self._calls:
            return "", []
        held = "".join(self._held)
        if not held.strip() or held.lstrip().startswith("{"):
            self._held, self._calls = [held], bool(held.strip())
            return "", []
        self._held = None  # content: not calls
        return ("" if self.calls_only else held), []

    def flush(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = "".join(self._held or ()), None
        return self.parser.parse(held, self.calls_only) if held else ("", [])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}; got {name!r}")
    return PARSERS[name]()
