"""bench/sse_client.py: server-sent events split across reads come out whole, once, in order;
[DONE] and comments are not payloads; each read's payloads carry the time it arrived."""

from __future__ import annotations

import asyncio

from bench.sse_client import sse_payloads


class _Reads:
    """A Response whose body arrives in the given pieces."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = list(pieces)

    async def next_data(self, read_timeout_s=None):
        await asyncio.sleep(0)
        return self.pieces.pop(0) if self.pieces else None


def test_events_split_across_reads_come_out_whole_and_in_order():
    reads = [b'data: {"a":1}\n', b'\ndata: {"b"', b':2}\n\n: keep-alive\n\ndata: {"c":3}\n\n',
             b"data: [DONE]\n\n"]

    async def collect():
        return [(arrived, payloads) async for arrived, payloads in sse_payloads(_Reads(reads))]

    got = asyncio.run(collect())
    assert [payloads for _, payloads in got] == [[b'{"a":1}'], [b'{"b":2}', b'{"c":3}']]
    assert got[0][0] < got[1][0]  # perf_counter at each read
