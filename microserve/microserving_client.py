"""The router's handle on one engine's microserving API (DESIGN §4), over pooled HTTP.

    engine = EngineClient("http://10.0.0.7:8000", api_key=key)
    recv = await engine.prep_recv(request_id, prompt, end=-1)
    await prefill_engine.remote_send(request_id, prompt, recv.matched, -1, recv.kv_addr)
    async for chunk in engine.start_generate(request_id, prompt, begin=len(prompt) - 1):
        ...

Bodies go as msgpack by default (token lists are the bulk), JSON with `use_msgpack=False`:
the typed messages of microserve/messages.py, encoded by msgspec, and the answers decoded into
them (the engine validates what it is sent; the router trusts its engines' answers, which
msgspec still checks for shape as it decodes them).
Failures: an answer with an error status raises MicroservingError(status, message, param) from
the engine's OpenAI error JSON; an engine that cannot be reached or drops the connection
raises BackendUnavailable naming its URL, one that does not answer within `timeout_s`
SlowAnswer (a BackendUnavailable: the call failed, but a slow engine is not a dead one).
`live` goes without the key: it is how the router checks an engine before the key goes there.

HTTP is microserve/http_client.py's: the router makes several calls per client request and
reads every token through this client, so the transport is a lean keep-alive HTTP/1.1 client on
asyncio and httptools' C parser (a one-token start_generate through this client: 0.37-0.40 ms
of CPU, 0.22-0.28 of it the transport, against 0.93 on aiohttp, which replaced httpx at 1.66). No torch, no fastapi.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import httptools
import msgspec

from microserve.backend import BackendUnavailable, MicroservingError
from microserve.http_client import ConnectionPool, Response
from microserve.messages import (
    AbortRequest,
    AbortResponse,
    CommitRequest,
    CommitResponse,
    GenerateChunk,
    KVAddr,
    Liveness,
    PinRequest,
    PinResponse,
    PrepRecvRequest,
    PrepRecvResponse,
    RemoteSendRequest,
    RemoteSendResponse,
    SamplingParams,
    SendToRequest,
    SendToResponse,
    StartGenerateRequest,
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


class _LineDecoder:
    """NDJSON: feed bytes as they arrive; get the whole lines' objects out."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list:
        *lines, self._buf = (self._buf + data).split(b"\n")
        return [json.loads(line) for line in lines if line]


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


def _coalesced(items: list[dict]) -> Iterator[GenerateChunk]:
    """The chunks of one read as one chunk (tokens, logprobs in order; the last finish_reason
    and usage; the first cached_tokens and prompt_logprobs). A caller that keeps up reads one
    chunk per engine step; one that lags (a router forwarding hundreds of streams) finds
    several waiting, and handles them as one: its work per token falls as its load rises. An
    error item raises after the tokens before it."""
    merged = None
    for item in items:
        if "error" in item:  # the engine failed after its 200: the status it would have sent
            if merged is not None:
                yield msgspec.convert(merged, GenerateChunk)
            raise _error(item["status"], item)
        if merged is None:
            merged = item
            continue
        merged["token_ids"] = merged["token_ids"] + item["token_ids"]
        if item.get("logprobs") is not None:
            merged["logprobs"] = (merged.get("logprobs") or []) + item["logprobs"]
        for key in ("finish_reason", "usage"):
            if item.get(key) is not None:
                merged[key] = item[key]
        for key in ("cached_tokens", "prompt_logprobs"):
            if merged.get(key) is None:
                merged[key] = item.get(key)
    if merged is not None:
        yield msgspec.convert(merged, GenerateChunk)


class EngineClient:
    """Async client of one engine's /microserving/* routes; safe to share between tasks."""

    def __init__(self, base_url: str, *, api_key: str | None = None, use_msgpack: bool = True,
                 timeout_s: float = 30.0):
        """
        Args:
            base_url: the engine's root, e.g. "http://10.0.0.7:8000".
            api_key: sent as `Authorization: Bearer <api_key>` when set.
            use_msgpack: send and ask for msgpack bodies; JSON otherwise.
            timeout_s: the limit on connecting, and on waiting for an answer, except for
                remote_send's answer and start_generate's chunks, which wait as long as the
                engine works (a long prefill, a long queue).
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

    async def prep_recv(self, request_id: str, prompt: list[int], end: int = -1,
                        lease_s: float | None = None, wait_s: float | None = None
                        ) -> PrepRecvResponse:
        """Reserve this engine's slots for `prompt[matched:end]`, held for `lease_s` after the
        sender's last renewal; waits up to `wait_s` for free pages (None: the engine's
        --kv-recv-wait-s), then raises a 503 MicroservingError with code kv_wait_timeout."""
        body = PrepRecvRequest(request_id, prompt, end, lease_s, wait_s)
        read_timeout_s = None if wait_s is None else wait_s + self._timeout_s
        return await self._post("prep_recv", body, PrepRecvResponse, read_timeout_s=read_timeout_s)

    async def remote_send(self, request_id: str, prompt: list[int], begin: int, end: int,
                          kv_addr: KVAddr | None, sampling: SamplingParams | None = None,
                          queue_s: float | None = None) -> RemoteSendResponse:
        """Make the KV of `prompt[begin:end]` land at `kv_addr`; returns once it all landed.
        With `sampling` (end = len(prompt)) the answer also has the first output token.
        `kv_addr` None (begin 0): the engine starts computing now and sends once `send_to`
        names where. `queue_s`: a step must start on it within this long, else a 503 with code
        queue_timeout (None: no limit)."""
        body = RemoteSendRequest(request_id=request_id, prompt=prompt, begin=begin, end=end,
                                 kv_addr=kv_addr, sampling=sampling, queue_s=queue_s)
        return await self._post("remote_send", body, RemoteSendResponse, unbounded=True)

    async def send_to(self, request_id: str, begin: int, kv_addr: KVAddr) -> SendToResponse:
        """Name the destination of a remote_send made without kv_addr: [begin, end) goes to
        `kv_addr` (the receiver's prep_recv answer: begin = its matched)."""
        return await self._post("send_to", SendToRequest(request_id, begin, kv_addr),
                                SendToResponse)

    async def start_generate(self, request_id: str, prompt: list[int], begin: int = 0,
                             sampling: SamplingParams | None = None,
                             first_token: int | None = None,
                             queue_s: float | None = None) -> AsyncIterator[GenerateChunk]:
        """Generate from `prompt`, whose KV of `prompt[:begin]` is on the engine already
        (`first_token`: the first output, sampled by the sender of the whole prompt's KV;
        `queue_s`: how long it may wait for a step to start on it, else a 503 queue_timeout).

        Yields the engine's chunks as they come; the last has finish_reason and usage.
        Raises MicroservingError / BackendUnavailable, before the first chunk or after (the
        engine failed, or the connection dropped, mid-stream). The request is sent when the
        first chunk is awaited. Closing the iterator early closes the HTTP connection, which
        makes the engine abort the request.
        """
        body = StartGenerateRequest(request_id, prompt, begin, sampling or SamplingParams(),
                                    first_token=first_token, queue_s=queue_s)
        response = await self._open(b"POST", "start_generate", self._encode(body), None)
        decoder = FrameDecoder() if _is_msgpack(response) else _LineDecoder()
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
            raise BackendUnavailable(
                f"engine {self.base_url}: the stream of {request_id} ended before it finished")

    async def commit(self, request_id: str, pin: bool = False) -> CommitResponse:
        """Adopt the KV received under `request_id` into the prefix cache (pinned if `pin`)."""
        return await self._post("commit", CommitRequest(request_id, pin), CommitResponse)

    async def abort(self, request_id: str) -> AbortResponse:
        """Drop whatever the engine holds under `request_id`."""
        return await self._post("abort", AbortRequest(request_id), AbortResponse)

    async def pin(self, prompt: list[int]) -> PinResponse:
        """Keep the cached prefix of `prompt` from eviction."""
        return await self._post("pin", PinRequest(prompt), PinResponse)

    async def unpin(self, prompt: list[int]) -> PinResponse:
        """Let the cached prefix of `prompt` be evicted again."""
        return await self._post("unpin", PinRequest(prompt), PinResponse)

    async def stats(self, check: bool = False) -> dict:
        """{"stats": load and KV accounting, "info": the engine's EngineInfo}, plus
        "integrity" ("ok" or what is wrong) when `check` runs the KV integrity check."""
        path = "stats?check=1" if check else "stats"
        return await self._answer(await self._open(b"GET", path, None, self._timeout_s),
                                  self._timeout_s)

    async def live(self, challenge: str | None = None) -> Liveness:
        """The engine's liveness, asked without the key; with a `challenge` (hex) its
        answer carries the proof that it holds the key (microserve/auth.py)."""
        path = "live" if challenge is None else f"live?challenge={challenge}"
        response = await self._open(b"GET", path, None, self._timeout_s, keyless=True)
        return msgspec.convert(await self._answer(response, self._timeout_s), Liveness)

    def retire(self) -> None:
        """Keep no idle connections from now on; calls still go out."""
        self._http.retire()

    def close(self) -> None:
        """Close the idle connections; calls in flight finish, their connections then close."""
        self._http.close()

    async def aclose(self) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _encode(self, body: Any) -> bytes:
        """A request body (one of messages.py's requests, which the engine validates)."""
        if self._use_msgpack:
            return _msgpack.encode(body)
        return json.dumps(msgspec.to_builtins(body), separators=(",", ":")).encode()

    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        kind = SlowAnswer if isinstance(exc, TimeoutError) else BackendUnavailable
        return kind(f"engine {self.base_url}: {type(exc).__name__}: {exc}")

    async def _post(self, name: str, body: Any, response_type: type[ResponseT],
                    unbounded: bool = False, read_timeout_s: float | None = None) -> ResponseT:
        """One call and its validated answer; `unbounded`: wait for it as long as the engine
        works (no read timeout); `read_timeout_s`: this long instead of the client's limit."""
        timeout_s = None if unbounded else read_timeout_s or self._timeout_s
        response = await self._open(b"POST", name, self._encode(body), timeout_s)
        return msgspec.convert(await self._answer(response, timeout_s), response_type)

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

    async def _answer(self, response: Response, read_timeout_s: float | None) -> Any:
        """The decoded body of a successful answer."""
        try:
            raw = await response.read(read_timeout_s)
        except _TRANSPORT_ERRORS as e:
            raise self._unavailable(e) from e
        finally:
            response.release()
        if _is_msgpack(response):
            return msgspec.msgpack.decode(raw)
        return json.loads(raw)
