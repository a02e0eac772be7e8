"""The router's HTTP/1.1 client (microserve/http_client.py) against byte-level test servers:
streamed chunked bodies, keep-alive reuse, connections the server closed, timeouts, bad answers.
"""

from __future__ import annotations

import asyncio
import contextlib

import httptools
import msgspec
import pytest

from microserve.http_client import ConnectionPool

OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\n"


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


class Server:
    """asyncio server whose `handler(server, conn_no, request_no, reader, writer)` answers each
    request; records the requests' heads and bodies and counts connections."""

    def __init__(self, handler):
        self.handler = handler
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection no., head, body)
        self.connections = 0
        self.closed_by_client = 0

    async def _serve(self, reader, writer):
        conn_no = self.connections
        self.connections += 1
        request_no = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))  # fmt: skip
                body = await reader.readexactly(length)
                self.requests.append((conn_no, head, body))
                if not await self.handler(self, conn_no, request_no, writer):
                    break
                request_no += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self):
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()


async def answer_ok(server, conn_no, request_no, writer) -> bool:
    writer.write(OK_HEAD + b"Content-Length: 5\r\n\r\nhello")
    return True


async def test_content_length_body_and_keep_alive():
    server = Server(answer_ok)
    async with server.running() as url:
        pool = ConnectionPool(url)
        for i in range(3):
            response = await pool.request(b"POST", f"/x?i={i}", b"Accept: a/b\r\n", b"body!")
            assert (response.status, response.content_type) == (200, "application/msgpack")
            assert await response.read(1.0) == b"hello"
            response.release()
        pool.close()
    assert server.connections == 1  # reused
    _, head, body = server.requests[2]
    assert head.startswith(b"POST /x?i=2 HTTP/1.1\r\nHost: 127.0.0.1:") and body == b"body!"
    assert b"\r\nContent-Length: 5\r\nAccept: a/b\r\n\r\n" in head


async def test_chunked_body_streams_piece_by_piece():
    release = asyncio.Event()

    async def stream(server, conn_no, request_no, writer) -> bool:
        writer.write(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"3\r\none\r\n")
        await release.wait()
        writer.write(b"3\r\ntwo\r\n0\r\n\r\n")
        return True

    async with Server(stream).running() as url:
        pool = ConnectionPool(url)
        response = await pool.request(b"POST", "/s", b"", b"")
        assert await response.next_data(1.0) == b"one"  # before the rest was sent
        assert not response.at_eof
        release.set()
        assert await response.next_data(1.0) == b"two"
        assert await response.next_data(1.0) is None and response.at_eof
        response.release()
        assert len(pool._idle) == 1


async def test_release_mid_stream_closes_the_connection():
    async def stream_forever(server, conn_no, request_no, writer) -> bool:
        writer.write(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"1\r\na\r\n")
        await asyncio.sleep(5)
        return False

    server = Server(stream_forever)
    async with server.running() as url:
        pool = ConnectionPool(url)
        response = await pool.request(b"POST", "/s", b"", b"")
        assert await response.next_data(1.0) == b"a"
        response.release()
        assert pool._idle == []
        pool.close()


async def test_server_closing_an_idle_connection_is_not_reused():
    async def answer_then_close(server, conn_no, request_no, writer) -> bool:
        await answer_ok(server, conn_no, request_no, writer)
        return False  # like a keep-alive timeout: close after the answer

    server = Server(answer_then_close)
    async with server.running() as url:
        pool = ConnectionPool(url)
        for _ in range(2):
            response = await pool.request(b"GET", "/", b"", None)
            assert await response.read(1.0) == b"hello"
            response.release()
            await asyncio.sleep(0.05)  # the close arrives
        pool.close()
    assert server.connections == 2 and len(server.requests) == 2


async def test_request_crossing_the_servers_close_is_sent_again_on_a_fresh_connection():
    async def close_second_request_unanswered(server, conn_no, request_no, writer) -> bool:
        if conn_no == 0 and request_no == 1:
            return False  # closes without a byte of answer
        await answer_ok(server, conn_no, request_no, writer)
        return True

    server = Server(close_second_request_unanswered)
    async with server.running() as url:
        pool = ConnectionPool(url)
        for _ in range(2):
            response = await pool.request(b"POST", "/", b"", b"x")
            assert await response.read(1.0) == b"hello"
            response.release()
        pool.close()
    assert [c for c, _, _ in server.requests] == [0, 0, 1]


async def test_a_fresh_connection_dropped_mid_answer_raises():
    async def half_answer(server, conn_no, request_no, writer) -> bool:
        writer.write(OK_HEAD + b"Content-Length: 100\r\n\r\npartial")
        return False

    server = Server(half_answer)
    async with server.running() as url:
        pool = ConnectionPool(url)
        response = await pool.request(b"POST", "/", b"", b"")
        with pytest.raises(ConnectionError):
            await response.read(1.0)
        response.release()
        assert pool._idle == []


async def test_a_fresh_connection_closed_unanswered_is_not_retried():
    async def close_unanswered(server, conn_no, request_no, writer) -> bool:
        return False

    server = Server(close_unanswered)
    async with server.running() as url:
        pool = ConnectionPool(url)
        with pytest.raises(ConnectionError):
            await pool.request(b"POST", "/", b"", b"x")
    assert len(server.requests) == 1  # sent once: only a reused connection is retried


async def test_read_timeout():
    async def never_answer(server, conn_no, request_no, writer) -> bool:
        await asyncio.sleep(5)
        return False

    async with Server(never_answer).running() as url:
        pool = ConnectionPool(url)
        with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
            await pool.request(b"GET", "/", b"", None, read_timeout_s=0.2)
        assert pool._idle == []


async def test_malformed_answer():
    async def garbage(server, conn_no, request_no, writer) -> bool:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        return True

    async with Server(garbage).running() as url:
        pool = ConnectionPool(url)
        with pytest.raises(httptools.HttpParserError):
            await pool.request(b"GET", "/", b"", None, read_timeout_s=1.0)


async def test_large_body_with_flow_control():
    body = bytes(range(256)) * (10 * 4096)  # 10 MiB: reading pauses and resumes

    async def big(server, conn_no, request_no, writer) -> bool:
        writer.write(OK_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        return True

    async with Server(big).running() as url:
        pool = ConnectionPool(url)
        response = await pool.request(b"POST", "/", b"", b"y" * 100_000)  # a two-write request
        await asyncio.sleep(0.2)  # let the socket fill the buffer past the high-water mark
        assert await response.read(1.0) == body
        response.release()
        assert len(pool._idle) == 1


async def test_retired_pool_still_sends_but_keeps_no_connection():
    server = Server(answer_ok)
    async with server.running() as url:
        pool = ConnectionPool(url)
        response = await pool.request(b"GET", "/", b"", None)
        assert await response.read(1.0) == b"hello"
        response.release()
        assert len(pool._idle) == 1
        pool.retire()
        assert pool._idle == []
        response = await pool.request(b"GET", "/", b"", None)
        assert await response.read(1.0) == b"hello"
        response.release()
        assert pool._idle == []
    assert server.connections == 2


async def test_refused_and_bad_urls():
    pool = ConnectionPool("http://127.0.0.1:1")
    with pytest.raises(ConnectionRefusedError):
        await pool.request(b"GET", "/", b"", None)
    with pytest.raises(ValueError, match="'ftp://x' is not an http:// or https:// URL"):
        ConnectionPool("ftp://x")
    pool.close()
    with pytest.raises(ConnectionError, match="pool is closed"):
        await pool.request(b"GET", "/", b"", None)


def test_chunks_read_together_are_handled_as_one():
    """A router that lags behind an engine finds several start_generate chunks in one read:
    they become one chunk (tokens and logprobs in order, the last finish_reason and usage, the
    first cached_tokens); an error after tokens raises once those tokens are out."""
    from microserve.backend import MicroservingError
    from microserve.messages import GenerateChunk, StreamError
    from microserve.microserving_client import _coalesced as coalesced

    def _coalesced(items):  # the items as the client decodes them off the wire: typed
        return coalesced([msgspec.convert(i, StreamError if "error" in i else GenerateChunk)
                          for i in items])

    lp = [{"token_id": 5, "logprob": -0.5, "top": [[5, -0.5]]}]
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    prompt_lp = [None, {"token_id": 4, "logprob": -1.5, "top": []}]
    items = [
        {"token_ids": [5], "logprobs": lp, "cached_tokens": 0, "prompt_logprobs": prompt_lp},
        {"token_ids": [6, 7], "logprobs": lp * 2, "prompt_logprobs": None},
        {"token_ids": [], "finish_reason": "length", "usage": usage},
    ]
    (chunk,) = _coalesced(items)
    assert chunk.token_ids == [5, 6, 7] and len(chunk.logprobs) == 3
    assert chunk.finish_reason == "length" and chunk.usage.completion_tokens == 3
    assert chunk.cached_tokens == 0
    assert chunk.prompt_logprobs[0] is None and chunk.prompt_logprobs[1].logprob == -1.5
    assert [c.token_ids for c in _coalesced([{"token_ids": [9]}])] == [[9]]
    assert list(_coalesced([])) == []
    got = []
    with pytest.raises(MicroservingError, match="boom"):
        for c in _coalesced([{"token_ids": [1]}, {"token_ids": [2]},
                             {"error": {"message": "boom", "type": "x"}, "status": 500}]):
            got.append(c.token_ids)
    assert got == [[1, 2]]
