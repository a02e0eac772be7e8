"""The contract between an OpenAI frontend and whatever produces tokens for it.

The engine daemon implements it over its engine-core process; the router (later) implements it
over a strategy that spreads a request across engines. The frontend owns the tokenizer, text,
stop strings and the OpenAI wire format; a backend speaks token ids only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from microserve.messages import GenerateChunk, SamplingParams

# How long a request may wait for an engine to start computing it before it gets a 503 (code
# queue_timeout): the default of the router's queue_timeout_s and of an engine's own
# --queue-timeout-s (its /v1); one default for both, so an engine alone bounds what a router does
QUEUE_TIMEOUT_S = 60.0
# What a client whose request found no room (or waited its queue time) is told: Retry-After
RETRY_AFTER_S = 5


class BackendUnavailable(Exception):
    """The backend cannot take the request now (engine down, KV full): maps to HTTP 503, with
    a Retry-After header if `retry_after` (seconds) is set."""

    retry_after: int | None = None


@dataclass(frozen=True)
class Client:
    """Who sent the request being generated: what a router's A/B experiment keys its arm on
    (router/arms.py). Set by the OpenAI frontend for the request's task (`CLIENT`), so a
    backend reads it without every generate() signature carrying it."""

    user: str | None = None  # the body's `user` field
    headers: Mapping[str, str] = field(default_factory=dict)  # case-insensitive where HTTP's


CLIENT: ContextVar[Client | None] = ContextVar("microserve_client", default=None)


class RequestRejected(ValueError):
    """The backend refused the request as invalid (e.g. longer than its KV pool): HTTP 400.

    The message names the field and the numbers, like every 400 we send; `param` is the
    request field to blame, when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BackendError(Exception):
    """A failure of the serving side whose message is safe and useful to show the client (a 500
    that says what failed, e.g. which router strategy raised); details go to the log."""


class MicroservingError(Exception):
    """A microserving call failed; `status` is the HTTP status the engine answers with:
    400 bad field (named in `param`), 404 unknown request_id, 409 request_id in use,
    502 the KV transfer to the peer failed, 503 no KV pages or windows free now."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code  # e.g. "kv_wait_timeout": a 503 that waited its time (not retried)
        self.retry_after: int | None = None  # seconds: the client's Retry-After, if any


class GenerateBackend(ABC):
    model_name: str  # the name /v1/models reports and requests must use
    max_model_len: int  # prompt + completion tokens must fit in this

    @abstractmethod
    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, choices_of: str | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the request's output chunks; the last one has finish_reason and usage, the
        first one says how many prompt tokens were cached (`cached_tokens`). `priority`: the
        request's rank on engines run with --scheduling-policy priority (lower first).
        `choices_of`: a key the `n` choices of one prompt of one response share (None for a
        lone choice): a backend may compute their prompt once for all of them.

        Raises BackendUnavailable before the first output if the request cannot be served now,
        RequestRejected if it can never be served as asked.
        The request lives as long as the iterator: closing (or cancelling) it before the
        finishing chunk stops the request wherever it is and frees everything it holds.
        """

    def lora_names(self) -> list[str]:
        """The LoRA adapters a request may name in `model` besides model_name (it then
        generates with SamplingParams.lora_name set to it)."""
        return []

    async def healthy(self) -> bool:
        return True

    async def metrics_text(self) -> str:
        """Prometheus text of backend-side metrics (KV pages, queue lengths, ...)."""
        return ""
