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

Lengths (--input-len, --output-len) are N, LO:HI (uniform) or lognormal:MEAN:SIGMA (a
log-normal with that mean and log-space sigma, clipped to [1, --max-len]). `--workload
heavy-tail` is the scheduling benchmark's (bench/policies.py): prompts lognormal:512:1.0
(mixed: half are under ~310 tokens, one in twenty over ~1,600) and outputs lognormal:128:1.2
(heavy-tailed: the median ~62 tokens, one in a hundred over ~1,000), as FastServe's workloads
have a long tail of long jobs behind many short ones. Every figure is reported as mean and
p50/p90/p99; JCT (job completion time) is a request's end-to-end latency.

With --priority-by output-len each request carries `priority` = its output length (shortest
job first, an oracle a real client rarely has): for engines run with --scheduling-policy
priority.

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
import math
import os
import random
import statistics
import time

import httpx
import msgspec

from bench.slo import SLO
from bench.sse_client import StreamClient, sse_payloads


async def sse_chunks(resp: httpx.Response):
    """The JSON chunks of an OpenAI server-sent-events stream, up to `data: [DONE]`."""
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


_decode = msgspec.json.Decoder().decode

WORKLOADS = {"heavy-tail": ("lognormal:512:1.0", "lognormal:128:1.2")}


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def draw_len(rng: random.Random, spec: str, max_len: int) -> int:
    """A length by `spec`: N, LO:HI (uniform) or lognormal:MEAN:SIGMA, within [1, max_len]."""
    if spec.startswith("lognormal:"):
        mean, sigma = (float(x) for x in spec.removeprefix("lognormal:").split(":"))
        mu = math.log(mean) - sigma * sigma / 2  # a log-normal's mean is exp(mu + sigma^2 / 2)
        return min(max(round(rng.lognormvariate(mu, sigma)), 1), max_len)
    lo, hi = span(spec)
    return rng.randint(lo, hi)


def workload(args) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request: the same for the same args and seed."""
    rng = random.Random(args.seed)
    in_spec, out_spec = WORKLOADS.get(args.workload, (args.input_len, args.output_len))
    lengths = [(draw_len(rng, in_spec, args.max_len), draw_len(rng, out_spec, args.max_len))
               for _ in range(args.num_requests)]
    # --prompt-seed: the same lengths and arrivals with other token ids (runs compared on one
    # deployment must not hit each other's prefix cache)
    prompt_seed = getattr(args, "prompt_seed", None)
    if prompt_seed is not None:
        rng = random.Random(f"prompts/{prompt_seed}")
    return [([rng.randrange(args.vocab) for _ in range(n_in)], n_out) for n_in, n_out in lengths]


async def one(client: StreamClient, model: str, prompt: list[int], n_out: int,
              priority: int | None = None) -> dict:
    """One streamed completion; when each token arrived, and its figures. Raises OSError (or
    httptools.HttpParserError) if the connection fails."""
    body = {"model": model, "prompt": prompt, "max_tokens": n_out, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    times, usage = [], None
    response = await client.post("/completions", body)
    try:
        if response.status != 200:
            return {"error": f"{response.status} {(await response.read())[:200]!r}"}
        async for arrived, payloads in sse_payloads(response):
            for payload in payloads:
                chunk = _decode(payload)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices")
                if choices and choices[0].get("text"):
                    times.append(arrived)
    finally:
        response.release()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    return {
        "ttft": times[0] - start if times else float("nan"),
        "tpot": (times[-1] - times[0]) / (n - 1) if n > 1 and times else float("nan"),
        "itl": [b - a for a, b in zip(times, times[1:])],
        "times": times,  # perf_counter at each chunk with text (bench.peers windows on them)
        "e2e": end - start,
        "sent": start,
        "prompt_tokens": len(prompt),
        "output_tokens": n,
    }


def write_requests(path: str, results: list[dict], start: float) -> None:
    """One JSON line a request, in the order they were sent: when (s after the first), its
    TTFT, TPOT and end-to-end time (ms) and lengths; or that it was aborted, or its error.
    What a tail is made of: which requests, arriving when, beside which others."""
    with open(path, "w") as f:
        for i, r in enumerate(results):
            if r.get("aborted") or "error" in r:
                line = {"i": i, **({"aborted": True} if r.get("aborted") else
                                   {"error": r["error"]})}
            else:
                line = {"i": i, "sent_s": round(r["sent"] - start, 6),
                        "ttft_ms": round(r["ttft"] * 1e3, 3),
                        "tpot_ms": None if r["tpot"] != r["tpot"] else round(r["tpot"] * 1e3, 4),
                        "e2e_ms": round(r["e2e"] * 1e3, 3),
                        "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"]}
            f.write(json.dumps(line) + "\n")


def pct(values: list[float]) -> dict:
    v = sorted(x for x in values if x == x)
    if not v:
        return {}
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"mean_ms": statistics.fmean(v) * 1e3, "p50_ms": at(0.5) * 1e3,
            "p90_ms": at(0.9) * 1e3, "p99_ms": at(0.99) * 1e3}


async def run(args, slo: SLO | None = None, gpus: int = 1) -> dict:
    """Send the workload; its figures, with the goodput per GPU of `gpus` under `slo` if given."""
    work = workload(args)
    rng = random.Random(f"{args.seed}/arrivals")
    limit = asyncio.Semaphore(args.concurrency or args.num_requests)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = StreamClient(args.base_url, headers)
    try:
        model = args.model or (await client.get_json("/models"))["data"][0]["id"]
        await one(client, model, work[0][0][:16], 4)  # warm-up

        lo_abort, hi_abort = (float(x) for x in args.abort_after.split(":"))

        async def guarded(prompt, n_out, abort: bool):
            async with limit:
                priority = n_out if args.priority_by == "output-len" else None
                if not abort:
                    return await one(client, model, prompt, n_out, priority)
                try:
                    return await asyncio.wait_for(one(client, model, prompt, n_out, priority),
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
    finally:
        client.close()
    if getattr(args, "requests_out", None):
        write_requests(args.requests_out, results, start)
    aborted = sum(1 for r in results if r.get("aborted"))
    results = [r for r in results if not r.get("aborted")]
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    ttft, tpot = pct([r["ttft"] for r in ok]), pct([r["tpot"] for r in ok])
    out = {
        "requests": len(results) + aborted, "aborted": aborted,
        "failed": len(results) - len(ok),
        "errors": [r["error"] for r in results if "error" in r][:3],
        "wall_s": wall, "request_throughput": len(ok) / wall,
        # this client's own CPU time over the run: near wall_s, it was the bottleneck itself
        "client_cpu_s": cpu,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (in_tokens + out_tokens) / wall,
        "ttft": ttft, "tpot": tpot,
        "itl": pct([x for r in ok for x in r["itl"]]), "e2e": pct([r["e2e"] for r in ok]),
        "jct": pct([r["e2e"] for r in ok]),
    }  # fmt: skip
    if slo:
        out["slo"] = slo.report(ok, out["failed"], wall, gpus, ttft.get("p99_ms"),
                                tpot.get("p99_ms"))
    return out


def _default_loop() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def workload_options(ap: argparse.ArgumentParser) -> None:
    """What requests are sent, when (bench.policies takes them too)."""
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second; inf sends all at once")
    ap.add_argument("--concurrency", type=int, default=0, help="max in flight (0: no cap)")
    ap.add_argument("--input-len", default="1024",
                    help="N, LO:HI (uniform) or lognormal:MEAN:SIGMA")
    ap.add_argument("--output-len", default="128",
                    help="N, LO:HI (uniform) or lognormal:MEAN:SIGMA")
    ap.add_argument("--max-len", type=int, default=2048,
                    help="log-normal lengths are clipped to this")
    ap.add_argument("--workload", choices=[*sorted(WORKLOADS), "custom"], default=None,
                    help="a preset of --input-len and --output-len (custom: those two as "
                         "given, where a tool sets a preset by default)")
    ap.add_argument("--priority-by", choices=("none", "output-len"), default="none",
                    help="output-len: send each request's output length as its priority")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are < this")
    ap.add_argument("--abort-fraction", type=float, default=0.0,
                    help="share of requests the client abandons mid-way")
    ap.add_argument("--abort-after", default="0.5:5",
                    help="LO:HI seconds after which an abandoned request is cut off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-seed", type=int, default=None,
                    help="draw the token ids from this seed instead (lengths and arrivals stay "
                         "--seed's): a run on the same schedule whose prompts no earlier run "
                         "left in the prefix cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    workload_options(ap)
    ap.add_argument("--event-loop", choices=("uvloop", "asyncio"), default=_default_loop(),
                    help="the client's event loop (default: uvloop when installed; one "
                         "core parses every stream's chunks, and asyncio's loop costs more "
                         "per chunk)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--requests-out", default=None, metavar="FILE",
                    help="one JSON line a request: when it was sent, its TTFT, TPOT, "
                         "end-to-end time and lengths")
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
