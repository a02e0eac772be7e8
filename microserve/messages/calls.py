"""The microserving calls' bodies and answers, and each call declared once (`CALLS`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from msgspec import Raw
from pydantic import Field

from microserve.bounds import Index, Priority, TokenId
from microserve.messages.fields import CHECKED, ChannelId, Position, Prompt, RequestId
from microserve.messages.kv import KVAddr
from microserve.messages.sampling import SamplingParams
from microserve.messages.status import EngineStats

LoraName = Annotated[str, Field(min_length=1, max_length=256)]


@CHECKED
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
    # The LoRA adapter the KV is computed with (docs/lora.md): the pages are reserved, and
    # matched, in that adapter's part of the prefix cache; start_generate must name the same
    # adapter. None: the base model.
    lora_name: LoraName | None = None
    # BlockLLM's split migration: positions [matched, own) this engine will hold by itself by
    # start_generate or commit (the caller has it compute prompt[:own] meanwhile, as a request
    # of its own), so the sender writes only [own, end). A multiple of the page size. None: 0.
    own: Position | None = None


@dataclass(slots=True)
class PrepRecvResponse:
    matched: int  # prompt tokens already in this engine's prefix cache (a page multiple)
    kv_addr: KVAddr


@CHECKED
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
    # Its scheduling priority on this engine (--scheduling-policy priority: lower runs first)
    priority: Priority = 0
    # The LoRA adapter to compute the KV with (and reuse cached KV of); None: the base model.
    # With `sampling`, its lora_name must be the same.
    lora_name: LoraName | None = None


@dataclass(slots=True)
class SendTiming:
    """Where a remote_send's time went on the sender (router/handover.py adds the hops)."""

    queued_s: float  # from the frontend taking the call to the first step computing it
    prefill_s: float  # from that step to the last one's outputs (0 if all was cached)
    tail_s: float  # from then to the answer: the writes flushed (and send_to, if late)
    # within prefill_s: from the first step computing it to the launch of the step with its last
    # chunk (its chunks' span); the rest of prefill_s is that step's run and the read-back of
    # its outputs. None from an engine that does not report it.
    chunks_s: float | None = None


@dataclass(slots=True)
class RemoteSendResponse:
    sent: int  # tokens whose KV now sits in the receiver's slots (= end - begin)
    computed: int  # tokens this engine prefilled to produce them (may start before begin)
    reused: int  # tokens of [begin, end) copied from this engine's prefix cache
    first_token: int | None = None  # sampled when the call carried `sampling`
    timing: SendTiming | None = field(default=None, compare=False)  # measured, not an outcome


@CHECKED
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


@CHECKED
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
    # The caller has already given first_token to its client (the router does, one round trip
    # sooner): the stream leaves it out and begins with the next token. It still counts, in
    # the usage and against max_tokens; a request it ends answers one chunk of no tokens with
    # finish_reason and usage. Needs first_token.
    first_token_delivered: bool = False
    # How long the request may wait in this engine's queue (from its frontend taking the
    # call) before a step starts on it: past it a 503 with code queue_timeout, nothing held.
    # None: as long as it takes.
    queue_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    # Its scheduling priority on this engine (--scheduling-policy priority: lower runs first)
    priority: Priority = 0
    # The id of a channel the caller holds open (GET /microserving/channel/{id}): a streamed
    # call then answers its first chunk alone, as its body, and every later chunk goes out on
    # the channel, beside those of the caller's other requests (ChannelItem). None: the answer
    # is the stream of all its chunks.
    channel: ChannelId | None = None


@CHECKED
@dataclass(slots=True)
class CommitRequest:
    request_id: RequestId
    pin: bool = False


@dataclass(slots=True)
class CommitResponse:
    cached: int  # leading tokens of the received context now in the prefix cache (page multiple)
    pinned: bool


@CHECKED
@dataclass(slots=True)
class AbortRequest:
    request_id: RequestId
    # The abort is for a remote_send without kv_addr that may still be on its way here (it can
    # overtake it: they travel on two connections). If the engine has nothing under
    # request_id, it keeps the id for that send alone and refuses it (409) when it comes, so
    # the answer is final: no second abort is needed. Kept for --kv-lease-s at most, or until
    # the next remote_send of the id (only one without kv_addr is refused).
    early_send: bool = False


@dataclass(slots=True)
class AbortResponse:
    # False: the engine held nothing under this request_id (with early_send: nor will it)
    aborted: bool


@CHECKED
@dataclass(slots=True)
class PinRequest:
    prompt: Prompt


@CHECKED
@dataclass(slots=True)
class UnpinRequest(PinRequest):
    pass


@dataclass(slots=True)
class PinResponse:
    tokens: int  # leading tokens of the prompt (a page multiple) now pinned / unpinned


@CHECKED
@dataclass(slots=True)
class LoadLoraRequest:
    """Register a PEFT LoRA adapter under `lora_name` (vLLM's /v1/load_lora_adapter body)."""

    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]  # inside --lora-dir


@dataclass(slots=True)
class LoadLoraResponse:
    lora_name: str
    rank: int
    resident: bool  # put in a slot now (else on its first request)
    load_s: float  # reading and checking it from disk, and the slot copy if resident


@CHECKED
@dataclass(slots=True)
class UnloadLoraRequest:
    lora_name: LoraName


@dataclass(slots=True)
class UnloadLoraResponse:
    lora_name: str
    # requests of it were still in the engine: new ones are refused now, and it goes (its
    # slot freed) with the last of them
    pending: bool


@dataclass(slots=True)
class StatsRequest:
    """The core's load and KV accounting (its half of GET /microserving/stats)."""


@dataclass(slots=True)
class CheckIntegrityRequest:
    """Run the core's KV integrity check (GET /microserving/stats?check=1)."""


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
    Call("load_lora_adapter", LoadLoraRequest, LoadLoraResponse, timeout_s=300.0),
    Call("unload_lora_adapter", UnloadLoraRequest, UnloadLoraResponse),
    Call("stats", StatsRequest, EngineStats, route=False),
    Call("check_integrity", CheckIntegrityRequest, bool, route=False),  # failed: an error
)}
_CALL_OF = {c.request: c for c in CALLS.values()}


def call_of(request) -> Call:
    """The declaration of the call whose request `request` is."""
    return _CALL_OF[type(request)]
