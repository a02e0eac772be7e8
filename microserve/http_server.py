"""The HTTP server of routers and engines: uvicorn on a socket of our own.

    sock = listen_socket(host, port)  # first: a busy port fails before anything starts
    server = QuietServer.serving(app, log_level)
    await server.serve(sockets=[sock])

TCP_NODELAY (each SSE chunk must leave at once): uvicorn never sets it; asyncio sets it on a
transport's socket only when that socket's `proto` is IPPROTO_TCP. `uvicorn.run(app, host=,
port=)` binds through asyncio and gets it; a socket bound by `socket.socket(family)` has proto 0
and does not: that is uvicorn's own path with --workers, --reload or --fd, and any `sockets=`
you pass. Serve through `listen_socket()` to have it either way (tests check both).
"""

from __future__ import annotations

import contextlib
import errno
import socket

import uvicorn


# How long an idle client connection stays open. Longer than the clients' own reuse window
# (httpx and the openai client: 5 s, aiohttp: 15 s): with uvicorn's default of 5 s, a client
# could send a request on a connection just as the server closed it, and see it fail with a
# read error (the likely cause of one such error in 180 requests through bench.strategies).
KEEP_ALIVE_S = 75


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to its caller's cleanup: uvicorn re-raises
    SIGINT/SIGTERM once it has shut down, which would end the process before the caller
    stops what it started (an engine core, engine processes)."""

    @classmethod
    def serving(cls, app, log_level: str) -> "QuietServer":
        return cls(uvicorn.Config(app, log_level=log_level, access_log=False,
                                  timeout_keep_alive=KEEP_ALIVE_S))

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # uvicorn's private list of signals to re-raise


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket whose accepted connections have TCP_NODELAY, for uvicorn:

        await uvicorn.Server(uvicorn.Config(app)).serve(sockets=[listen_socket(host, port)])

    proto=IPPROTO_TCP makes asyncio set TCP_NODELAY on each accepted socket; the listener's own
    TCP_NODELAY is also inherited by accepted sockets on Linux.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(address)
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
