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
  - `parse(text)`: (content, calls) of a whole output; a call that does not parse stays content;
  - `stream()`: the same incrementally, for streamed responses: content is released as soon as
    it cannot be the start of a call, and each call as soon as it is complete.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from microserve.guided import JSON_OPTIONS
from microserve.tools import FunctionDefinition

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call_from_json(text: str, arguments_key: str) -> ParsedCall | None:
    """A call from one call's JSON text, or None if it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _as_object(arguments: dict | str) -> dict | str:
    """Arguments from the history as an object where they parse as one (else the text)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments


def _calls_schema(functions: list[FunctionDefinition], arguments_key: str) -> dict:
    """One call of any of `functions`: {"name": <its name>, <arguments_key>: <its schema>}."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": f.name}, arguments_key: f.parameters or NO_ARGUMENTS},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


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

    @abstractmethod
    def parse(self, text: str) -> tuple[str, list[ParsedCall]]: ...

    @abstractmethod
    def stream(self) -> "CallStream": ...


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
        schema = json.dumps(_calls_schema(functions, self.arguments_key))
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"start: {calls}\n"
                f'call: "{self.START}\\n" %json {schema} "\\n{self.END}"\n')

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        stream = self.stream()
        content, calls = stream.feed(text)
        more_content, more_calls = stream.flush()
        return content + more_content, calls + more_calls

    def stream(self) -> "CallStream":
        return TaggedCallStream(self.START, self.END, self.arguments_key)


class TaggedCallStream(CallStream):
    """Calls between a start and an end tag; text outside them is content.

        "Sure.<tool_call>{...}</tool_call>"  ->  content "Sure.", one call
        "a <tool"                            ->  content "a ", "<tool" held (may open a call)
    """

    def __init__(self, start: str, end: str, arguments_key: str):
        self.start, self.end, self.arguments_key = start, end, arguments_key
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(self.end)
                if end == -1:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.end):]
                self._in_call = False
                self._close(body, content, calls)
            else:
                start = self._buffer.find(self.start)
                if start == -1:
                    keep = _partial_suffix(self._buffer, self.start)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.start):]
                self._in_call = True
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ParsedCall]]:
        content, calls = [], []
        if self._in_call:  # the output ended inside a call: it counts if its JSON is whole
            self._close(self._buffer, content, calls, closed=False)
        else:
            content.append(self._buffer)
        self._buffer, self._in_call = "", False
        return "".join(content), calls

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
        schema = json.dumps(_calls_schema(functions, self.arguments_key))
        calls = f'call ("{self.SEPARATOR}" call)*' if parallel else "call"
        return f"start: {calls}\ncall: %json {schema}\n"

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Calls only when the whole output is calls (the format has no tags to find)."""
        if not text.lstrip().startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], len(text) - len(text.lstrip())
        while at < len(text):
            try:
                value, end = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return text, []
            call = _call_from_json(json.dumps(value), self.arguments_key)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(text) and text[at] in "; \n\t":
                at += 1
        return "", calls

    def stream(self) -> "CallStream":
        return WholeOutputStream(self)


class WholeOutputStream(CallStream):
    """For formats whose calls are the whole output: text that starts with "{" is held to the
    end and parsed there; any other text streams as content."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._held: str | None = ""  # None once the output is known to be content

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._held is None:
            return text, []
        self._held += text
        if not self._held.strip() or self._held.lstrip().startswith("{"):
            return "", []
        content, self._held = self._held, None
        return content, []

    def flush(self) -> tuple[str, list[ParsedCall]]:
        held, self._held = self._held, None
        return self.parser.parse(held) if held else ("", [])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(PARSERS)}; got {name!r}")
    return PARSERS[name]()
