"""Every message that crosses a process boundary, once: one vocabulary for every hop. No torch.

    hop                                     encoding                 checked
    client or router -> engine (HTTP)       JSON or msgpack          `validator(type)`: pydantic,
                                                                     once, where it enters
    engine frontend <-> engine core         msgpack frames           msgspec decodes the frames
                                            (microserve/wire.py)     (engine/frames.py) into these
    engine -> router (HTTP answers)         JSON or msgpack          msgspec decodes into these

The messages are plain slotted dataclasses: pydantic validates them where they come from
outside (the constraints in their `Annotated` types, unknown fields and non-finite floats
refused, a 400 naming the field), msgspec encodes and decodes them everywhere else, and code
in between builds and reads them as it would any dataclass, trusting them. The frames of the
socket between an engine's frontend and its core (engine/frames.py) carry them.

The microserving calls (docs/microserving.md) split one request across engines (paper §3.1):

    D.prep_recv(prompt, end)            -> matched, kv_addr   reserve D's slots for [matched, end)
    P.remote_send(prompt, begin, end, kv_addr)               make KV of [begin, end) land there
    D.start_generate(prompt, begin)     -> chunks             KV of [0, begin) is on D already

A remote_send with `sampling` covers the whole prompt (end = len(prompt)) and also samples the
first output token, which it answers with (`first_token`); the router hands that token to
D.start_generate(prompt, begin=len(prompt), first_token), which emits it at once and decodes
on: D runs no step for the last prompt token (SGLang's and vLLM's P/D hand over the same way).

P need not wait for D's answer to start: a remote_send without kv_addr computes at once and
holds the KV; `P.send_to(begin, kv_addr)`, made when D's prep_recv answers, names where
[begin, end) goes (what is computed by then is copied at once, the rest as it is computed),
and the remote_send answers as before. Plus `commit` (adopt received KV without generating: context migration), `abort`, `pin`/`unpin`
and `stats`. `begin`/`end` index the prompt Python-style (negative counts from the end). Checks
that need the prompt length or the engine's state are the engine's.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Annotated, TypeVar

import msgspec
from msgspec import Raw, Struct
from pydantic import ConfigDict, Field, TypeAdapter, with_config

from microserve.bounds import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS,
                               MAX_LOGPROBS, Count, Index, LogitBias, MinTokens, Penalty,
                               RepetitionPenalty, Seed, TokenId)

T = TypeVar("T")

# Where a message enters from outside: unknown fields and Infinity/NaN are refused.
_CHECKED = with_config(ConfigDict(extra="forbid", allow_inf_nan=False))


def validator(message: type[T]) -> TypeAdapter[T]:
    """The pydantic validator of `message` for a body from outside (`.validate_json(raw)`,
    `.validate_python(obj)`); raises pydantic.ValidationError naming the field."""
    return TypeAdapter(message)


RequestId = Annotated[str, Field(min_length=1, max_length=256)]
Prompt = Annotated[list[TokenId], Field(min_length=1)]
Slot = Annotated[int, Field(ge=0, le=INT64_MAX)]  # checked against the receiver's pool
Position = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowIndex = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowTag = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # the window's secret


# -- sampling and output ---------------------------------------------------------------------

@_CHECKED
@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Token-level sampling, from the OpenAI frontend (which resolved OpenAI's defaults) to the
    engine core's sampler, through the router and start_generate unchanged.

    Text-level options (stop strings, echo, chat formatting) are the frontend's, which owns the
    tokenizer; the core sees token ids only. Bounds that need the model (top_k and token ids
    within the vocabulary, max_tokens within the context) are the engine's to check.

    The logit adjustments (vLLM's semantics, applied in this order after a grammar's mask):
    `logit_bias` adds to its tokens' logits; while fewer than `min_tokens` tokens are out,
    the stop token ids (and the eos ids unless ignore_eos) are impossible;
    `repetition_penalty` divides a positive logit (multiplies a negative one) of every token
    seen in the prompt or the output; `frequency_penalty` x its count in the output plus
    `presence_penalty` if it occurs there at all is subtracted.
    """

    max_tokens: Count = 16
    temperature: Annotated[float, Field(ge=0)] = 1.0  # 0 means greedy
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # 0 disables
    seed: Seed | None = None  # per-request generator when set
    stop_token_ids: tuple[TokenId, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # 0: the sampled
    # token's; n: plus the top n
    # The prompt's tokens' logprobs as well (completions' echo with logprobs, what
    # lm-evaluation-harness scores with): 0: each prompt token's; n: plus the top n. The engine
    # computes the whole prompt for them (no prefix cache, no KV from a peer).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # An llguidance grammar (JSON) the output must follow: structured outputs and forced tool
    # calls, built and validated by the frontend (microserve/guided.py); None: unconstrained.
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # 1 disables it
    # (token id, bias) pairs, ids below the vocabulary (the engine checks)
    logit_bias: Annotated[tuple[tuple[TokenId, LogitBias], ...],
                          Field(max_length=MAX_LOGIT_BIAS)] = ()
    min_tokens: MinTokens = 0  # at most max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def stops_on(self, token: int, eos_token_ids: Collection[int]) -> bool:
        """Whether sampling `token` stops the request: one of its stop_token_ids, or one of the
        model's `eos_token_ids` unless ignore_eos. The one rule the engine core, the router and
        min_tokens' mask (engine/penalties.py) ask."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    @property
    def needs_token_counts(self) -> bool:
        """Whether the penalties need the tokens seen so far (engine/penalties.py)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment is set (penalties, logit_bias, min_tokens)."""
        return self.needs_token_counts or bool(self.logit_bias) or self.min_tokens > 0


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives if asked for.

    Logprobs are of the model's raw distribution (log-softmax of the logits, before
    temperature / top-p / top-k), as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


class FinishReason:
    STOP = "stop"  # eos or a stop token id (or, at the frontend, a stop string)
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # aborted by the client or an operator


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was already on this engine (received or cached)


@dataclass(slots=True)
class GenerateChunk:
    """One piece of a generation's output, as every consumer above the engine core sees it: the
    engine's OpenAI frontend and start_generate's stream, a strategy, the router's frontend.

    `token_ids` are new since the previous chunk (usually one). The last chunk has
    finish_reason and usage.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    # The first chunk's: what usage.cached_tokens will say, for a caller that stops reading
    # early (a stop string matched).
    cached_tokens: int | None = None
    # The first chunk's, when SamplingParams.prompt_logprobs asked: one per prompt token, None
    # for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TokenOutput(Struct, array_like=True):
    """What one engine step produced for one request: the core's record, sent to its frontend
    positionally (one frame per step holds every request's), where the core client makes it the
    request's next GenerateChunk. `num_prompt_tokens` and `num_cached_tokens` (prompt tokens
    served from the prefix cache) are set on every output; the last has `finish_reason`."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs, on the request's first output: one per prompt token,
    # None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


# -- KV addresses ------------------------------------------------------------------------------

@_CHECKED
@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must be equal for two engines to exchange KV pages (kvcache/transfer/)."""

    model: str
    dtype: str  # the pool's element type: float32, bfloat16, float8_e4m3fn (--kv-cache-dtype)
    page_size: Annotated[int, Field(ge=1, le=INT32_MAX)]
    num_layers: Annotated[int, Field(ge=1, le=INT32_MAX)]
    num_kv_heads: Annotated[int, Field(ge=1, le=INT32_MAX)]
    head_dim: Annotated[int, Field(ge=1, le=INT32_MAX)]

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def mismatch(self, peer: KVLayout) -> str | None:
        """None if the layouts agree, else a message naming both layouts and what differs."""
        diff = [f.name for f in fields(self) if getattr(self, f.name) != getattr(peer, f.name)]
        if not diff:
            return None
        return (
            f"KV layout mismatch in {', '.join(diff)}: this engine has {self.to_dict()}, "
            f"the peer has {peer.to_dict()}"
        )


# A receiver's transfer descriptor: what a sender needs to open its pool. Its fields are its
# backend's ("kind" always; shm: pid, fd, inode, size, boot id; tcp: host, port; ...: see
# kvcache/transfer/), plain scalars, and the receiver signs them all ("mac",
# microserve/transfer_auth.py): the sender verifies the signature before it reads any field.
TransferDescriptor = dict[str, str | bool | Annotated[int, Field(ge=INT64_MIN, le=2**64 - 1)]
                          | None]


@_CHECKED
@dataclass(frozen=True, slots=True)
class KVAddr:
    """Where a receiver wants KV written: run-length ranges of its flat slots
    (slot = page * page_size + offset) covering prompt positions [begin, end) in order,
    its KV layout, its transfer descriptor, and the write window the slots belong to.

        positions:  begin ............................................ end
        ranges:     [(s0, n0),              (s1, n1),        (s2, n2)]   n0 + n1 + n2 = end - begin

    The receiver signs it whole (`mac`, over `grant()`): a sender writes only where, and only
    the KV of the tokens (`digest`, microserve/transfer_auth.kv_digest), that the receiver
    reserved. A kv_addr is passed on as it came, never edited.
    """

    begin: Position
    end: Position
    ranges: list[tuple[Slot, Count]]
    layout: KVLayout
    transfer: TransferDescriptor
    window: tuple[WindowIndex, WindowTag]
    digest: Annotated[str, Field(max_length=128)] = ""  # hex kv_digest(prompt[:end], begin)
    mac: Annotated[str, Field(max_length=128)] = ""  # the receiver's signature over grant()

    @property
    def num_slots(self) -> int:
        return sum(n for _, n in self.ranges)

    def grant(self) -> dict:
        """What `mac` signs: every field but itself (the descriptor by its own signature)."""
        return {"begin": self.begin, "end": self.end,
                "ranges": self.ranges,
                "layout": self.layout.to_dict(), "transfer": self.transfer.get("mac"),
                "window": list(self.window), "digest": self.digest}


# -- the microserving calls' bodies and answers -------------------------------------------------

@_CHECKED
@dataclass(slots=True)
class PrepRecvRequest:
    request_id: RequestId
    prompt: Prompt
    end: Index = -1
    # default --kv-lease-s; at most --kv-lease-max-s
    lease_s: Annotated[float, Field(gt=0)] | None = None
    # How long to wait for pages if none are free: default --kv-recv-wait-s; 0 answers a 503 at
    # once; at most --kv-recv-wait-max-s.
    wait_s: Annotated[float, Field(ge=0)] | None = None


@dataclass(slots=True)
class PrepRecvResponse:
    matched: int  # prompt tokens already in this engine's prefix cache (a page multiple)
    kv_addr: KVAddr


@_CHECKED
@dataclass(slots=True)
class RemoteSendRequest:
    request_id: RequestId
    prompt: Prompt
    begin: Index = 0
    end: Index = -1
    # Where the KV goes. None: not known yet (the receiver's prep_recv runs meanwhile); the
    # engine computes prompt[:end] now and holds it until a send_to names begin and kv_addr.
    kv_addr: KVAddr | None = None
    # Sample the first output token after the prompt with these (end must be the prompt's
    # length; no logprobs, no grammar) and answer it as first_token. None: sample nothing.
    sampling: SamplingParams | None = None
    # How long the call may wait in this engine's queue (from its frontend taking it) before a
    # step computes it, or the core takes it up if its KV is all cached: past it a 503 with
    # code queue_timeout, nothing held. None: as long as it takes.
    queue_s: Annotated[float, Field(gt=0, le=3600)] | None = None


@dataclass(slots=True)
class SendTiming:
    """Where a remote_send's time went on the sender (router/handover.py adds the hops)."""

    queued_s: float  # from the frontend taking the call to the first step computing it
    prefill_s: float  # from that step to the last one's outputs (0 if all was cached)
    tail_s: float  # from then to the answer: the writes flushed (and send_to, if late)


@dataclass(slots=True)
class RemoteSendResponse:
    sent: int  # tokens whose KV now sits in the receiver's slots (= end - begin)
    computed: int  # tokens this engine prefilled to produce them (may start before begin)
    reused: int  # tokens of [begin, end) copied from this engine's prefix cache
    first_token: int | None = None  # sampled when the call carried `sampling`
    timing: SendTiming | None = field(default=None, compare=False)  # measured, not an outcome


@_CHECKED
@dataclass(slots=True)
class SendToRequest:
    """Where a remote_send made without kv_addr sends prompt[begin:end] (its receiver's
    prep_recv answer: begin = matched)."""

    request_id: RequestId
    begin: Position
    kv_addr: KVAddr


@dataclass(slots=True)
class SendToResponse:
    copied: int  # tokens of [begin, end) whose KV was here already, queued for writing at once


@_CHECKED
@dataclass(slots=True)
class StartGenerateRequest:
    request_id: RequestId
    prompt: Prompt
    begin: Index = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    # The first output token, sampled by the engine that sent the whole prompt's KV (its
    # remote_send with `sampling`); begin must be the prompt's length. Emitted as is, first.
    first_token: TokenId | None = None
    # How long the request may wait in this engine's queue (from its frontend taking the
    # call) before a step starts on it: past it a 503 with code queue_timeout, nothing held.
    # None: as long as it takes.
    queue_s: Annotated[float, Field(gt=0, le=3600)] | None = None


@_CHECKED
@dataclass(slots=True)
class CommitRequest:
    request_id: RequestId
    pin: bool = False


@dataclass(slots=True)
class CommitResponse:
    cached: int  # leading tokens of the received context now in the prefix cache (page multiple)
    pinned: bool


@_CHECKED
@dataclass(slots=True)
class AbortRequest:
    request_id: RequestId


@dataclass(slots=True)
class AbortResponse:
    aborted: bool  # False: the engine held nothing under this request_id


@_CHECKED
@dataclass(slots=True)
class PinRequest:
    prompt: Prompt


@_CHECKED
@dataclass(slots=True)
class UnpinRequest(PinRequest):
    pass


@dataclass(slots=True)
class PinResponse:
    tokens: int  # leading tokens of the prompt (a page multiple) now pinned / unpinned


@dataclass(slots=True)
class StatsRequest:
    """The core's load and KV accounting (its half of GET /microserving/stats)."""


@dataclass(slots=True)
class CheckIntegrityRequest:
    """Run the core's KV integrity check (GET /microserving/stats?check=1)."""


# -- what an engine is and how loaded --------------------------------------------------------------

@dataclass(slots=True)
class EngineInfo:
    """Facts the engine core reports once it has loaded the model and sized the KV pool."""

    model_name: str
    model_dir: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    page_size: int
    num_pages: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_transfer: str  # how this engine receives KV: shm, tcp, cuda_ipc, nvshmem or none
    quantization: str | None = None  # fp8: the projections' weights (dtype is the activations')
    kv_cache_dtype: str | None = None  # the KV pool's element type, e.g. float8_e4m3fn
    deployment: str | None = None  # set by the engine frontend: the deployment it belongs to


@dataclass(slots=True)
class Liveness:
    """GET /microserving/live: whether the engine is alive and its core making progress. The
    frontend answers it from its event loop at once, never waiting for the core, and without
    the engine key (the router sends the key to no engine that has not proved it holds it)."""

    core_silent_s: float  # since the core's last heartbeat (it sends them in a step too)
    steps: int  # steps the core had begun at that heartbeat
    in_step_s: float  # how long the step it was in had run then (0: between steps)
    # auth.engine_proof(the engine key, the query's challenge); None without either
    proof: str | None = None


@dataclass(slots=True)
class EngineStats:
    """Load and KV accounting (GET /microserving/stats "stats"; Prometheus on /metrics)."""

    running: int  # requests running
    waiting: int  # requests waiting for admission
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int  # held only by the prefix cache (reusable)
    kv_pages_used: int  # held by running requests
    kv_pages_pinned: int
    preemptions: int
    prompt_tokens: int  # of finished requests
    cached_prompt_tokens: int  # served from the prefix cache
    generation_tokens: int
    kv_reservations: int  # prep_recv reservations waiting for KV or a start_generate
    kv_recv_waiting: int  # prep_recv calls waiting for KV pages
    kv_send_jobs: int  # remote_send calls in progress
    kv_leases_expired: int
    kv_tokens_sent: int
    kv_tokens_received: int
    kv_recv_waited: int  # prep_recv calls that had to wait for pages
    kv_recv_wait_timeouts: int  # ... and waited their wait_s in vain (503)
    kv_send_queue_timeouts: int = 0  # remote_send calls not started within their queue_s (503)
    generate_queue_timeouts: int = 0  # start_generate calls not started within their queue_s
    # The core's steps and where its time went (engine/loop_stats.py)
    steps: int = 0
    prompt_tokens_computed: int = 0  # through the forward pass (cached ones not)
    tokens_sampled: int = 0
    step_seconds: float = 0.0  # scheduling, launching, waiting for the GPU's last step
    device_wait_seconds: float = 0.0  # of step_seconds: waiting for the sampled tokens
    send_seconds: float = 0.0  # writing outputs to the frontend
    message_seconds: float = 0.0  # handling the frontend's requests and calls
    idle_seconds: float = 0.0  # waiting with nothing to run


class StatsResponse(Struct, omit_defaults=True):
    """GET /microserving/stats: the core's load, the engine's facts, and with `?check=1` the
    integrity check's verdict ("ok", or what is wrong)."""

    stats: EngineStats
    info: EngineInfo
    integrity: str | None = None


class ErrorDetail(Struct):
    """OpenAI's error object (microserve/errors.py)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class StreamError(Struct):
    """The last item of a start_generate stream that failed after its status line went out:
    the status and error the call would have been answered with."""

    status: int
    error: ErrorDetail


# -- the microserving calls, each declared once ------------------------------------------------

@dataclass(frozen=True, slots=True)
class Call:
    """One request/answer call, declared once; the rest follows from the declaration: the
    engine frontend's route POST /microserving/{name} (engine/frontend/microserving_api.py),
    the frames to the core and its handler `on_{name}` (engine/core/handlers.py), and the router's
    one generic `EngineClient.call(request)` (microserve/microserving_client.py), which
    decodes the answer once, into `answer`.

    `timeout_s` bounds the wait for the answer (None: as long as the engine works: a prefill, a
    transfer); `waits` names the request's field that lets the call wait longer on purpose
    (prep_recv's wait for pages: the engine bounds it). `route` False: between an engine's
    frontend and its core only."""

    name: str
    request: type
    answer: type
    timeout_s: float | None = 30.0
    waits: str | None = None
    route: bool = True
    _decoders: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_decoders", (msgspec.msgpack.Decoder(self.request),
                                               msgspec.msgpack.Decoder(self.answer)))

    def decode_request(self, raw: bytes | Raw):
        return self._decoders[0].decode(raw)

    def decode_answer(self, raw: bytes | Raw):
        return self._decoders[1].decode(raw)


CALLS: dict[str, Call] = {c.name: c for c in (
    Call("prep_recv", PrepRecvRequest, PrepRecvResponse, waits="wait_s"),
    Call("remote_send", RemoteSendRequest, RemoteSendResponse, timeout_s=None),
    Call("send_to", SendToRequest, SendToResponse),
    Call("commit", CommitRequest, CommitResponse),
    Call("abort", AbortRequest, AbortResponse),  # the one abort, from anywhere
    Call("pin", PinRequest, PinResponse),
    Call("unpin", UnpinRequest, PinResponse),
    Call("stats", StatsRequest, EngineStats, route=False),
    Call("check_integrity", CheckIntegrityRequest, bool, route=False),  # failed: an error
)}
_CALL_OF = {c.request: c for c in CALLS.values()}


def call_of(request) -> Call:
    """The declaration of the call whose request `request` is."""
    return _CALL_OF[type(request)]
