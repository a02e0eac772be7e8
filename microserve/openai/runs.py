"""One choice of an OpenAI request in flight (`Run`), what each backend output adds to it
(`Delta`), several choices run side by side, and the server-sent events they become: the
frontend's bookkeeping apart from its routes (microserve/openai/app.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import msgspec

from microserve.backend import BackendError
from microserve.errors import as_openai_error
from microserve.openai.reasoning import ThinkSplitter
from microserve.openai.tool_parsers import CallStream, ParsedCall
from microserve.messages import SamplingParams, TokenLogprob

log = logging.getLogger("microserve.openai.app")  # the frontend's logger (app.py's)


_JSON = msgspec.json.Encoder()  # the stream's chunks: ~9x faster than json.dumps, same JSON


def sse(payload: dict | str) -> bytes:
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + _JSON.encode(payload) + b"\n\n"


@dataclass
class Delta:
    """What one backend output added to the response."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tool_calls: list[tuple[int, ParsedCall]] = field(default_factory=list)  # (index, call)
    reasoning: str | None = None  # thinking split from the text (None: no reasoning parser)


@dataclass
class Run:
    """One generation in flight; the counters are written by OpenAIFrontend._note_output."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    arrival: float  # time.perf_counter() when the handler started
    priority: int = 0  # the body's, passed to the backend
    choices_of: str | None = None  # shared by the n > 1 choices of one prompt (the backend's)
    tool_calls: CallStream | None = None  # reads tool calls out of the text (chat with tools)
    echo: str | None = None  # completions' echo: the prompt text the first delta starts with
    include_stop: bool = False  # include_stop_str_in_output: the stop string stays in the text
    skip_special_tokens: bool = True  # the detokenizer's
    num_tool_calls: int = 0  # calls found so far; written by OpenAIFrontend._delta
    num_generated: int = 0
    num_cached: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    finish_reason: str | None = None  # the backend's or a stop string's; None: cut short
    reasoning: ThinkSplitter | None = None  # --reasoning-parser: splits thinking from the text


async def collect(deltas: AsyncIterator[Delta]) -> Delta:
    """All of a generation's deltas as one."""
    whole = Delta("", [], None)
    texts, thoughts = [], []
    async for delta in deltas:
        texts.append(delta.text)
        whole.logprobs.extend(delta.logprobs)
        whole.tool_calls.extend(delta.tool_calls)
        whole.finish_reason = delta.finish_reason
        if delta.reasoning is not None:
            thoughts.append(delta.reasoning)
    whole.text = "".join(texts)
    whole.reasoning = "".join(thoughts) if thoughts else None
    return whole


def run_id(response_id: str, index: int, total: int) -> str:
    """The engines' request id of choice `index`: the response's own id when it is the only
    one."""
    return response_id if total == 1 else f"{response_id}-{index}"


async def all_or_none(coros: list) -> list:
    """The results of `coros` run side by side; when one fails (or this is cancelled) the
    others are cancelled before the error goes on. One is awaited as it is (no task: the
    common case of one choice pays nothing)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(gens: list[AsyncGenerator]) -> None:
    """Close generators that may be left at a yield (their cleanup aborts their requests)."""
    for gen in gens:
        await gen.aclose()


def stream_error(e: Exception, request_id: str) -> dict:
    """The last event of a stream whose backend failed: the status line is gone already."""
    error = as_openai_error(e)
    if error.status_code == 500 and not isinstance(e, BackendError):  # a bug or a crash
        log.exception("request %s failed while streaming", request_id)
    return error.body()
