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

The vocabulary is one package, a module per concern, every name importable from here:

    fields.py     the field types the messages share; `validator`, the check where one enters
    sampling.py   `SamplingParams`; what a generation answers (`GenerateChunk`, `TokenOutput`)
    kv.py         `KVLayout`, `KVAddr`: where KV goes
    calls.py      the calls' bodies and answers, and `CALLS`: each call declared once
    status.py     `EngineInfo`, `Liveness`, `EngineStats`, `StatsResponse`; `StreamError`,
                  `ChannelItem`
"""

from __future__ import annotations

from microserve.messages.fields import (CHECKED, validator, RequestId, ChannelId, Prompt, Slot,
                                        Position, WindowIndex, WindowTag)
from microserve.messages.sampling import (SamplingParams, TokenLogprob, FinishReason, Usage,
                                          GenerateChunk, TokenOutput)
from microserve.messages.kv import KVLayout, TransferDescriptor, KVAddr
from microserve.messages.status import (EngineInfo, Liveness, EngineStats, StatsResponse,
                                        ErrorDetail, StreamError, ChannelItem)
from microserve.messages.calls import (PrepRecvRequest, PrepRecvResponse, RemoteSendRequest,
                                       SendTiming, RemoteSendResponse, SendToRequest,
                                       SendToResponse, StartGenerateRequest, CommitRequest,
                                       CommitResponse, AbortRequest, AbortResponse, PinRequest,
                                       UnpinRequest, PinResponse, StatsRequest,
                                       CheckIntegrityRequest, LoadLoraRequest, LoadLoraResponse,
                                       UnloadLoraRequest, UnloadLoraResponse, Call, CALLS,
                                       call_of)

__all__ = [
    "CHECKED", "validator", "RequestId", "ChannelId", "Prompt", "Slot", "Position",
    "WindowIndex", "WindowTag",
    "SamplingParams", "TokenLogprob", "FinishReason", "Usage", "GenerateChunk", "TokenOutput",
    "KVLayout", "TransferDescriptor", "KVAddr", "EngineInfo", "Liveness", "EngineStats",
    "StatsResponse", "ErrorDetail", "StreamError", "ChannelItem",
    "PrepRecvRequest", "PrepRecvResponse",
    "RemoteSendRequest", "SendTiming", "RemoteSendResponse", "SendToRequest", "SendToResponse",
    "StartGenerateRequest", "CommitRequest", "CommitResponse", "AbortRequest", "AbortResponse",
    "PinRequest", "UnpinRequest", "PinResponse", "StatsRequest", "CheckIntegrityRequest",
    "LoadLoraRequest", "LoadLoraResponse", "UnloadLoraRequest", "UnloadLoraResponse", "Call",
    "CALLS", "call_of"
]
