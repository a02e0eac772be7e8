"""The HTTP server of routers and engines: uvicorn on a socket of our own.

    sock = listen_socket(host, port)  # first: a busy port fails before anything starts
    limits = fit_file_limit(HttpLimits(...), fds_per_connection=1)  # http_limits.py
    server = QuietServer.serving(app, log_level, limits)
    await server.serve(sockets=[sock])

Every connection is bounded (BoundedHttpProtocol): deadlines on its request's head and body and
on its idle time, a cap on open connections; microserve/http_limits.py says what they are.
A 500 closes its connection, and says so (`_CloseAfterServerError`).

TCP_NODELAY (each SSE chunk must leave at once): uvicorn never sets it; asyncio sets it on a
transport's socket only when that socket's `proto` is IPPROTO_TCP. `uvicorn.run(app, host=,
port=)` binds through asyncio and gets it; a socket bound by `socket.socket(family)` has proto 0
and does not: that is uvicorn's own path with --workers, --reload or --fd, and any `sockets=`
you pass. Serve through `listen_socket()` to have it either way (tests check both).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from microserve.errors import OpenAIError
from microserve.heap import freeze_startup_heap
from microserve.http_limits import LINGER_S, MAX_HEAD_BYTES, MAX_LINGERING, HttpLimits

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0  # refusals and closed connections are summed up in one line this often


def _error(status: int, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP response with OpenAI's error JSON that closes the connection."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    payload = json.dumps(OpenAIError(status, message, type=kind, code=code).body()).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(payload)}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


class _Tally:
    """Counts one kind of event and logs the count at most every _LOG_EVERY_S, so that a flood
    of slow or refused connections makes a line every few seconds, not one per connection."""

    def __init__(self, message: str):
        self.message, self.count, self.logged_at = message, 0, 0.0

    def add(self, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= _LOG_EVERY_S:
            log.warning(self.message, self.count, *args)
            self.count, self.logged_at = 0, now


@dataclass
class _ServerState:
    """What the connections of one server share; written by BoundedHttpProtocol only."""

    refused: _Tally  # connections past max_connections
    timed_out: _Tally  # connections closed at a deadline
    lingering: int = 0  # connections answered and closing (see _close_with)


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with http_limits.py's deadlines and caps. Serve a subclass
    made by `bounded_by(limits)` (uvicorn.Config(app, http=...)); uvicorn's keep-alive timer is
    the idle deadline (timeout_keep_alive=limits.keep_alive_s)."""

    limits: ClassVar[HttpLimits]
    shared: ClassVar[_ServerState]

    @classmethod
    def bounded_by(cls, limits: HttpLimits) -> type[BoundedHttpProtocol]:
        shared = _ServerState(
            refused=_Tally("refused %d connections past the cap of %d open connections "
                           "(max_connections)"),
            timed_out=_Tally("closed %d connections that sent no whole request head within "
                             "%g s or no whole body within %g s (header_timeout_s, "
                             "body_timeout_s)"))
        return type(cls.__name__, (cls,), {"limits": limits, "shared": shared})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accepted = False  # False: turned away at the accept (past max_connections)
        self._deadline: asyncio.TimerHandle | None = None  # the head's or the body's
        self._in_head = True  # the next byte received belongs to a request head
        self._head_bytes = 0  # of the current head so far (a request's body is not counted)
        self._head_tail = b""  # its last bytes: the blank line ending it may span two chunks
        self._lingering = False  # answered and closing: what arrives now is dropped

    def connection_made(self, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # never served: uvicorn's own state stays unset
            self.shared.refused.add(self.limits.max_connections)
            self._close_with(_error(503, f"This server holds its limit of "
                                    f"{self.limits.max_connections} open connections; retry "
                                    "shortly", "too_many_connections", retry_after=1))
            return
        self._accepted = True
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering:
            self.shared.lingering -= 1
        if self._accepted:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.transport.is_closing():
            return
        if self._in_head:
            self._head_bytes += self._head_part(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._close_with(_error(431, f"The request's line and headers are longer "
                                        f"than the {MAX_HEAD_BYTES} bytes this server reads",
                                        "headers_too_large"))
                return
        super().data_received(data)

    def _head_part(self, data: bytes) -> int:
        """How many of `data`'s bytes belong to the head being read: up to the blank line
        that ends it (which may begin in the chunk before), else all of them. A request's
        body, read in the same chunk as its head, is not head."""
        tail = self._head_tail
        across = (tail + data[:3]).find(b"\r\n\r\n")
        if across >= 0:
            return across + 4 - len(tail)
        end = data.find(b"\r\n\r\n")
        self._head_tail = (tail + data)[-3:] if len(data) < 3 else data[-3:]
        return len(data) if end < 0 else end + 4

    # httptools' callbacks, around uvicorn's own

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a later request on the connection: from its first byte
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._head_tail = False, 0, b""
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()

    # deadlines

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._lingering:  # the linger is over
            self.transport.close()
            return
        if self.transport.is_closing():
            return
        self.shared.timed_out.add(self.limits.header_timeout_s, self.limits.body_timeout_s)
        # self.headers is None until the connection's first request begins
        if self.headers is None or (not self._in_head and self.cycle.response_started):
            self.transport.close()  # never sent a byte, or being answered: nothing to say
            return
        what = "headers" if self._in_head else "body"
        seconds = self.limits.header_timeout_s if self._in_head else self.limits.body_timeout_s
        self._close_with(_error(408, f"The request's {what} did not arrive within {seconds:g} "
                                "s", "request_timeout"))

    def _close_with(self, response: bytes) -> None:
        """Answer and close so that the client reads the answer. Closing a socket with bytes
        unread makes the kernel reset the connection and drop what is still to send, and these
        clients are mid-request: so end our side after the answer (FIN), drop what they still
        send for up to LINGER_S, then close (nginx's lingering close). At most MAX_LINGERING
        connections linger at once; past that, a plain close."""
        self._disarm()
        self.transport.write(response)
        if self.shared.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.shared.lingering += 1
        self._lingering = True
        self.transport.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, self._deadline_passed)


class _CloseAfterServerError:
    """ASGI wrapper: a 500 answer carries `connection: close`, and uvicorn closes the
    connection once it is sent. A handler that raises gets its 500 from Starlette, which then
    re-raises, and uvicorn drops the connection after that answer; without the header the
    answer promised keep-alive, and a client's next request on the connection was reset
    (issue 39). Whatever raised, the connection's state is not trusted further."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_closing_after_500(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 500:
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing_after_500)


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its caller's cleanup: uvicorn re-raises
    SIGINT/SIGTERM once it has shut down, which would end the process before the caller
    stops what it started (an engine core, engine processes). No ASGI lifespan: the apps
    served have no startup or shutdown handlers (their owners start and close what they run
    around `serve`), and a second Ctrl-C, which makes uvicorn skip the lifespan's shutdown,
    left its task to be cancelled at exit with a CancelledError traceback on the terminal."""

    @classmethod
    def serving(cls, app, log_level: str, limits: HttpLimits = HttpLimits()) -> "QuietServer":
        """Serve `app` with every connection bounded by `limits` (microserve/http_limits.py;
        fit them to the open-file limit first with `fit_file_limit`)."""
        return cls(uvicorn.Config(_CloseAfterServerError(app), log_level=log_level,
                                  access_log=False, lifespan="off",
                                  http=BoundedHttpProtocol.bounded_by(limits),
                                  timeout_keep_alive=limits.keep_alive_s))

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: what is alive now lives as long as the server
            freeze_startup_heap()

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # uvicorn's private list of signals to re-raise


LISTEN_BACKLOG = 2048  # uvicorn's default, which it sets again when it serves


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket whose accepted connections have TCP_NODELAY, for uvicorn:

        await uvicorn.Server(uvicorn.Config(app)).serve(sockets=[listen_socket(host, port)])

    proto=IPPROTO_TCP makes asyncio set TCP_NODELAY on each accepted socket; the listener's own
    TCP_NODELAY is also inherited by accepted sockets on Linux. It listens at once: with
    SO_REUSEADDR two processes may both bind one port until one of them listens, so a second
    server started on a port this one is loading on fails here, not seconds later. (Clients
    that connect meanwhile wait in the backlog until the app serves.)
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(host, port) from None
        raise
    return sock


class PortInUse(OSError):
    """The port a server must listen on is taken: says which, and what to do."""

    def __init__(self, host: str, port: int, what: str = "this server"):
        super().__init__(errno.EADDRINUSE, f"port {port} on {host} (for {what}) is already in "
                         "use, by another microserve deployment or another program: stop it, "
                         "or choose another port (--port)")

    def __str__(self) -> str:
        return self.strerror


def check_port_free(host: str, port: int, what: str) -> None:
    """Raise PortInUse if `port` cannot be bound now (for a process started later)."""
    try:
        listen_socket(host, port).close()
    except PortInUse:
        raise PortInUse(host, port, what) from None
