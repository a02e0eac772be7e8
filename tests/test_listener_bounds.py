"""Slow connections against a live P/D deployment (docs/router.md, "Connections: deadlines and a
cap"): 300 slowloris sockets against the router's HTTP server and 300 against the decode engine's
tcp KV listener. Meanwhile /health and a real request (its KV sent over that same listener, on a
connection opened during the flood) answer promptly; every slow socket is closed by its deadline;
the decode engine's core starts no thread for them, and the router's descriptors go back to what
they were."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path

import httpx
import pytest
from daemons import ENGINE_KEY, Daemon, free_port, serve
from deployments import RouterProcess

from kvcache.transfer.tcp_listener import HANDSHAKE_TIMEOUT_S, MAX_PENDING
from kvcache.transfer.tcp_wire import LENGTH

pytestmark = pytest.mark.slow

ENGINE_ARGS = ("--num-pages", "64", "--max-model-len", "256", "--api-key", ENGINE_KEY)
HEAD_S = BODY_S = 2.0  # the router's deadlines here (default 10 s and 60 s)
N = 300  # slow sockets against each listener
SLACK_S = 1.5  # a deadline's timer fires on a busy 2-core machine
PROMPT = list(range(5, 45))  # token ids: P computes 40 tokens' KV and sends it to D


@contextlib.contextmanager
def serving(daemon: Daemon):
    """daemons.serve as a context: ready inside, stopped (and checked) after."""
    body = serve(daemon)
    yield next(body)
    next(body, None)


@pytest.fixture(scope="module")
def deployment(tiny_served_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounds")
    kv_port = free_port()
    with contextlib.ExitStack() as stack:
        # Both engines boot at once; each is stopped even if the other never gets ready.
        d = Daemon(tiny_served_dir, tmp / "d.log", "d", *ENGINE_ARGS, "--kv-transfer", "tcp",
                   "--kv-transfer-port", str(kv_port))
        stack.callback(d.stop)
        p = Daemon(tiny_served_dir, tmp / "p.log", "p", *ENGINE_ARGS)
        stack.callback(p.stop)
        stack.enter_context(serving(d))
        stack.enter_context(serving(p))
        router = RouterProcess(tiny_served_dir, {"p": p.url + ",prefill", "d": d.url + ",decode"},
                               tmp / "router.log", "--strategy", "pd",
                               "--header-timeout-s", str(HEAD_S), "--body-timeout-s", str(BODY_S))
        stack.callback(router.stop)
        router.wait_ready()
        yield router, d, kv_port


def threads(pid: int) -> int:
    return int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1])


def descriptors(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


class Slow:
    """One slow client: sends `head`, then `drip` one byte every 0.5 s until the server closes
    the connection; records what the server sent and how long after the connect it closed."""

    def __init__(self, port: int, head: bytes, drip: bytes, source: str = "127.0.0.1"):
        self.port, self.head, self.drip, self.source = port, head, drip, source
        self.answer, self.closed_after = b"", None

    async def run(self) -> None:
        opened = time.monotonic()  # before the accept: a lifetime measured from here is no less
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                       local_addr=(self.source, 0))
        writer.write(self.head)
        dripping = asyncio.create_task(self._drip(writer))
        try:
            while data := await reader.read(4096):
                self.answer += data
        except ConnectionResetError:
            pass
        self.closed_after = time.monotonic() - opened
        dripping.cancel()
        writer.close()

    async def _drip(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            for byte in self.drip:
                await asyncio.sleep(0.5)
                writer.write(bytes([byte]))
                await writer.drain()


async def test_slow_connections_are_closed_by_their_deadlines_while_serving_goes_on(deployment):
    router, d, kv_port = deployment
    core = d.core_pid()
    core_threads, router_fds = threads(core), descriptors(router.proc.pid)
    port = int(router.url.rsplit(":", 1)[1])
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    slow = ([Slow(port, b"", b"") for _ in range(N // 3)]  # sends nothing
            + [Slow(port, request, b"X-Slow: 1\r\n" * 20) for _ in range(N // 3)]  # a slow head
            + [Slow(port, request + b"Content-Length: 1000\r\n\r\n", b"{" * 20)  # a slow body
               for _ in range(N // 3)])
    # Hellos to the KV listener that never end, from 30 addresses (10 each, under the per-
    # address cap): past MAX_PENDING the oldest are closed to make room, the rest at the deadline.
    hellos = [Slow(kv_port, b"", LENGTH.pack(1000) + b"x" * 30, f"127.0.5.{i % 30 + 1}")
              for i in range(N)]
    flood = [asyncio.create_task(s.run()) for s in slow + hellos]
    await asyncio.sleep(0.5)  # all connected, heads and hellos begun
    assert threads(core) == core_threads  # N connections to the KV listener, no thread for one

    async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
        start = time.monotonic()
        health = await client.get("/health")
        health_s = time.monotonic() - start
        start = time.monotonic()
        # P/D: P's first send to D opens its connection to D's listener now, through the flood.
        completion = await client.post("/v1/completions", json={
            "model": "test-model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        completion_s = time.monotonic() - start
        assert health.status_code == 200 and health_s < 1.0, (health.text, health_s)
        assert completion.status_code == 200, completion.text
        assert completion_s < 3.0, completion_s
        assert completion.json()["usage"]["completion_tokens"] == 4
        metrics = (await client.get("/metrics")).text
        assert ('microserve_router_stage_seconds_count{strategy="PrefillDecode",'
                'stage="remote_send"} 1') in metrics  # the KV went from P to D over tcp
        assert threads(core) <= core_threads + 1  # P's authenticated connection has one

        await asyncio.wait_for(asyncio.gather(*flood), HANDSHAKE_TIMEOUT_S + 5)
        # Every slow socket was closed by the server, at its deadline at the latest.
        assert max(s.closed_after for s in slow) < max(HEAD_S, BODY_S) + SLACK_S
        assert min(s.closed_after for s in slow) > min(HEAD_S, BODY_S) - 0.1
        assert [s.answer for s in slow[:N // 3]] == [b""] * (N // 3)  # never spoke: no answer
        assert {s.answer.split(b"\r\n", 1)[0] for s in slow[N // 3:]} == {
            b"HTTP/1.1 408 Request Timeout"}
        assert max(s.closed_after for s in hellos) < HANDSHAKE_TIMEOUT_S + SLACK_S
        made_room = [s for s in hellos if s.closed_after < HANDSHAKE_TIMEOUT_S - 1]
        assert len(made_room) >= N - MAX_PENDING
        assert all(b"too many connections awaiting their handshake" in s.answer
                   for s in made_room)
        assert threads(core) <= core_threads + 1
        assert descriptors(router.proc.pid) <= router_fds + 8  # ours, pooled engine calls
        again = await client.post("/v1/completions", json={  # greedy: the same tokens
            "model": "test-model", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert again.json()["choices"] == completion.json()["choices"]
