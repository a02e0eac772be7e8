"""The benchmarks' client for OpenAI streams, on microserve's lean HTTP/1.1 client
(microserve/http_client.py), not httpx.

    client = StreamClient("http://127.0.0.1:8000/v1", {"Authorization": "Bearer KEY"})
    response = await client.post("/completions", body)       # status and headers arrived
    async for arrived, payloads in sse_payloads(response):   # each read's `data:` payloads
        ...
    client.close()

A benchmark's client must not be what limits the rate it measures. httpx's streaming spends
~60 µs of CPU on each server-sent event at 50 streams in flight and ~105 µs at 150 (one
process, uvloop, against a stub server on the project's CPU machine, 2026-11-28), so one
client process tops out near 9,500 streamed tokens/s: four H200s serving chat-like requests at
16 req/s each were already past it. The lean client parses with httptools' C parser and hands
over each read's bytes whole: ~8 µs an event in the same setup (docs/benchmarks.md, "The
benchmark client").
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from microserve.http_client import ConnectionPool, Response


class StreamClient:
    """POSTs JSON to paths under `base_url` (e.g. http://host:8000/v1) with `headers` on each
    request; any number of requests in flight, connections kept alive."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 connect_timeout_s: float = 30.0):
        url = urlsplit(base_url)
        self.prefix = url.path.rstrip("/")
        self.pool = ConnectionPool(f"{url.scheme}://{url.netloc}",
                                   connect_timeout_s=connect_timeout_s, max_idle=4096)
        fields = {"Content-Type": "application/json", **(headers or {})}
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode()

    async def post(self, path: str, body: dict) -> Response:
        """The answer to POST `path` with `body` as JSON, its body still to read; release it
        when done (a body not read to its end closes the connection: the server sees the
        client go away)."""
        return await self.pool.request(b"POST", self.prefix + path, self._headers,
                                       json.dumps(body).encode())

    async def get_json(self, path: str):
        response = await self.pool.request(b"GET", self.prefix + path, self._headers, None)
        try:
            body = await response.read()
        finally:
            response.release()
        if response.status != 200:
            raise OSError(f"GET {self.prefix + path}: {response.status} {body[:200]!r}")
        return json.loads(body)

    def close(self) -> None:
        self.pool.close()


async def sse_payloads(response: Response) -> AsyncIterator[tuple[float, list[bytes]]]:
    """(perf_counter when the read arrived, the `data:` payloads it completed) for each read of
    a server-sent-event stream, up to its end; `[DONE]` is not a payload."""
    pending = b""
    while (data := await response.next_data()) is not None:
        arrived = time.perf_counter()
        *events, pending = (pending + data).split(b"\n\n")
        payloads = [e[6:] for e in events if e.startswith(b"data: ") and e != b"data: [DONE]"]
        if payloads:
            yield arrived, payloads
