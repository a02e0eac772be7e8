"""The JSON the OpenAI server answers with: each request's response body and stream chunks
(`CompletionWire`, `ChatWire`), usage, and the model cards. What it accepts is protocol.py."""

from __future__ import annotations

from collections.abc import Callable

from microserve.openai.tool_parsers import ParsedCall
from microserve.messages import TokenLogprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def model_card(model: str, created: int, max_model_len: int, parent: str | None = None) -> dict:
    """One model object, as GET /v1/models/{id} answers it and /v1/models lists it; a LoRA
    adapter's names the base model as its `parent` (as vLLM's do)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "microserve",
            "root": model, "parent": parent, "max_model_len": max_model_len}


def model_list(model: str, created: int, max_model_len: int,
               adapters: list[str] = ()) -> dict:
    """The base model, then its LoRA adapters."""
    return {"object": "list", "data": [model_card(model, created, max_model_len)] + [
        model_card(name, created, max_model_len, parent=model) for name in adapters]}


def _finite(logprob: float) -> float:
    # -inf is not JSON; vLLM reports impossible tokens as -9999.0 too.
    return max(logprob, -9999.0)


class _ResponseWire:
    """Builds one request's response JSON: stream chunks and the non-streaming body."""

    object = ""  # set by subclasses
    chunk_object = ""

    def __init__(self, request_id: str, model: str, created: int, index: int = 0):
        self.request_id, self.model, self.created = request_id, model, created
        self.index = index  # the choice this wire writes (n > 1, a batch of prompts)

    def _envelope(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def opening_chunks(self) -> list[dict]:
        return []

    def usage_chunk(self, usage: dict) -> dict:
        """The extra last chunk that `stream_options.include_usage` asks for."""
        return self._envelope(self.chunk_object, [], usage=usage)

    def chunk(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None) -> dict:
        raise NotImplementedError

    def delta_chunks(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
                     tool_calls: list[tuple[int, ParsedCall]],
                     reasoning: str | None = None) -> list[dict]:
        """The stream chunks of one delta (none if it adds nothing)."""
        if text or logprobs or finish_reason:
            return [self.chunk(text, logprobs, finish_reason)]
        return []


class CompletionWire(_ResponseWire):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, created: int,
                 token_text: Callable[[int], str] | None, index: int = 0):
        super().__init__(request_id, model, created, index)
        self._token_text = token_text  # None: the client did not ask for logprobs
        self._text_offset = 0  # where the next token's text starts; advanced by _logprobs

    def chunk(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None) -> dict:
        choice = {"index": self.index, "text": text, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason}
        return self._envelope(self.chunk_object, [choice])

    def body(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
             usage: dict, tool_calls: list[tuple[int, ParsedCall]] = (),
             reasoning: str | None = None) -> dict:
        assert not tool_calls and reasoning is None, "completions have no tool calls, no reasoning"
        return {**self.chunk(text, logprobs, finish_reason), "usage": usage}

    def _logprobs(self, entries: list[TokenLogprob | int]) -> dict | None:
        """The legacy completions format: parallel lists, top alternatives keyed by text. A
        bare token id is echo's first prompt token, which nothing before it scores: null."""
        if self._token_text is None:
            return None
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            unscored = isinstance(entry, int)
            text = self._token_text(entry if unscored else entry.token_id)
            tokens.append(text)
            text_offset.append(self._text_offset)
            self._text_offset += len(text)
            if unscored:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(entry.logprob))
            top = {self._token_text(t): _finite(p) for t, p in entry.top}
            top.setdefault(text, _finite(entry.logprob))  # as vLLM: the sampled token is listed
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}


class ChatWire(_ResponseWire):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, created: int,
                 token_bytes: Callable[[int], bytes] | None, index: int = 0):
        super().__init__(request_id, model, created, index)
        self._token_bytes = token_bytes  # None: the client did not ask for logprobs

    def opening_chunks(self) -> list[dict]:
        """Chat streams announce the role first, with empty content."""
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice])]

    def chunk(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": self.index, "delta": delta, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason}
        return self._envelope(self.chunk_object, [choice])

    def delta_chunks(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
                     tool_calls: list[tuple[int, ParsedCall]],
                     reasoning: str | None = None) -> list[dict]:
        """Thinking first (--reasoning-parser: `reasoning_content`, and `reasoning` as vLLM
        now names it), then text, then per call (OpenAI's shape) a chunk with its index, id,
        type and name and one with its arguments, then the finish reason."""
        chunks = []
        if reasoning:
            choice = {"index": self.index, "logprobs": None, "finish_reason": None,
                      "delta": {"reasoning_content": reasoning, "reasoning": reasoning}}
            chunks.append(self._envelope(self.chunk_object, [choice]))
        if not tool_calls:
            return chunks + super().delta_chunks(text, logprobs, finish_reason, tool_calls)
        chunks += super().delta_chunks(text, logprobs, None, [])
        for index, call in tool_calls:
            opening = {"index": index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}}
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            chunks += [self._tool_call_chunk(opening), self._tool_call_chunk(arguments)]
        if finish_reason is not None:
            chunks.append(self.chunk("", [], finish_reason))
        return chunks

    def _tool_call_chunk(self, tool_call: dict) -> dict:
        choice = {"index": self.index, "delta": {"tool_calls": [tool_call]}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope(self.chunk_object, [choice])

    def body(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None,
             usage: dict, tool_calls: list[tuple[int, ParsedCall]] = (),
             reasoning: str | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if reasoning is not None:  # a reasoning parser is on: its fields, null if it thought not
            message["reasoning_content"] = message["reasoning"] = reasoning or None
            message["content"] = text or None  # as vLLM's: null when it only thought
        if tool_calls:  # content is what the model wrote besides the calls, or null
            message["content"] = text.strip() or None
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for _, call in tool_calls]
        choice = {"index": self.index, "message": message, "logprobs": self._logprobs(logprobs),
                  "finish_reason": finish_reason}
        return self._envelope(self.object, [choice], usage=usage)

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self._token_bytes is None:
            return None
        return {"content": token_logprobs(entries, self._token_bytes)}


def token_logprobs(entries: list[TokenLogprob], token_bytes: Callable[[int], bytes]) -> list[dict]:
    """Chat's (and the Responses API's) logprob entries: each token's text, logprob and bytes,
    with its top alternatives."""

    def token(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob),
                "bytes": list(raw)}

    return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, p) for t, p in e.top]}
            for e in entries]
