"""The engine's microserving API (docs/microserving.md): HTTP routes over its engine-core client.

    add_microserving_routes(app, client, api_key=key)

    POST /microserving/{prep_recv, remote_send, send_to, start_generate, commit, abort, pin,
                        unpin}
    GET  /microserving/channel/{id}        a stream of ChannelItems: the chunks after the first
                                           of every start_generate sent with `channel: id`
    GET  /microserving/stats[?check=1]
    GET  /microserving/live[?challenge=HEX]   no key needed: alive? core progressing? (Liveness)

Bodies are JSON, or msgpack with `Content-Type: application/msgpack` (token lists are the bulk);
the answer comes in kind, or as msgpack whenever `Accept` names it. Errors are always OpenAI
error JSON with the engine's status (microserve.backend.MicroservingError says which).

Bodies are validated once, here (microserve.messages.validator: a 400 naming the field), and
handed to the engine core as the typed messages they are. start_generate streams one
GenerateChunk per engine output, each sent as soon as it exists:

    JSON     application/x-ndjson   one JSON object per line
    msgpack  application/msgpack    length-prefixed msgpack frames (microserve.wire)

The last chunk has finish_reason and usage. With `channel`, the call answers its first chunk
alone, and the rest go out on that channel with every other request's bound to it, the items of
one read of the core's outputs in one write (_Channel); closing the channel aborts its requests.
A failure after the status line went out ends the stream with a StreamError (`{"status": s,
"error": {...}}`) instead: the status and error JSON the call would have been answered with.
Each call's route follows from its declaration (microserve.messages.CALLS). A client that goes
away before a call carrying a request_id finished (start_generate mid-stream included) gets that
request aborted in the engine.

/microserving/live is the router's liveness probe: answered from this process's event loop
without waiting for the core (a core in a minute-long step is busy, not dead), with how long
the core has been silent (its heartbeats, engine/core_proc.py) and, for a `challenge`, the
proof that this engine holds the engine key (microserve/auth.py: the router sends the key to
no engine before it has checked that proof). It needs no key, and tells nothing but that.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgpack
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import TypeAdapter, ValidationError

from microserve import wire
from microserve.auth import MAX_CHALLENGE_CHARS, OPEN_PATHS, RequireBearer, engine_proof
from microserve.backend import BackendUnavailable, MicroservingError
from microserve.client_streams import ClientDisconnected, EventStream, unless_disconnected
from microserve.errors import as_openai_error, from_validation_errors, invalid_request
from microserve.messages import (
    CALLS,
    Call,
    ChannelItem,
    CheckIntegrityRequest,
    ErrorDetail,
    GenerateChunk,
    StartGenerateRequest,
    StatsRequest,
    StatsResponse,
    StreamError,
    validator,
)
from microserve.messages.fields import CHANNEL_ID

log = logging.getLogger("microserve.engine")
BodyT = TypeVar("BodyT")

MSGPACK = "application/msgpack"


# -- body formats ------------------------------------------------------------------------------

def _json(obj: Any) -> bytes:
    # The standard library's, not msgspec's: a logprob of -inf stays -Infinity, as before.
    return json.dumps(msgspec.to_builtins(obj), separators=(",", ":")).encode()


_msgpack = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class _Codec:
    """How one call's answer is encoded: a whole body, or the items of a stream."""

    media_type: str
    stream_media_type: str
    body: Callable[[Any], bytes]
    item: Callable[[Any], bytes]


_JSON = _Codec("application/json", "application/x-ndjson", _json, lambda obj: _json(obj) + b"\n")
_MSGPACK = _Codec(MSGPACK, MSGPACK, _msgpack.encode, wire.encode)


def _is_msgpack(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == MSGPACK


def _answer_codec(request: Request) -> _Codec:
    """msgpack for a msgpack body or an `Accept` that names it; JSON otherwise."""
    if _is_msgpack(request.headers.get("content-type", "")):
        return _MSGPACK
    return _MSGPACK if MSGPACK in request.headers.get("accept", "") else _JSON


def _answer(codec: _Codec, obj: Any) -> Response:
    return Response(codec.body(obj), media_type=codec.media_type)


async def _read_body(request: Request, body: TypeAdapter[BodyT]) -> BodyT:
    """The body validated by `body`; a 400 naming the field (or the malformed byte) if not."""
    raw = await request.body()
    try:
        if _is_msgpack(request.headers.get("content-type", "")):
            return body.validate_python(_unpack(raw))
        return body.validate_json(raw)
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None


def _unpack(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False)
    except ValueError as e:  # every msgpack unpacking error is one
        raise invalid_request(f"Malformed msgpack body: {str(e) or type(e).__name__}") from None


# -- routes ------------------------------------------------------------------------------------

async def _merged(chunks: AsyncGenerator[GenerateChunk, None], logprobs: bool) -> GenerateChunk:
    """All of a request's chunks as one (stream=false)."""
    token_ids, token_logprobs, prompt_logprobs = [], [], None
    async for last in chunks:
        token_ids += last.token_ids
        token_logprobs += last.logprobs or []
        prompt_logprobs = prompt_logprobs or last.prompt_logprobs
    return GenerateChunk(token_ids, token_logprobs if logprobs else None, last.finish_reason,
                         last.usage, prompt_logprobs=prompt_logprobs)


class _MicroservingAPI:
    """The route handlers. A client that goes away before its answer gets the request_id it
    named aborted: a reservation, a running prefill or transfer, or a generation."""

    def __init__(self, client, api_key: str | None = None):
        self.client = client  # a CoreClient (core_client.py), or anything with its contract
        self._api_key = api_key  # what liveness proves this engine holds
        self._start_generate = validator(StartGenerateRequest)
        self._channels: dict[str, _Channel] = {}  # open channels by id

    def call_route(self, call: Call) -> Callable:
        """The handler of POST /microserving/{call.name}: validates `call.request` and hands it
        to the core; a call that waits on purpose (`call.waits`) is bounded by the core."""
        body_type = validator(call.request)
        timeout_s = None if call.waits else call.timeout_s

        async def route(request: Request) -> Response:
            received_at = time.perf_counter()
            body = await _read_body(request, body_type)
            work = self.client.call(body, timeout_s=timeout_s, received_at=received_at)
            try:
                result = await unless_disconnected(request.receive, work)
            except ClientDisconnected:
                if request_id := getattr(body, "request_id", None):
                    await self.client.abort(request_id)
                return Response(status_code=499)  # nginx's "client closed request"
            return _answer(_answer_codec(request), result)

        return route

    async def start_generate(self, request: Request) -> Response:
        received_at = time.perf_counter()
        body = await _read_body(request, self._start_generate)
        codec = _answer_codec(request)
        # Closed before its finishing chunk, the core client's stream aborts the request.
        channel = None
        if body.channel is not None and body.stream:
            channel = self._channels.get(body.channel)
            if channel is None:
                raise MicroservingError(409, f"channel {body.channel!r} is not open here",
                                        "channel", "channel_not_open")
        chunks = self.client.start_generate(body.request_id, body.prompt, body.begin,
                                            body.sampling, body.first_token, body.queue_s,
                                            received_at, body.priority,
                                            first_token_delivered=body.first_token_delivered)
        # Streaming, the first chunk comes before the status line: a call the engine refuses
        # still gets its status rather than an error item inside a 200.
        work = anext(chunks) if body.stream else _merged(chunks, body.sampling.logprobs is not None)
        try:
            chunk = await unless_disconnected(request.receive, work)
        except ClientDisconnected:
            return Response(status_code=499)
        if not body.stream:
            return _answer(codec, chunk)
        if channel is None:
            return EventStream(self._stream(body.request_id, codec, chunk, chunks),
                               media_type=codec.stream_media_type)
        if chunk.finish_reason is not None:  # nothing follows (the iterator has returned)
            return _answer(codec, chunk)
        if channel.closed:  # gone while the first chunk came: so is its reader
            await chunks.aclose()  # aborts the request
            raise MicroservingError(409, f"channel {body.channel!r} closed", "channel",
                                    "channel_not_open")
        channel.pump(body.request_id, chunks)
        return _answer(codec, chunk)

    async def channel(self, request: Request) -> Response:
        """GET /microserving/channel/{channel_id}: a stream of ChannelItems, the chunks after
        the first of every start_generate bound to it, each read of the core's outputs
        written at once. Closing it aborts the requests whose chunks it was carrying."""
        channel_id = request.path_params["channel_id"]
        if not re.fullmatch(CHANNEL_ID, channel_id):
            raise invalid_request("channel_id must be 1 to 64 letters, digits, '-' or '_'",
                                  "channel_id")
        if channel_id in self._channels:
            raise MicroservingError(409, f"channel {channel_id!r} is open already",
                                    "channel_id")
        channel = self._channels[channel_id] = _Channel()
        codec = _answer_codec(request)

        async def items() -> AsyncGenerator[bytes, None]:
            try:
                while True:
                    batch = await channel.next_items()
                    yield b"".join(codec.item(item) for item in batch)
            finally:
                del self._channels[channel_id]
                await channel.close()

        return EventStream(items(), media_type=codec.stream_media_type)

    @staticmethod
    async def _stream(request_id: str, codec: _Codec, first: GenerateChunk,
                      chunks: AsyncGenerator[GenerateChunk, None]) -> AsyncGenerator[bytes, None]:
        try:
            yield codec.item(first)
            async for chunk in chunks:
                yield codec.item(chunk)
        except Exception as e:  # the status line is gone: the error becomes the last item
            if not isinstance(e, (MicroservingError, BackendUnavailable)):
                log.exception("start_generate %s failed while streaming", request_id)
            error = as_openai_error(e)
            yield codec.item(StreamError(error.status_code, ErrorDetail(
                error.message, error.type, error.param, error.code)))
        finally:
            await chunks.aclose()

    async def live(self, request: Request) -> Response:
        """Liveness, with the proof of the engine key for a `challenge` (hex, at most 128
        characters); 503 once the core has exited."""
        challenge = request.query_params.get("challenge")
        if challenge is not None and not (
                0 < len(challenge) <= MAX_CHALLENGE_CHARS and _is_hex(challenge)):
            raise invalid_request(f"challenge must be 1 to {MAX_CHALLENGE_CHARS} hex digits",
                                  "challenge")
        if not await self.client.healthy():
            raise MicroservingError(503, "the engine core has exited")
        live = self.client.liveness()
        if challenge is not None and self._api_key is not None:
            live = replace(live, proof=engine_proof(self._api_key, challenge))
        return _answer(_answer_codec(request), live)

    async def stats(self, request: Request) -> Response:
        """Load and KV accounting; `?check=1` also runs the KV integrity check."""
        body = StatsResponse(await self.client.call(StatsRequest()), self.client.info)
        if request.query_params.get("check"):
            try:
                await self.client.call(CheckIntegrityRequest())
                body.integrity = "ok"
            except RuntimeError as e:
                body.integrity = str(e)
        return _answer(_answer_codec(request), body)


class _Channel:
    """One caller's channel: the chunks of its requests (after each one's first), gathered into
    one queue by a task per request, and taken out together by the channel's stream."""

    MAX_ITEMS = 4096  # in one write

    def __init__(self):
        self.items: asyncio.Queue[ChannelItem] = asyncio.Queue()
        self.pumps: set[asyncio.Task] = set()
        self.closed = False

    def pump(self, request_id: str, chunks: AsyncGenerator[GenerateChunk, None]) -> None:
        """Carry `chunks` (a request's, past its first) until they end; the stream's error,
        if it fails, as its last item."""
        task = asyncio.get_running_loop().create_task(self._pump(request_id, chunks))
        self.pumps.add(task)
        task.add_done_callback(self.pumps.discard)

    async def _pump(self, request_id: str, chunks: AsyncGenerator[GenerateChunk, None]) -> None:
        try:
            async for chunk in chunks:
                self.items.put_nowait(ChannelItem(request_id, chunk=chunk))
        except Exception as e:
            if not isinstance(e, (MicroservingError, BackendUnavailable)):
                log.exception("start_generate %s failed on its channel", request_id)
            error = as_openai_error(e)
            self.items.put_nowait(ChannelItem(request_id, error=StreamError(
                error.status_code, ErrorDetail(error.message, error.type, error.param,
                                               error.code))))
        finally:
            await chunks.aclose()  # unfinished (cancelled: the channel closed): aborted

    async def next_items(self) -> list[ChannelItem]:
        """The items waiting, at least one (waits for it)."""
        batch = [await self.items.get()]
        while not self.items.empty() and len(batch) < self.MAX_ITEMS:
            batch.append(self.items.get_nowait())
        return batch

    async def close(self) -> None:
        """The caller went away: its requests are aborted (their pumps cancelled)."""
        self.closed = True
        pumps = list(self.pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def add_microserving_routes(app: FastAPI, client, *, api_key: str | None = None) -> None:
    """Serve the microserving API on `app` over the engine-core client `client`.

    Args:
        app: the engine's app (build_openai_app's, whose error handlers answer OpenAI JSON);
            gets the /microserving/* routes and a MicroservingError handler.
        client: the CoreClient contract: `call(request, timeout_s, received_at)`,
            `start_generate` (its request aborted when closed unfinished), `abort`,
            `info`, `healthy()` and `liveness()`.
        api_key: when set, every route of `app` but /health, /metrics and /microserving/live
            (so /v1/* and the other /microserving/* among them) answers 401 without
            `Authorization: Bearer <api_key>`; liveness proves this engine holds it.
    """
    if api_key == "":
        raise ValueError("api_key must not be empty (None serves without authentication)")
    api = _MicroservingAPI(client, api_key)
    for call in CALLS.values():
        if call.route:
            app.add_api_route(f"/microserving/{call.name}", api.call_route(call),
                              methods=["POST"], name=call.name)
    for name in ("load_lora_adapter", "unload_lora_adapter"):  # vLLM's paths for them too
        app.add_api_route(f"/v1/{name}", api.call_route(CALLS[name]), methods=["POST"])
    app.add_api_route("/microserving/start_generate", api.start_generate, methods=["POST"])
    app.add_api_route("/microserving/channel/{channel_id}", api.channel, methods=["GET"])
    app.add_api_route("/microserving/stats", api.stats, methods=["GET"])
    app.add_api_route("/microserving/live", api.live, methods=["GET"])
    if api_key is not None:
        app.add_middleware(RequireBearer, guards=[("/", api_key)],
                           open_paths=(*OPEN_PATHS, "/microserving/live"))
