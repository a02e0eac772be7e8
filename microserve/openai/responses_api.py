"""OpenAI's Responses API (POST /v1/responses) over the chat completions machinery: the request.

A request is turned into the chat request it means (`chat_request`): `instructions` becomes the
system turn, `input` the conversation (a string, or message items with text parts, and
`function_call` / `function_call_output` items for tool turns), `tools` chat's function tools,
`text.format` the response format, `max_output_tokens` the completion budget. The chat path
then renders, checks and generates it as it does any chat request; `ResponseWriter`
(responses_writer.py) writes the answer in the Responses API's shapes. Errors name the
Responses API's fields (`renamed`).

Stateless, as vLLM's server is by default: nothing is stored, so `previous_response_id` is
refused (send the conversation in `input`) and `store` changes nothing. Only function tools.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator

from microserve.errors import OpenAIError, from_validation_errors, invalid_request
from microserve.openai.protocol import ChatCompletionRequest, Count

# chat's names -> the Responses API's, for the errors of the converted request (in order)
_RENAMES = ((re.compile(r"^response_format(\.json_schema)?"), "text.format"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
            (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
            (re.compile(r"^tool_choice\..*"), "tool_choice"))  # fmt: skip
# developer is the Responses API's word for what chat templates call system
_MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
                  "developer": "system"}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # what `include` names to get the tokens' logprobs


class ResponsesRequest(BaseModel):
    """What POST /v1/responses accepts; fields it does not know are ignored (as OpenAI's)."""

    model: str | None = None
    input: Any  # a string, or a list of items (objects): checked by _messages, naming input[i]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # a string or {"type": "function", "name"}: _tool_choice
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True  # accepted; nothing is stored
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    seed: int | None = None
    priority: int | None = None  # vLLM's extension, as on chat (a batch line's is set for it)
    top_logprobs: int | None = None  # bounded as chat's
    include: list[str] | None = None  # "message.output_text.logprobs": the tokens' logprobs

    @field_validator("input")
    @classmethod
    def _string_or_items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise ValueError(f"item {i} is a {type(item).__name__}, not an object")
        return value

    @field_validator("text")
    @classmethod
    def _format_object(cls, value: dict | None) -> dict | None:
        if value is not None and not isinstance(value.get("format", {}), (dict, type(None))):
            raise ValueError("text.format must be an object, e.g. {\"type\": \"json_schema\", ...}")
        return value


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `body` means, validated (errors name the Responses API's fields)."""
    if body.previous_response_id is not None:
        raise invalid_request("previous_response_id is not supported: this server keeps no "
                              "responses; send the conversation in 'input'",
                              "previous_response_id")
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body),
                            "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls}
    for name in ("temperature", "top_p", "user", "seed", "priority"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.get("format") is not None:
        chat["response_format"] = _format(body.text["format"])
    if body.top_logprobs is not None or LOGPROBS in (body.include or ()):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise renamed(from_validation_errors(e.errors()), body) from None


def renamed(error: OpenAIError, body: ResponsesRequest) -> OpenAIError:
    """A chat request's error in the Responses API's names: `messages[i]` is `input[i]` (one
    less with instructions in front), `max_completion_tokens` is `max_output_tokens`,
    `response_format` is `text.format`, a tool's `function.` is dropped."""
    param = error.param
    if param is None:
        return error
    shift = 0 if body.instructions is None else 1
    new = re.sub(r"^messages\[(\d+)\]", lambda m: f"input[{int(m[1]) - shift}]", param)
    new = "input" if new == "messages" else new
    for pattern, replacement in _RENAMES:
        new = pattern.sub(replacement, new)
    if new == param:
        return error
    return OpenAIError(error.status_code, error.message.replace(param, new), type=error.type,
                       param=new, code=error.code, retry_after=error.retry_after)


def _messages(body: ResponsesRequest) -> list[dict]:
    messages = [] if body.instructions is None else [
        {"role": "system", "content": body.instructions}]
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    if not body.input:
        raise invalid_request("input is empty", "input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise invalid_request(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}; "
                                      f"got {role!r}", f"{where}.role")
            messages.append({"role": _MESSAGE_ROLES[role],
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output})
        else:
            raise invalid_request(f"{where} is an item of type {kind!r}; this server takes "
                                  "message, function_call and function_call_output items",
                                  f"{where}.type")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines, as chat's are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where}.content must be a string or a list of text parts",
                              f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS:
            raise invalid_request(f"{where}.content[{j}] is a part of type {kind!r}; only text "
                                  "parts (input_text, output_text) are supported",
                                  f"{where}.content[{j}].type")
        if not isinstance(part.get("text"), str):
            raise invalid_request(f"{where}.content[{j}].text must be a string",
                                  f"{where}.content[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _tool(i: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise invalid_request(f"tools[{i}] is a tool of type {tool.get('type')!r}; this server "
                              "runs function tools only", f"tools[{i}].type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> str | dict:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid_request("tool_choice must be none, auto, required or "
                          '{"type": "function", "name": ...}', "tool_choice")


def _format(fmt: dict) -> dict:
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid_request(f"text.format.type must be text, json_object or json_schema; got "
                          f"{kind!r}", "text.format.type")
