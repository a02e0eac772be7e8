"""The bounds on every client connection of the HTTP servers (microserve/http_limits.py), on a
real uvicorn server in this event loop: deadlines on a request's head, its body and the idle
time between requests, the 431 for a head too long, the cap on open connections, and the
open-file limit fitted to that cap. Streams outlive every deadline."""

from __future__ import annotations

import asyncio
import gc
import contextlib
import json
import logging
import resource
import time

import httpx
import pytest

from microserve import http_limits
from microserve.http_limits import MAX_HEAD_BYTES, HttpLimits, fit_file_limit
from microserve.http_server import QuietServer, listen_socket

FAST = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=0.5)


async def app(scope, receive, send):
    """GET /health: "ok"; POST /echo: the body; GET /stream: ten chunks over 1.5 s."""
    if scope["type"] != "http":
        return
    body = b""
    while (message := await receive())["type"] == "http.request":
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    else:
        return  # the client went away
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(10):
            await send({"type": "http.response.body", "body": b"%d\n" % i, "more_body": True})
            await asyncio.sleep(0.15)
        await send({"type": "http.response.body", "body": b""})
        return
    body = body or b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(limits: HttpLimits):
    sock = listen_socket("127.0.0.1", 0)
    server = QuietServer.serving(app, "warning", limits)
    server.config.lifespan = "off"
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task.result()
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        await task


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_after(reader: asyncio.StreamReader, start: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (after `start`)."""
    data = await asyncio.wait_for(reader.read(), 5)
    return data, time.monotonic() - start


async def echoed(reader: asyncio.StreamReader, body: bytes) -> None:
    """The next answer on the connection is a 200 echoing `body`."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.split()[1] == b"200", head
    assert await asyncio.wait_for(reader.readexactly(len(body)), 5) == body


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


async def test_a_connection_that_sends_nothing_is_closed_silently_at_the_header_deadline():
    async with serving(FAST) as (port, _):
        start = time.monotonic()
        reader, writer = await connect(port)
        data, elapsed = await closed_after(reader, start)
        assert data == b"" and 0.45 <= elapsed < 1.0, elapsed
        writer.close()


async def test_a_head_sent_a_line_at_a_time_is_cut_at_the_header_deadline_with_408():
    async with serving(FAST) as (port, _):
        start = time.monotonic()
        reader, writer = await connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")

        async def trickle():
            with contextlib.suppress(ConnectionError):
                for i in range(20):  # each line well within the deadline; the head never ends
                    await asyncio.sleep(0.1)
                    writer.write(b"X-Slow-%d: 1\r\n" % i)
                    await writer.drain()

        trickling = asyncio.create_task(trickle())
        data, elapsed = await closed_after(reader, start)
        trickling.cancel()
        assert 0.45 <= elapsed < 1.0, elapsed
        assert error_of(data) == (408, {
            "message": "The request's headers did not arrive within 0.5 s",
            "type": "invalid_request_error", "param": None, "code": "request_timeout"})
        writer.close()


async def test_a_body_sent_a_byte_at_a_time_is_cut_at_the_body_deadline_with_408():
    async with serving(FAST) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        start = time.monotonic()

        async def trickle():
            with contextlib.suppress(ConnectionError):
                for _ in range(100):
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        data, elapsed = await closed_after(reader, start)
        trickling.cancel()
        assert 0.45 <= elapsed < 1.0, elapsed
        assert error_of(data)[1]["message"] == "The request's body did not arrive within 0.5 s"
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed_and_a_stream_outlives_every_deadline():
    async with serving(FAST) as (port, _), httpx.AsyncClient() as client:
        start = time.monotonic()
        r = await client.get(f"http://127.0.0.1:{port}/stream")  # 1.5 s: three deadlines' worth
        assert r.text == "".join(f"{i}\n" for i in range(10))
        assert time.monotonic() - start > 1.3
        r = await client.post(f"http://127.0.0.1:{port}/echo", content=b"x" * 300_000)
        assert r.content == b"x" * 300_000
    async with serving(FAST) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        data, elapsed = await closed_after(reader, start)
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")
        assert 0.45 <= elapsed < 1.0, elapsed  # keep_alive_s after the answer
        writer.close()


async def test_a_head_longer_than_the_limit_gets_431():
    async with serving(HttpLimits()) as (port, _):
        reader, writer = await connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(MAX_HEAD_BYTES // 1000 + 100):  # never ends, unless stopped
                writer.write(b"X-Big: " + b"b" * 1000 + b"\r\n")
                await writer.drain()
        data, _ = await closed_after(reader, time.monotonic())
        assert error_of(data) == (431, {
            "message": f"The request's line and headers are longer than the {MAX_HEAD_BYTES} "
                       "bytes this server reads",
            "type": "invalid_request_error", "param": None, "code": "headers_too_large"})
        writer.close()


async def test_a_whole_request_in_one_read_is_not_taken_for_a_long_head():
    """A short head with a body past the head limit, arriving whole in one read (a 32k-token
    prompt's body on loopback): answered, not refused as a head too long (the bytes of a
    chunk in which a whole request began and ended are not head bytes)."""
    body = b"x" * (2 * MAX_HEAD_BYTES)
    async with serving(HttpLimits()) as (port, _):
        reader, writer = await connect(port)
        for _ in range(2):  # and again on the same connection
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            await writer.drain()
            await echoed(reader, body)
        writer.close()


async def test_a_long_head_read_whole_with_its_body_gets_431_and_a_split_blank_line_is_head():
    """The head limit counts the head's bytes wherever the reads cut: a head past the limit
    arriving in one read with its body is refused; a head whose blank line is cut between
    two reads, the second carrying a body past the limit, is answered."""
    body = b"x" * (2 * MAX_HEAD_BYTES)
    async with serving(HttpLimits()) as (port, _):
        reader, writer = await connect(port)
        big = b"X-Big: " + b"b" * (MAX_HEAD_BYTES + 10) + b"\r\n"
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + big
                     + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        data, _ = await closed_after(reader, time.monotonic())
        assert error_of(data)[0] == 431
        writer.close()
        reader, writer = await connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r" % len(body))
        await writer.drain()
        await asyncio.sleep(0.1)  # its own read
        writer.write(b"\n" + body)
        await writer.drain()
        await echoed(reader, body)
        writer.close()


async def test_past_the_connection_cap_a_new_connection_gets_503_and_the_open_ones_go_on():
    async with serving(HttpLimits(max_connections=3)) as (port, server):
        url = f"http://127.0.0.1:{port}"
        held = [await connect(port) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert len(server.server_state.connections) == 3
        # From other threads, as clients in other processes: their request is often in the
        # server's socket before the 503 is written, and still they read the 503, not a reset.
        answers = await asyncio.gather(*(asyncio.to_thread(httpx.get, url + "/health")
                                         for _ in range(20)))
        assert {r.status_code for r in answers} == {503}
        r = answers[0]
        assert (r.headers["retry-after"], r.headers["connection"]) == ("1", "close")
        assert r.json()["error"] == {
            "message": "This server holds its limit of 3 open connections; retry shortly",
            "type": "server_error", "param": None, "code": "too_many_connections"}
        reader, writer = held[0]  # a connection that was open before still gets its answer
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient() as client:  # and one freed slot takes a new one
            assert (await client.get(url + "/health")).status_code == 200
        for _, writer in held[1:]:
            writer.close()


async def test_a_started_server_takes_what_start_up_left_out_of_full_collections():
    # microserve/heap.py: a full collection walks every tracked object the process holds
    gc.unfreeze()
    made_before = [[i] for i in range(1000)]
    try:
        async with serving(FAST):
            frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert frozen >= len(made_before), frozen


def test_limits_name_the_field_and_the_bound():
    with pytest.raises(ValueError, match=r"max_connections 0 must be in \[1, 1000000\]"):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError, match=r"body_timeout_s inf must be in \(0, 86400\] seconds"):
        HttpLimits(body_timeout_s=float("inf"))


@pytest.mark.parametrize("soft, hard, raised_to, fits", [
    (1024, 1 << 20, 512 + 3 * 4096, 4096),  # raised to what the cap needs
    (1024, 4096, 4096, (4096 - 512) // 3),  # only to the hard limit: the cap is lowered
    (50_000, 1 << 20, None, 4096),  # enough already: left alone
    (1024, resource.RLIM_INFINITY, 512 + 3 * 4096, 4096),
])
def test_the_open_file_limit_is_raised_to_what_the_cap_needs(monkeypatch, caplog, soft, hard,
                                                             raised_to, fits):
    calls = []
    monkeypatch.setattr(http_limits.resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(http_limits.resource, "setrlimit", lambda which, pair: calls.append(pair))
    with caplog.at_level(logging.INFO, logger="microserve.http_limits"):
        limits = fit_file_limit(HttpLimits(), fds_per_connection=3)
    assert limits == HttpLimits(max_connections=fits)
    assert calls == ([] if raised_to is None else [(raised_to, hard)])
    if fits < 4096:
        assert f"holds {fits} connections, not the 4096 asked for" in caplog.text


# -- where the limits are set: `microserve engine` and `router` options, the deployment file ---

def test_engine_and_router_options_and_the_deployment_file_set_the_limits(tmp_path):
    from launcher.cli import _http_limits, parser
    from launcher.deployment import load_deployment

    want = HttpLimits(max_connections=10_000, header_timeout_s=5, body_timeout_s=30,
                      keep_alive_s=20)
    options = ["--max-connections", "10000", "--header-timeout-s", "5", "--body-timeout-s", "30",
               "--keep-alive-s", "20"]
    assert _http_limits(parser().parse_args(["engine", *options])) == want
    assert _http_limits(parser().parse_args(["router", "--engine=e=http://e:1", *options])) == want
    assert _http_limits(parser().parse_args(["engine"])) == HttpLimits()

    config = tmp_path / "deploy.toml"
    engines = '[[engines]]\nname = "e"\n'
    config.write_text(engines)
    assert load_deployment(config).http_limits == HttpLimits()
    config.write_text("[router]\nmax_connections = 10000\nheader_timeout_s = 5\n"
                      "body_timeout_s = 30\nkeep_alive_s = 20\n" + engines)
    assert load_deployment(config).http_limits == want
    for line, message in [("max_connections = 0", "max_connections 0 must be in"),
                          ("max_connections = 1.5",
                           "max_connections must be a whole number, got 1.5"),
                          ('keep_alive_s = "long"',
                           "keep_alive_s must be a number of seconds, got 'long'")]:
        config.write_text(f"[router]\n{line}\n" + engines)
        with pytest.raises(ValueError, match=f"deploy.toml \\[router\\]: {message}"):
            load_deployment(config)


DOUBLE_CTRL_C = '''
import asyncio, os, signal
from fastapi import FastAPI
from microserve.http_server import QuietServer, listen_socket

async def main():
    server = QuietServer.serving(FastAPI(), "info")
    serving = asyncio.create_task(server.serve(sockets=[listen_socket("127.0.0.1", 0)]))
    while not server.started:
        await asyncio.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: uvicorn exits at once
    await serving
    print("stopped", flush=True)

asyncio.run(main())
'''


def test_a_second_ctrl_c_stops_the_server_without_a_traceback():
    """Ctrl-C twice (a user who presses it again, or a signal to `timeout` and its child):
    uvicorn skips its graceful steps, and a lifespan task left behind was cancelled at exit
    with a CancelledError traceback on the terminal. The server serves no lifespan."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", DOUBLE_CTRL_C], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Finished server process" in done.stderr
