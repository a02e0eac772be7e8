"""The Responses API's answer (POST /v1/responses, responses_api.py): the response object and
its stream of typed events, written from the chat machinery's deltas.

    output items, in the order they open:  [reasoning]  [message: output_text]  [function_call]...
    a stream:  response.created, response.in_progress,
               per item: output_item.added, its deltas (reasoning_text / output_text /
               function_call_arguments), their .done, output_item.done,
               then response.completed (or .incomplete at max_output_tokens, .failed)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from microserve.messages import TokenLogprob
from microserve.openai.responses import token_logprobs
from microserve.openai.responses_api import ResponsesRequest
from microserve.openai.tool_parsers import ParsedCall


def usage(chat_usage: dict) -> dict:
    """Chat's usage in the Responses API's names."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseWriter:
    """One response's JSON: the whole object, or its stream of events (`events_*`)."""

    def __init__(self, body: ResponsesRequest, model: str,
                 token_bytes: Callable[[int], bytes] | None = None):
        """`token_bytes`: the tokenizer's, when the request asked for logprobs."""
        self.body, self.model, self._token_bytes = body, model, token_bytes
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.output: list[dict] = []  # the items, in the order they were opened
        self._held: list[dict] = []  # streamed logprobs not yet sent with a text delta
        self._message: dict | None = None  # the message item being written (streaming)
        self._reasoning: dict | None = None  # the reasoning item being written (streaming)
        self._sequence = 0

    # -- the response object ----------------------------------------------------------------

    def response(self, status: str, usage_: dict | None = None,
                 finish_reason: str | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "output": self.output,
                "parallel_tool_calls": body.parallel_tool_calls,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "temperature": body.temperature, "top_p": body.top_p, "text": {"format": fmt},
                "previous_response_id": None, "store": False, "truncation": "disabled",
                "metadata": body.metadata or {}, "user": body.user, "usage": usage_}

    def whole(self, text: str, logprobs: list[TokenLogprob], calls: list[ParsedCall],
              finish_reason: str | None, usage_: dict, reasoning: str | None = None) -> dict:
        """The non-streaming answer: the thinking as a reasoning item (--reasoning-parser),
        the text as one message item (if any), then the calls."""
        if reasoning:
            self.output.append(self._reasoning_item(reasoning, "completed"))
        if text or not calls:
            self.output.append(self._message_item(text, "completed"))
            self.output[-1]["content"][0]["logprobs"] = self._logprobs(logprobs)
        self.output += [self._call_item(call) for call in calls]
        return self.response("completed", usage_, finish_reason)

    @staticmethod
    def _reasoning_item(text: str, status: str) -> dict:
        return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    def _message_item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self._text_part(text)]
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def _text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call_item(call: ParsedCall) -> dict:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}",
                "call_id": call.id, "name": call.name, "arguments": call.arguments,
                "status": "completed"}

    # -- the stream -------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> bytes:
        """One server-sent event, named as the Responses API names it."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def events_opening(self) -> list[bytes]:
        start = self.response("in_progress")
        return [self.event("response.created", response=start),
                self.event("response.in_progress", response=start)]

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict]:
        return [] if self._token_bytes is None else token_logprobs(entries, self._token_bytes)

    def events_reasoning(self, text: str | None) -> list[bytes]:
        """A piece of thinking, opening the reasoning item first if this is its first."""
        if not text:
            return []
        out = []
        if self._reasoning is None:
            self._reasoning = self._reasoning_item("", "in_progress")
            self.output.append(self._reasoning)
            out.append(self.event("response.output_item.added",
                                  output_index=len(self.output) - 1,
                                  item={**self._reasoning, "content": []}))
        self._reasoning["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                              output_index=self.output.index(self._reasoning), content_index=0,
                              delta=text))
        return out

    def _close_reasoning(self) -> list[bytes]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        return [self.event("response.reasoning_text.done", item_id=item["id"],
                           output_index=index, content_index=0,
                           text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def events_text(self, text: str, logprobs: list[TokenLogprob] = ()) -> list[bytes]:
        """A text delta, opening the message item first if this is its first text. Logprobs of
        tokens with no text yet (a character's first bytes) wait for the next delta."""
        self._held += self._logprobs(logprobs)
        if not text:
            return []
        out = self._close_reasoning()  # the answer begins: the thinking has ended
        if self._message is None:
            self._message = self._message_item(None, "in_progress")
            self.output.append(self._message)
            out += [self.event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**self._message, "content": []}),
                    self.event("response.content_part.added", item_id=self._message["id"],
                               output_index=len(self.output) - 1, content_index=0,
                               part=self._text_part(""))]
            self._message["content"] = [self._text_part("")]
        part, entries, self._held = self._message["content"][0], self._held, []
        part["text"] += text
        part["logprobs"] += entries
        out.append(self.event("response.output_text.delta", item_id=self._message["id"],
                              output_index=self.output.index(self._message), content_index=0,
                              delta=text, logprobs=entries))
        return out

    def events_call(self, call: ParsedCall) -> list[bytes]:
        """A parsed call as a whole function_call item (its arguments in one delta)."""
        out = self._close_reasoning() + self._close_message()
        item = self._call_item(call)
        self.output.append(item)
        index = len(self.output) - 1
        out += [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def _close_message(self) -> list[bytes]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self.output.index(message)
        part = message["content"][0]
        part["logprobs"] += self._held  # tokens whose text never came (a stop token's)
        self._held = []
        message["status"] = "completed"
        return [self.event("response.output_text.done", item_id=message["id"],
                           output_index=index, content_index=0, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", item_id=message["id"],
                           output_index=index, content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=message)]

    def events_closing(self, finish_reason: str | None, usage_: dict) -> list[bytes]:
        out = self._close_reasoning() + self._close_message()
        done = self.response("completed", usage_, finish_reason)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=done)]

    def events_failed(self, error: dict) -> list[bytes]:
        """The last event when generation failed mid-stream: `error` is OpenAI's error
        object (message, code, ...)."""
        failed = self.response("failed", error={"code": error.get("code") or "server_error",
                                                "message": error.get("message", "")})
        return [self.event("response.failed", response=failed)]
