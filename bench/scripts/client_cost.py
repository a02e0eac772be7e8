"""What the benchmark client costs per streamed token: bench.serve's client (bench/sse_client.py,
on microserve's lean HTTP client) against httpx's streaming, on one stub server.

    python bench/scripts/client_cost.py [--requests 400] [--concurrency 50,150] [--tokens 200]

The stub (this file with --serve PORT, its own process) answers every POST with `--tokens`
OpenAI completion chunks, one a millisecond per stream, then usage and [DONE]: no model, so
the client's own CPU is what is measured. For each concurrency it prints both clients' CPU
time per token (user + system of this process) and the tokens/s they took in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CHUNK = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1732800000,'
         b'"model":"m","choices":[{"index":0,"text":" tok","logprobs":null,'
         b'"finish_reason":null}]}\n\n')


async def serve(port: int) -> None:
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")

                def chunk(data: bytes) -> None:
                    writer.write(b"%x\r\n" % len(data) + data + b"\r\n")
                for _ in range(body["max_tokens"]):
                    chunk(CHUNK)
                    await asyncio.sleep(0.001)
                chunk(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n'
                      % body["max_tokens"])
                chunk(b"data: [DONE]\n\n")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def with_httpx(client, n_out: int) -> int:
    """httpx's streaming, as bench.serve read streams before bench/sse_client.py."""
    from bench.serve import sse_chunks

    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": n_out, "stream": True}
    tokens = 0
    async with client.stream("POST", "/completions", json=body) as resp:
        async for chunk in sse_chunks(resp):
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                time.perf_counter()
                tokens += 1
    return tokens


async def measure(url: str, kind: str, requests: int, concurrency: int, n_out: int
                  ) -> tuple[float, float]:
    import httpx

    from bench.serve import one
    from bench.sse_client import StreamClient

    gate = asyncio.Semaphore(concurrency)
    if kind == "httpx":
        client = httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=512))
        send = lambda: with_httpx(client, n_out)  # noqa: E731
    else:
        client = StreamClient(url)
        send = lambda: one(client, "m", [1, 2, 3], n_out)  # noqa: E731

    async def go():
        async with gate:
            result = await send()
            return result if isinstance(result, int) else len(result["times"])

    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tokens = sum(await asyncio.gather(*(go() for _ in range(requests))))
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    await client.aclose() if kind == "httpx" else client.close()
    assert tokens == requests * n_out, tokens
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu / tokens * 1e6, tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", default="50,150")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    import uvloop

    if args.serve is not None:
        uvloop.run(serve(args.serve))
        return
    stub = subprocess.Popen([sys.executable, __file__, "--serve", str(args.port)])
    try:
        time.sleep(1.5)
        url = f"http://127.0.0.1:{args.port}/v1"
        print("| in flight | client | CPU µs / token | tokens/s taken in |\n|---|---|---|---|")
        for c in (int(x) for x in args.concurrency.split(",")):
            for kind in ("httpx", "bench.serve"):
                us, rate = uvloop.run(measure(url, kind, args.requests, c, args.tokens))
                print(f"| {c} | {kind} | {us:.1f} | {rate:,.0f} |")
    finally:
        stub.terminate()
        stub.wait(10)


if __name__ == "__main__":
    main()
