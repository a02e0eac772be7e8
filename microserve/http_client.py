"""A lean HTTP/1.1 client for the router's calls to its engines: keep-alive, streamed bodies.

    pool = ConnectionPool("http://10.0.0.7:8000", connect_timeout_s=30)
    response = await pool.request(b"POST", "/microserving/start_generate", headers, body)
    while (data := await response.next_data(read_timeout_s=None)) is not None:
        ...                                   # body bytes as they arrive
    response.release()                        # read to the end: the connection is reused

The router reads every generated token through this hop, and a short request's added latency is
mostly the router's CPU. On this project's 2-core CI machine one `start_generate` call with
one token cost 0.93 ms of CPU through aiohttp and our pydantic parsing, 0.22-0.28 ms through
asyncio's transport and httptools' C parser alone (2026-11-23; `docs/benchmarks.md`, router
overhead). So this does only what an engine's API needs: requests with a body of known length;
responses with Content-Length or chunked bodies, read as they arrive; connections kept alive
and reused, newest first; TLS for https URLs. No redirects, cookies, proxies, compression or
pipelining.

A connection the engine closed while idle (uvicorn's keep-alive timeout) is noticed when the
close arrives and never reused; if the close crosses our request on the wire (nothing came back
on a reused connection), the request is sent once more on a fresh connection: the engine never
read it. Every transport failure raises OSError (ConnectionError for a dropped connection,
TimeoutError for a limit passed) or httptools.HttpParserError for a malformed answer.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 4 << 20  # pause reading past this much unread body; resume below a quarter


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False  # lost, or closed by us
        self.error: BaseException | None = None  # why the current response cannot go on
        self._waiter: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.received = False  # any byte of the current response
        self.headers_done = self.complete = self.keep_alive = False
        self.status = 0
        self.content_type = ""
        self.body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = e
            self.close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = exc or ConnectionResetError("the engine closed the connection")
        self._wake()

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().decode("latin-1").lower()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # known here, reset after
        self._wake()

    # -- used by Response and ConnectionPool ---------------------------------------------------

    def send(self, data: bytes) -> None:
        self._reset()
        self.error = None
        self.transport.write(data)

    def take(self) -> bytes:
        data = self.body.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < _HIGH_WATER // 4:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout_s: float | None) -> None:
        """Until the next parser event or the connection's end; TimeoutError after timeout_s."""
        waiter = self._waiter = self.loop.create_future()
        timer = (self.loop.call_later(timeout_s, _expire, waiter, timeout_s)
                 if timeout_s is not None else None)  # fmt: skip
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def reusable(self) -> bool:
        return not self.closed and self.complete and self.keep_alive and not self.body

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future, timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError(f"no answer within {timeout_s:g} s"))


class Response:
    """An answer whose status and headers have arrived; its body is read with `next_data` or
    `read`. Call `release()` when done (after `read`, or once `next_data` gave None): the
    connection goes back to the pool if the body was read to its end, else it is closed,
    which the engine sees as the client going away."""

    def __init__(self, pool: ConnectionPool, conn: _Connection):
        self._pool, self._conn = pool, conn
        self.status = conn.status
        self.content_type = conn.content_type

    @property
    def at_eof(self) -> bool:
        return self._conn.complete and not self._conn.body

    async def next_data(self, read_timeout_s: float | None = None) -> bytes | None:
        """The next piece of the body as it arrives; None at its end."""
        conn = self._conn
        while not conn.body:
            if conn.complete:
                return None
            if conn.error is not None:
                raise _as_os_error(conn.error)
            await conn.wait(read_timeout_s)
        return conn.take()

    async def read(self, read_timeout_s: float | None = None) -> bytes:
        """The whole body."""
        parts = []
        while (data := await self.next_data(read_timeout_s)) is not None:
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put_back(conn)


class ConnectionPool:
    """Keep-alive connections to one origin (scheme://host:port), as many as are in use at
    once: a generation holds its connection until it finishes, so there is no cap."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 30.0, max_idle: int = 64):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.host_header = url.netloc.rsplit("@", 1)[-1]
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False

    async def request(self, method: bytes, target: str, headers: bytes, body: bytes | None,
                      read_timeout_s: float | None = None) -> Response:
        """Send one request and wait for the answer's status and headers.

        Args:
            method: b"GET", b"POST", ...
            target: the path and query, e.g. "/microserving/stats?check=1".
            headers: further header lines, each ending in CRLF (Host and Content-Length are
                added here).
            body: the request body, or None.
            read_timeout_s: the limit on waiting for the status line (None: none).
        """
        if self._closed:
            raise ConnectionError("the connection pool is closed")
        body = body or b""
        head = (f"{method.decode()} {target} HTTP/1.1\r\nHost: {self.host_header}\r\n"
                f"Content-Length: {len(body)}\r\n").encode() + headers + b"\r\n"  # fmt: skip
        data = head + body if len(body) < 65536 else None  # one write for small bodies
        while True:
            conn, reused = await self._get()
            try:
                if data is not None:
                    conn.send(data)
                else:
                    conn.send(head)
                    conn.transport.write(body)
                while not conn.headers_done:
                    if conn.error is not None:
                        raise _as_os_error(conn.error)
                    await conn.wait(read_timeout_s)
            except ConnectionError:
                conn.close()
                if reused and not conn.received:
                    continue  # the engine closed it while idle: it never read this request
                raise
            except BaseException:  # a timeout, a cancelled caller: the connection is spent
                conn.close()
                raise
            return Response(self, conn)

    async def _get(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(lambda: _Connection(loop), self.host, self.port,
                                         ssl=self.ssl)  # fmt: skip
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await connect
        except TimeoutError:
            raise TimeoutError(f"could not connect within {self.connect_timeout_s:g} s") from None
        return conn, False

    def _put_back(self, conn: _Connection) -> None:
        if conn.reusable() and not self._closed and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def retire(self) -> None:
        """Close the idle connections and keep none from now on; requests still go out (an
        engine taken out of the router's pool: the calls of requests on it finish)."""
        self.max_idle = 0
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Close the idle connections; connections in use close when released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _as_os_error(error: BaseException) -> BaseException:
    if isinstance(error, (OSError, httptools.HttpParserError)):
        return error
    return ConnectionError(f"{type(error).__name__}: {error}")
