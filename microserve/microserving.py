"""The microserving API's messages (DESIGN §4), shared by the engine and the router. No torch.

Three sub-request calls split one request across engines (paper §3.1):

    D.prep_recv(prompt, end)            -> matched, kv_addr   reserve D's slots for [matched, end)
    P.remote_send(prompt, begin, end, kv_addr)               make KV of [begin, end) land there
    D.start_generate(prompt, begin)     -> token ids          KV of [0, begin) is on D already

plus `commit` (adopt received KV without generating: context migration), `abort`, `pin`/`unpin`
and `stats`. `begin`/`end` index the prompt Python-style (negative counts from the end).
Bodies are JSON or msgpack; these models validate both (field errors become a 400 that names
the field). Checks that need the prompt length or the engine's state are the engine's.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from microserve.bounds import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_GRAMMAR_CHARS, Count, Index,
                               Seed, TokenId)
from microserve.protocol import MAX_LOGPROBS
from microserve.types import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Slot = Annotated[int, Field(ge=0, le=INT64_MAX)]  # checked against the receiver's pool
Position = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowIndex = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowTag = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # the window's secret


class KVAddr(_Body):
    """Where a receiver wants KV written: run-length ranges of its flat slots
    (slot = page * page_size + offset) covering prompt positions [begin, end) in order,
    its KV layout, its transfer descriptor, and the write window the slots belong to.

        positions:  begin ............................................ end
        ranges:     [(s0, n0),              (s1, n1),        (s2, n2)]   n0 + n1 + n2 = end - begin
    """

    begin: Position
    end: Position
    ranges: list[tuple[Slot, Count]]
    layout: dict
    transfer: dict  # signed by the receiver (microserve/transfer_auth.py); the sender verifies it
    window: tuple[WindowIndex, WindowTag]

    @property
    def num_slots(self) -> int:
        return sum(n for _, n in self.ranges)

    def slots(self) -> list[int]:
        return [s for start, n in self.ranges for s in range(start, start + n)]


def slot_ranges(slots: list[int]) -> list[tuple[int, int]]:
    """Run-length form of a slot list: [5, 6, 7, 20, 21] -> [(5, 3), (20, 2)]."""
    out: list[list[int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1][1] += 1
        else:
            out.append([s, 1])
    return [(a, n) for a, n in out]


class PrepRecvRequest(_Body):
    request_id: str = Field(min_length=1, max_length=256)
    prompt: list[TokenId] = Field(min_length=1)
    end: Index = -1
    lease_s: float | None = Field(None, gt=0)  # default --kv-lease-s; at most --kv-lease-max-s
    # How long to wait for pages if none are free: default --kv-recv-wait-s; 0 answers a 503 at
    # once; at most --kv-recv-wait-max-s.
    wait_s: float | None = Field(None, ge=0)


class PrepRecvResponse(_Body):
    matched: int  # prompt tokens already in this engine's prefix cache (a page multiple)
    kv_addr: KVAddr


class RemoteSendRequest(_Body):
    request_id: str = Field(min_length=1, max_length=256)
    prompt: list[TokenId] = Field(min_length=1)
    begin: Index = 0
    end: Index = -1
    kv_addr: KVAddr


class RemoteSendResponse(_Body):
    sent: int  # tokens whose KV now sits in the receiver's slots (= end - begin)
    computed: int  # tokens this engine prefilled to produce them (may start before begin)
    reused: int  # tokens of [begin, end) copied from this engine's prefix cache


class Sampling(_Body):
    """Token-level sampling (the router resolves OpenAI defaults before it calls)."""

    max_tokens: Count = 16
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=INT32_MAX)  # the engine checks it against its vocabulary
    seed: Seed | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # An llguidance grammar the tokens must follow (SamplingParams.grammar); only the engine
    # that samples (start_generate) uses it.
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)

    def to_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.model_dump())


class StartGenerateRequest(_Body):
    request_id: str = Field(min_length=1, max_length=256)
    prompt: list[TokenId] = Field(min_length=1)
    begin: Index = 0
    sampling: Sampling = Field(default_factory=Sampling)
    stream: bool = True


class CommitRequest(_Body):
    request_id: str = Field(min_length=1, max_length=256)
    pin: bool = False


class CommitResponse(_Body):
    cached: int  # leading tokens of the received context now in the prefix cache (page multiple)
    pinned: bool


class AbortRequest(_Body):
    request_id: str = Field(min_length=1, max_length=256)


class AbortResponse(_Body):
    aborted: bool  # False: the engine held nothing under this request_id


class PinRequest(_Body):
    prompt: list[TokenId] = Field(min_length=1)


class PinResponse(_Body):
    tokens: int  # leading tokens of the prompt (a page multiple) now pinned / unpinned


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was already on this engine (received or cached)


class GenerateChunk(_Body):
    """One item of start_generate's stream. The last one has finish_reason and usage."""

    token_ids: list[int]
    logprobs: list[dict] | None = None  # [{"token_id", "logprob", "top": [[id, logprob]]}]
    finish_reason: str | None = None
    usage: Usage | None = None
    # The first chunk's: what usage.cached_tokens will say, for a caller that stops reading
    # early (a stop string matched).
    cached_tokens: int | None = None
