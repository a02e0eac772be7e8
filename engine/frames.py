"""The frames of the socket between an engine's frontend and its core process (engine/frontend/,
engine/core_proc.py), over microserve/wire.py. No torch.

Msgspec structs tagged by "type", so a decoded frame is already the typed message to dispatch
on. A call (microserve.messages.CALLS) travels as an Invoke holding its request, encoded once,
and comes back as a Reply holding its answer, encoded once (or a CallFailed): each side decodes
them into the call's declared types.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw, Struct

from microserve.messages import EngineInfo, SamplingParams, TokenOutput, call_of

_encoder = msgspec.msgpack.Encoder()


class Frame(Struct, tag_field="type", frozen=True):
    """One message on the frontend <-> core socket."""


# frontend -> core
class Generate(Frame, tag="generate"):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    begin: int = 0
    first_token: int | None = None
    queue_s: float | None = None  # StartGenerateRequest's
    priority: int = 0  # StartGenerateRequest's
    received_at: float = 0.0  # time.perf_counter() when the frontend took it; 0: unknown
    first_token_delivered: bool = False  # StartGenerateRequest's


class Invoke(Frame, tag="call"):
    """A call (`CALLS[method]`), answered by a Reply or a CallFailed with the same `id`."""

    id: int
    method: str
    request: Raw  # the call's request, encoded: the core decodes it into its type
    # time.perf_counter() when the engine's frontend took the HTTP call (the core runs on the
    # same host, on the same clock): a remote_send's queue time starts there, so it includes
    # the wait for the core to finish the step it is in. 0: when the core took it.
    received_at: float = 0.0


def invoke(call_id: int, request, received_at: float = 0.0) -> Invoke:
    return Invoke(call_id, call_of(request).name, Raw(_encoder.encode(request)), received_at)


class Shutdown(Frame, tag="shutdown"):
    pass


ToCore = Generate | Invoke | Shutdown


# core -> frontend
class Ready(Frame, tag="ready"):
    info: EngineInfo


class StartFailed(Frame, tag="error"):
    message: str


class Outputs(Frame, tag="outputs"):
    items: list[TokenOutput]  # one step's, every request's


class Rejected(Frame, tag="rejected"):
    """A Generate the core refused, or failed: the status the request answers with."""

    request_id: str
    message: str
    param: str | None
    status: int
    code: str | None = None


class Heartbeat(Frame, tag="heartbeat"):
    """The core process is alive: sent by a thread of its own every few tenths of a second,
    during a long step too (a long step is progress; a core that stopped sending is not)."""

    steps: int  # steps begun so far (the one in progress counts)
    in_step_s: float  # how long the step in progress has run (0: between steps)


class Reply(Frame, tag="reply"):
    """The answer to Invoke `id`, encoded: `CALLS[method].decode_answer(result)`."""

    id: int
    result: Raw


class CallFailed(Frame, tag="failed"):
    """Invoke `id` failed: the status (and param, code) its HTTP call answers with."""

    id: int
    error: str
    status: int = 500
    param: str | None = None
    code: str | None = None


FromCore = Ready | StartFailed | Outputs | Rejected | Reply | CallFailed | Heartbeat
