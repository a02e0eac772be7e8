"""Load generator for any OpenAI-compatible completions endpoint (microserve, vLLM, SGLang).

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 --num-requests 200 \\
        --request-rate 4 --input-len 128:2048 --output-len 128:1024 [--concurrency 1]

Prompts are random token ids (sent as `prompt: [ids]`, which vLLM, SGLang and microserve
accept), so no tokenizer or dataset is needed and lengths are exact; `ignore_eos` makes every
request produce exactly its output length. Arrivals are Poisson at --request-rate requests/s
(or all at once with `inf`), optionally capped at --concurrency requests in flight. Streams
every request and reports, over all requests: TTFT, TPOT (per request: time after the first
token / (tokens - 1)), ITL (every gap between chunks), end-to-end latency — p50/p90/p99 and
mean — and request and token throughput, and the client's own CPU time (when it nears the
wall time, the client, not the server, set the pace).

With --abort-fraction F, that share of the requests (chosen at random) is abandoned by the client
after a delay drawn from --abort-after LO:HI seconds: the connection closes mid-request, as a
user who gives up does. They are counted as `aborted` (or as answered, if they finished first)
and left out of the latency figures; `failed` counts only the requests nobody abandoned.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import time

import httpx


# Reuse an idle connection only this long: below servers' keep-alive timeouts (uvicorn's
# default, which vLLM keeps: 5 s), so a request never goes out on a connection the server is
# closing at that moment.
CLIENT_KEEP_ALIVE_S = 3.0


async def sse_chunks(resp: httpx.Response):
    """The JSON chunks of an OpenAI server-sent-events stream, up to `data: [DONE]`."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], n_out: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", "/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"{resp.status_code} {(await resp.aread())[:200]!r}"}
        async for chunk in sse_chunks(resp):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    return {
        "ttft": times[0] - start if times else float("nan"),
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 and times else float("nan"),
        "itl": [b - a for a, b in zip(times, times[1:])],
        "e2e": end - start,
        "prompt_tokens": len(prompt),
        "output_tokens": n,
    }


def pct(values: list[float]) -> dict:
    v = sorted(x for x in values if x == x)
    if not v:
        return {}
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"mean_ms": statistics.fmean(v) * 1e3, "p50_ms": at(0.5) * 1e3,
            "p90_ms": at(0.9) * 1e3, "p99_ms": at(0.99) * 1e3}


async def run(args) -> dict:
    rng = random.Random(args.seed)
    lo_in, hi_in = span(args.input_len)
    lo_out, hi_out = span(args.output_len)
    work = [([rng.randrange(args.vocab) for _ in range(rng.randint(lo_in, hi_in))],
             rng.randint(lo_out, hi_out)) for _ in range(args.num_requests)]  # fmt: skip
    limit = asyncio.Semaphore(args.concurrency or args.num_requests)
    limits = httpx.Limits(max_connections=args.concurrency or args.num_requests,
                          keepalive_expiry=CLIENT_KEEP_ALIVE_S)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=3600, limits=limits,
                                 headers=headers) as client:
        model = args.model or (await client.get("/models")).json()["data"][0]["id"]
        await one(client, model, work[0][0][:16], 4)  # warm-up

        lo_abort, hi_abort = (float(x) for x in args.abort_after.split(":"))

        async def guarded(prompt, n_out, abort: bool):
            async with limit:
                if not abort:
                    return await one(client, model, prompt, n_out)
                try:
                    return await asyncio.wait_for(one(client, model, prompt, n_out),
                                                  rng.uniform(lo_abort, hi_abort))
                except asyncio.TimeoutError:
                    return {"aborted": True}

        tasks = []
        start, cpu = time.perf_counter(), time.process_time()
        for prompt, n_out in work:
            abort = rng.random() < args.abort_fraction
            tasks.append(asyncio.create_task(guarded(prompt, n_out, abort)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
    aborted = sum(1 for r in results if r.get("aborted"))
    results = [r for r in results if not r.get("aborted")]
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests": len(results) + aborted, "aborted": aborted,
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if "error" in r][:3],
        "wall_s": wall, "request_throughput": len(ok) / wall,
        # this client's own CPU time over the run: near wall_s, it was the bottleneck itself
        "client_cpu_s": cpu,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (in_tokens + out_tokens) / wall,
        "ttft": pct([r["ttft"] for r in ok]), "tpot": pct([r["tpot"] for r in ok]),
        "itl": pct([x for r in ok for x in r["itl"]]), "e2e": pct([r["e2e"] for r in ok]),
    }  # fmt: skip


def _default_loop() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second; inf sends all at once")
    ap.add_argument("--concurrency", type=int, default=0, help="max in flight (0: no cap)")
    ap.add_argument("--input-len", default="1024", help="N or LO:HI (uniform)")
    ap.add_argument("--output-len", default="128", help="N or LO:HI (uniform)")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are < this")
    ap.add_argument("--abort-fraction", type=float, default=0.0,
                    help="share of requests the client abandons mid-way")
    ap.add_argument("--abort-after", default="0.5:5",
                    help="LO:HI seconds after which an abandoned request is cut off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--event-loop", choices=("uvloop", "asyncio"), default=_default_loop(),
                    help="the client's event loop (default: uvloop when installed; one "
                         "core parses every stream's chunks, and asyncio's loop costs more "
                         "per chunk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.event_loop == "uvloop":
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    result["args"] = vars(args) | {"request_rate": str(args.request_rate)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
