"""Bounds on every client connection of a router's or an engine's HTTP server.

uvicorn alone keeps a connection open for as long as its client likes: a connection that sends
nothing, a request head that never ends, a body that trickles in a byte at a time (1,000 such
sockets against the router were all still open after 120 s; docs/router.md, "Connections"). Its
`limit_concurrency` is no cap on them either: it counts idle connections too and answers 503 only
once a request head has arrived, so it bounds neither descriptors nor slow clients, and past it
every request, /health's included, fails while the slow sockets stay. Here each connection is
bounded as it goes (microserve/http_server.py's BoundedHttpProtocol: uvicorn's httptools protocol
with deadlines). No uvicorn here: the command line reads the defaults without importing a server.

    accept ─▶ request head ─────▶ body ──────────▶ app answers, streams ─▶ idle ─▶ next head ...
              header_timeout_s     body_timeout_s   (no limit: a stream      keep_alive_s
              from the accept, or  from the end     lasts what it lasts)     from the response's
              the head's 1st byte  of the head                               end to the 1st byte

- past a deadline the connection is closed: with a 408 when a request had begun and no answer
  had started, silently when it never sent a byte or went quiet between requests;
- a request head (request line and headers) longer than MAX_HEAD_BYTES gets a 431 and a close;
- a connection closed with an answer (408, 431, 503) first lingers up to LINGER_S, its bytes
  dropped, so that the client reads the answer instead of a reset;
- at most `max_connections` are open at once: a connection past it gets a 503 with Retry-After
  as soon as it is accepted, and is closed. Streams already open are not touched; but /health
  is refused past the cap like any request, so size the cap above the streams you expect;
- at start `fit_file_limit` raises the process's soft RLIMIT_NOFILE to what the cap needs (up
  to the hard limit) and logs it; where the hard limit holds fewer connections, the cap is
  lowered to what fits, with a warning, so the server refuses cleanly instead of failing
  accept() and its own calls out of descriptors.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10  # request line and headers; h11's default is 16 KiB, nginx's 32 KiB
RESERVED_FDS = 256  # what a process holds besides its clients' connections: files, pipes, DNS
LINGER_S = 1.0  # how long a connection answered with an error may still send (_close_with)
MAX_LINGERING = 256  # connections lingering at once; counted in the open-file limit


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP server allows each client connection (`microserve engine` and `router`
    options, the deployment file's [router] keys); the defaults leave room for thousands of
    streams and for any client that is not deliberately slow."""

    max_connections: int = 4096  # open at once; a new one past it gets a 503
    header_timeout_s: float = 10.0  # accept (or a request's first byte) to the end of its head
    body_timeout_s: float = 60.0  # end of the head to the end of the body (32 MiB at 0.5 MB/s)
    # Between a response and the next request. Longer than the clients' own reuse window
    # (httpx and the openai client: 5 s, aiohttp: 15 s): with uvicorn's default of 5 s, a client
    # could send a request on a connection just as the server closed it, and see it fail with a
    # read error (the likely cause of one such error in 180 requests through bench.strategies).
    keep_alive_s: float = 75.0

    def __post_init__(self):
        if not 1 <= self.max_connections <= 1_000_000:
            raise ValueError(f"max_connections {self.max_connections} must be in "
                             "[1, 1000000]")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if not 0 < value <= 86400:
                raise ValueError(f"{name} {value} must be in (0, 86400] seconds")


def fit_file_limit(limits: HttpLimits, fds_per_connection: int) -> HttpLimits:
    """Raise the soft open-file limit to what `limits.max_connections` connections need, each
    holding `fds_per_connection` descriptors, up to the hard limit; log what it is now.

    Returns:
        `limits`, with max_connections lowered to what the limit holds where it holds fewer.
    """
    needed = RESERVED_FDS + MAX_LINGERING + fds_per_connection * limits.max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < needed:
        raised = needed if hard == infinite else min(needed, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            log.info("open-file limit raised from %d to %d (hard limit %s) for %d connections "
                     "of %d descriptors each", soft, raised, _show(hard),
                     limits.max_connections, fds_per_connection)
            soft = raised
    else:
        log.info("open-file limit %s (hard limit %s): enough for %d connections of %d "
                 "descriptors each", _show(soft), _show(hard), limits.max_connections,
                 fds_per_connection)
    if soft == infinite or soft >= needed:
        return limits
    fits = max(1, (soft - RESERVED_FDS - MAX_LINGERING) // fds_per_connection)
    log.warning("the hard open-file limit (%d) holds %d connections, not the %d asked for: "
                "serving at most %d (raise the hard limit, e.g. LimitNOFILE= or ulimit -Hn, "
                "to allow more)", hard, fits, limits.max_connections, fits)
    return replace(limits, max_connections=fits)


def _show(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
