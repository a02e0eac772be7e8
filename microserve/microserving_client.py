"""The router's handle on one engine's microserving API (docs/microserving.md), over pooled HTTP.

    engine = EngineClient("http://10.0.0.7:8000", api_key=key)
    recv = await engine.call(PrepRecvRequest(request_id, prompt, end=-1))
    await prefill_engine.call(RemoteSendRequest(request_id, prompt, recv.matched, -1,
                                                recv.kv_addr))
    async for chunk in engine.start_generate(request_id, prompt, begin=len(prompt) - 1):
        ...

`call` makes any call declared in microserve.messages.CALLS: its route, its answer's type and
whether its answer is bounded in time follow from the request's type. Bodies go as msgpack by
default (token lists are the bulk), JSON with `use_msgpack=False`: the typed messages of
microserve/messages/, encoded by msgspec, and every answer, chunk and stream error decoded
once, into its type (the engine validates what it is sent; the router trusts its engines'
answers, which msgspec still checks for shape as it decodes them).
Failures: an answer with an error status raises MicroservingError(status, message, param) from
the engine's OpenAI error JSON; an engine that cannot be reached or drops the connection
raises BackendUnavailable naming its URL, one that does not answer within `timeout_s`
SlowAnswer (a BackendUnavailable: the call failed, but a slow engine is not a dead one).
`live` goes without the key: it is how the router checks an engine before the key goes there.
start_generate's chunks after the first come on one channel per engine (_Channel, opened by the
first request: one read per engine step for all of them) unless `channel=False` or the engine
has none; a request read no further is aborted by an abort call.

HTTP is microserve/http_client.py's: the router makes several calls per client request and
reads every token through this client, so the transport is a lean keep-alive HTTP/1.1 client on
asyncio and httptools' C parser (a one-token start_generate through this client: 0.37-0.40 ms
of CPU, 0.22-0.28 of it the transport, against 0.93 on aiohttp, which replaced httpx at 1.66). No torch, no fastapi.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import httptools
import msgspec

from microserve.backend import BackendUnavailable, MicroservingError
from microserve.http_client import ConnectionPool, Response
from microserve.messages import (
    AbortRequest,
    ChannelItem,
    GenerateChunk,
    Liveness,
    SamplingParams,
    StartGenerateRequest,
    StatsResponse,
    StreamError,
    call_of,
)
from microserve.wire import FrameDecoder

MSGPACK = "application/msgpack"
ResponseT = TypeVar("ResponseT")
_msgpack = msgspec.msgpack.Encoder()
# What a call that cannot reach the engine raises (or times out with): OSError covers
# refused/reset/dropped connections and TimeoutError.
_TRANSPORT_ERRORS = (OSError, httptools.HttpParserError)


class SlowAnswer(BackendUnavailable):
    """The engine did not answer within the client's limit (connecting included)."""


_chunk = msgspec.msgpack.Decoder(GenerateChunk)
_stream_error = msgspec.msgpack.Decoder(StreamError)
_channel_item = msgspec.msgpack.Decoder(ChannelItem)


class _Frames:
    """A msgpack stream (microserve.wire's frames): feed bytes as they arrive; get the whole
    frames out, each decoded once by `decode`."""

    def __init__(self, decode: Callable[[msgspec.Raw], Any]):
        self._frames, self._decode = FrameDecoder(msgspec.Raw), decode

    def feed(self, data: bytes) -> list:
        return [self._decode(raw) for raw in self._frames.feed(data)]


class _Lines:
    """An NDJSON stream (without msgpack): the whole lines, each decoded once by `decode`."""

    def __init__(self, decode: Callable[[bytes], Any]):
        self._buf, self._decode = b"", decode

    def feed(self, data: bytes) -> list:
        *lines, self._buf = (self._buf + data).split(b"\n")
        return [self._decode(line) for line in lines if line]


def _decode_item(raw: msgspec.Raw) -> GenerateChunk | StreamError:
    try:
        return _chunk.decode(raw)
    except msgspec.ValidationError:  # no token_ids: the stream's error
        return _stream_error.decode(raw)


def _decode_line(line: bytes) -> GenerateChunk | StreamError:
    item = json.loads(line)
    return msgspec.convert(item, StreamError if "error" in item else GenerateChunk)


def _stream_decoder(response: Response) -> _Frames | _Lines:
    """start_generate's stream: GenerateChunks, or the StreamError that ends a failed one."""
    return _Frames(_decode_item) if _is_msgpack(response) else _Lines(_decode_line)


def _channel_decoder(response: Response) -> _Frames | _Lines:
    """A channel's stream: ChannelItems."""
    if _is_msgpack(response):
        return _Frames(_channel_item.decode)
    return _Lines(lambda line: msgspec.json.decode(line, type=ChannelItem))


def _is_msgpack(response: Response) -> bool:
    return response.content_type == MSGPACK


def _error(status: int, body: Any) -> MicroservingError:
    """The MicroservingError an OpenAI error JSON (or any other error body) stands for."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return MicroservingError(status, f"HTTP {status}: {str(body)[:200]}")
    return MicroservingError(status, error.get("message", ""), error.get("param"),
                             error.get("code"))


async def _response_error(response: Response, timeout_s: float) -> MicroservingError:
    text = (await response.read(timeout_s)).decode(errors="replace")
    try:
        return _error(response.status, json.loads(text))
    except ValueError:  # not JSON: a proxy's page, say
        return _error(response.status, text)


def _coalesced(items: list[GenerateChunk | StreamError]) -> Iterator[GenerateChunk]:
    """The chunks of one read as one chunk (tokens, logprobs in order; the last finish_reason
    and usage; the first cached_tokens and prompt_logprobs). A caller that keeps up reads one
    chunk per engine step; one that lags (a router forwarding hundreds of streams) finds
    several waiting, and handles them as one: its work per token falls as its load rises. An
    error item raises after the tokens before it."""
    merged = None
    for item in items:
        if isinstance(item, StreamError):  # the engine failed after its 200
            if merged is not None:
                yield merged
            error = item.error
            raise MicroservingError(item.status, error.message, error.param, error.code)
        if merged is None:
            merged = item
            continue
        if merged is items[0]:  # a copy to merge into: the decoded chunks stay as they came
            merged = GenerateChunk(list(merged.token_ids), merged.logprobs,
                                   merged.finish_reason, merged.usage, merged.cached_tokens,
                                   merged.prompt_logprobs)
        merged.token_ids += item.token_ids
        if item.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + item.logprobs
        merged.finish_reason = item.finish_reason or merged.finish_reason
        merged.usage = item.usage or merged.usage
        if merged.cached_tokens is None:
            merged.cached_tokens = item.cached_tokens
        if merged.prompt_logprobs is None:
            merged.prompt_logprobs = item.prompt_logprobs
    if merged is not None:
        yield merged


class _Channel:
    """The router's channel to one engine (GET /microserving/channel/{id}): one reader task
    hands each item to the queue of the request it names. Read per engine step, it carries the
    chunks of every request bound to it: one read, not one per request. When it fails (the
    engine died, the connection dropped) every request on it gets the BackendUnavailable; the
    next request opens another."""

    def __init__(self, channel_id: str, loop: asyncio.AbstractEventLoop, name: str):
        self.id = channel_id
        self.name = name  # the engine's URL, for errors
        self.loop = loop
        self.queues: dict[str, asyncio.Queue] = {}
        self.error: BaseException | None = None  # set when it ended
        self._task: asyncio.Task | None = None
        self._closing = False

    def usable(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self.error is None and not self._closing and loop is self.loop

    def start(self, response: Response, decoder, unavailable) -> None:
        self._task = self.loop.create_task(self._read(response, decoder, unavailable))

    def register(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            queue.put_nowait(self.error)
        self.queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        if self._closing and not self.queues and self._task is not None:
            self._task.cancel()

    def close_when_idle(self) -> None:
        self._closing = True
        if not self.queues and self._task is not None:
            self._task.cancel()

    def fail(self, error: BaseException) -> None:
        """End it: every request on it gets `error`."""
        if self.error is None:
            self.error = error
            for queue in self.queues.values():
                queue.put_nowait(error)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _read(self, response: Response, decoder, unavailable) -> None:
        error: BaseException
        try:
            while (data := await response.next_data()) is not None:
                for item in decoder.feed(data):
                    queue = self.queues.get(item.request_id)
                    if queue is not None:  # else: a request its caller stopped reading
                        queue.put_nowait(item.chunk if item.error is None else item.error)
            error = BackendUnavailable(f"engine {self.name}: its channel ended")
        except _TRANSPORT_ERRORS as e:
            error = unavailable(e)
        except asyncio.CancelledError:
            error = BackendUnavailable("the channel was closed")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            error = BackendUnavailable(f"engine {self.name}: its channel sent an item that does "
                                       f"not decode: {e}")
        finally:
            response.release()  # mid-stream: the connection closes, the engine aborts
        self.fail(error)


class EngineClient:
    """Async client of one engine's /microserving/* routes; safe to share between tasks."""

    def __init__(self, base_url: str, *, api_key: str | None = None, use_msgpack: bool = True,
                 timeout_s: float = 30.0, channel: bool = True):
        """
        Args:
            base_url: the engine's root, e.g. "http://10.0.0.7:8000".
            api_key: sent as `Authorization: Bearer <api_key>` when set.
            use_msgpack: send and ask for msgpack bodies; JSON otherwise.
            timeout_s: the limit on connecting, and on waiting for an answer, except for
                remote_send's answer and start_generate's chunks, which wait as long as the
                engine works (a long prefill, a long queue).
            channel: carry start_generate's chunks after the first on one channel to the
                engine (_Channel) rather than a stream per request; an engine without
                channels gets streams.
        """
        self.base_url = base_url.rstrip("/")
        self._http = ConnectionPool(self.base_url, connect_timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._use_msgpack = use_msgpack
        media_type = MSGPACK if use_msgpack else "application/json"
        headers = f"Content-Type: {media_type}\r\nAccept: {media_type}\r\n"
        self._keyless_headers = headers.encode("latin-1")  # for `live` alone
        if api_key is not None:
            headers += f"Authorization: Bearer {api_key}\r\n"
        self._headers = headers.encode("latin-1")
        self._use_channel = channel
        self._channel: _Channel | None = None
        self._channel_opening: asyncio.Lock | None = None  # one opener at a time
        self._channel_opening_loop: asyncio.AbstractEventLoop | None = None
        self._aborts: set[asyncio.Task] = set()  # abort calls for requests closed unfinished

    async def call(self, request: Any) -> Any:
        """Make the call whose request `request` is (microserve.messages.CALLS): its answer,
        decoded once into the call's answer type. A call whose answer takes as long as the
        engine works (remote_send) waits for it unbounded; one that may wait on purpose
        (prep_recv's `wait_s` for pages) that much longer than the client's limit."""
        call = call_of(request)
        timeout_s = None if call.timeout_s is None else self._timeout_s + (
            (getattr(request, call.waits) or 0) if call.waits else 0)
        response = await self._open(b"POST", call.name, self._encode(request), timeout_s)
        raw = await self._answer(response, timeout_s)
        if _is_msgpack(response):
            return call.decode_answer(raw)
        return msgspec.json.decode(raw, type=call.answer)

    def start_generate(self, request_id: str, prompt: list[int], begin: int = 0,
                             sampling: SamplingParams | None = None,
                             first_token: int | None = None,
                             queue_s: float | None = None,
                             priority: int = 0, first_token_delivered: bool = False
                             ) -> AsyncIterator[GenerateChunk]:
        """Generate from `prompt`, whose KV of `prompt[:begin]` is on the engine already
        (`first_token`: the first output, sampled by the sender of the whole prompt's KV;
        `first_token_delivered`: the caller gave that token to its client already, so the
        stream begins after it (StartGenerateRequest);
        `queue_s`: how long it may wait for a step to start on it, else a 503 queue_timeout;
        `priority`: its rank under the engine's priority scheduling policy, lower first).

        Yields the engine's chunks as they come; the last has finish_reason and usage.
        Raises MicroservingError / BackendUnavailable, before the first chunk or after (the
        engine failed, or the connection dropped, mid-stream). The request is sent when the
        first chunk is awaited. Closing the iterator early aborts the request in the engine:
        an abort call (on a channel) or the stream's connection closed.
        """
        body = StartGenerateRequest(request_id, prompt, begin, sampling or SamplingParams(),
                                    first_token=first_token,
                                    first_token_delivered=first_token_delivered,
                                    queue_s=queue_s, priority=priority)
        if self._use_channel:
            return self._on_channel(body)
        return self._streamed(body)

    async def _on_channel(self, body: StartGenerateRequest) -> AsyncIterator[GenerateChunk]:
        """start_generate whose first chunk is the call's answer and whose others come on the
        channel; a stream if the engine has no channel."""
        channel = await self._open_channel()
        if channel is None:
            async for chunk in self._streamed(body):
                yield chunk
            return
        rid = body.request_id
        queue = channel.register(rid)
        body.channel = channel.id
        started = finished = False
        try:
            try:
                response = await self._open(b"POST", "start_generate", self._encode(body), None)
                started = True  # from here on the engine may be running it
            except MicroservingError as e:
                if e.code != "channel_not_open":
                    raise
                channel.fail(BackendUnavailable(f"engine {self.base_url}: channel closed"))
                body.channel = None  # it went (the engine restarted?): this one streams
                async for chunk in self._streamed(body):
                    yield chunk
                return
            raw = await self._answer(response, None)
            first = (_chunk.decode(raw) if _is_msgpack(response)
                     else msgspec.json.decode(raw, type=GenerateChunk))
            finished = first.finish_reason is not None
            yield first
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                failed = next((x for x in items if isinstance(x, BaseException)), None)
                if failed is not None:  # the channel failed: what came before it, then that
                    items = items[:items.index(failed)]
                for chunk in _coalesced(items):
                    finished = chunk.finish_reason is not None
                    yield chunk
                if failed is not None and not finished:
                    raise failed
        finally:
            channel.unregister(rid)
            if started and not finished:
                self._abort_soon(rid)

    def _abort_soon(self, request_id: str) -> None:
        """Abort a request whose chunks are no longer wanted (its caller stopped reading)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # finalized with no loop running: its loop, and channel, are gone
            return
        task = loop.create_task(self._abort_quietly(request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.call(AbortRequest(request_id))
        except (MicroservingError, BackendUnavailable):
            pass  # gone with its engine, or finished meanwhile: nothing to abort there

    async def _open_channel(self) -> _Channel | None:
        """The channel to this engine, opened if none is (None: the engine has none)."""
        channel, loop = self._channel, asyncio.get_running_loop()
        if channel is not None and channel.usable(loop):
            return channel
        if not self._use_channel:
            return None
        if self._channel_opening is None or self._channel_opening_loop is not loop:
            self._channel_opening, self._channel_opening_loop = asyncio.Lock(), loop
        async with self._channel_opening:
            channel = self._channel
            if channel is not None and channel.usable(loop):
                return channel
            channel = _Channel(secrets.token_urlsafe(12), loop, self.base_url)
            try:
                response = await self._open(b"GET", f"channel/{channel.id}", None,
                                            self._timeout_s)
            except MicroservingError as e:
                if e.status in (404, 405):  # an engine without channels: streams, from now on
                    self._use_channel = False
                    return None
                raise
            channel.start(response, _channel_decoder(response), self._unavailable)
            self._channel = channel
            return channel

    async def _streamed(self, body: StartGenerateRequest) -> AsyncIterator[GenerateChunk]:
        """start_generate as a stream of its own."""
        response = await self._open(b"POST", "start_generate", self._encode(body), None)
        decoder = _stream_decoder(response)
        finished = False
        try:
            # Read on past the last chunk to the end of the stream (it ends right there), so
            # that the connection goes back to the pool.
            while (data := await response.next_data()) is not None:
                for chunk in _coalesced(decoder.feed(data)):
                    finished = chunk.finish_reason is not None
                    yield chunk
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e
        finally:
            # At the end the connection is reused; mid-stream it is closed, and the engine
            # sees the client go.
            response.release()
        if not finished:
            raise BackendUnavailable(f"engine {self.base_url}: the stream of "
                                     f"{body.request_id} ended before it finished")

    async def stats(self, check: bool = False) -> StatsResponse:
        """The engine's load and facts, with the KV integrity check's verdict if `check`."""
        path = "stats?check=1" if check else "stats"
        response = await self._open(b"GET", path, None, self._timeout_s)
        return _decoded(response, await self._answer(response, self._timeout_s), StatsResponse)

    async def live(self, challenge: str | None = None) -> Liveness:
        """The engine's liveness, asked without the key; with a `challenge` (hex) its
        answer carries the proof that it holds the key (microserve/auth.py)."""
        path = "live" if challenge is None else f"live?challenge={challenge}"
        response = await self._open(b"GET", path, None, self._timeout_s, keyless=True)
        return _decoded(response, await self._answer(response, self._timeout_s), Liveness)

    def retire(self) -> None:
        """Keep no idle connections from now on; calls still go out (a channel open stays
        open until its requests end, and none opens after)."""
        self._http.retire()
        self._wind_down()

    def close(self) -> None:
        """Close the idle connections; calls in flight finish, their connections then close
        (a channel's once its requests have ended)."""
        self._http.close()
        self._wind_down()

    def _wind_down(self) -> None:
        self._use_channel = False
        if self._channel is not None:
            self._channel.close_when_idle()

    async def aclose(self) -> None:
        """close(), and an idle channel's connection closed by the time this returns: a
        script that stops the engine next (its loop then blocked on the engine's exit, say)
        would otherwise leave the channel's reader cancelled but never run, its connection
        open, and the engine waiting for it to close before it exits."""
        self.close()
        channel = self._channel
        task = channel._task if channel is not None else None
        if (task is not None and not channel.queues
                and channel.loop is asyncio.get_running_loop()):
            await asyncio.gather(task, return_exceptions=True)

    # -- plumbing ------------------------------------------------------------------------------

    def _encode(self, body: Any) -> bytes:
        """A request body (one of microserve.messages' requests, which the engine validates)."""
        if self._use_msgpack:
            return _msgpack.encode(body)
        return json.dumps(msgspec.to_builtins(body), separators=(",", ":")).encode()

    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        kind = SlowAnswer if isinstance(exc, TimeoutError) else BackendUnavailable
        return kind(f"engine {self.base_url}: {type(exc).__name__}: {exc}")

    async def _open(self, method: bytes, name: str, data: bytes | None,
                    read_timeout_s: float | None, keyless: bool = False) -> Response:
        """The response to one call, its body still to read; raises on an error status or
        no connection. `keyless`: without the Authorization header."""
        headers = self._keyless_headers if keyless else self._headers
        try:
            response = await self._http.request(method, f"/microserving/{name}", headers,
                                                data, read_timeout_s)  # fmt: skip
            if response.status >= 400:
                try:
                    raise await _response_error(response, self._timeout_s)
                finally:
                    response.release()
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e
        return response

    async def _answer(self, response: Response, read_timeout_s: float | None) -> bytes:
        """The body of a successful answer."""
        try:
            return await response.read(read_timeout_s)
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e
        finally:
            response.release()


def _decoded(response: Response, raw: bytes, type_: type[ResponseT]) -> ResponseT:
    if _is_msgpack(response):
        return msgspec.msgpack.decode(raw, type=type_)
    return msgspec.json.decode(raw, type=type_)
