"""The figures bench.peers takes from each server, all through its OpenAI completions API with
bench.serve's client (streamed, prompts of random token ids, greedy, ignore_eos), so every
server sees the same requests and every figure includes its HTTP path.

  first      the first request after the server is ready: its TTFT and end-to-end time
             (and the start-up time itself)
  decode1    one request at context --decode-context: TPOT (ms per output token after the first)
  prefill    --prefill-seqs prompts of --prefill-len tokens at once, one output token each:
             prompt tokens / wall time
  decode128  --batch-seqs requests at context --batch-context at once: output tokens/s in the
             window where all are decoding (from the last first token to the first finish;
             chunks counted, each weighed by its request's tokens per chunk)
  serve      bench.serve's --serve-requests x (--serve-input in / --serve-output out) at once:
             total tokens/s, TTFT and TPOT p99
  poisson@R  bench.serve at R requests/s (Poisson): TTFT and TPOT p50 / p99
  vllmbench  vLLM's own client, `vllm bench serve` (random dataset, the serve sizes, all at
             once): total tokens/s, TTFT and TPOT p99 (needs vLLM importable: --vllm-site)

Each function returns {row name: value}; `HIGHER_IS_BETTER` says which way a row points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from bench.peers.servers import vllm_env
from bench.serve import one, workload_options
from bench.sse_client import StreamClient
from bench.serve import run as serve_run

FIGURES = ("first", "decode1", "prefill", "decode128", "serve", "poisson", "vllmbench")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def higher_is_better(row: str) -> bool:
    return row.endswith("tokens/s") or "goodput" in row


async def _together(base_url: str, model: str, batch: list[list[int]], n_out: int) -> list[dict]:
    client = StreamClient(base_url)
    try:
        results = await asyncio.gather(*(one(client, model, p, n_out) for p in batch))
    finally:
        client.close()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(batch)} requests failed: {errors[:2]}")
    return results


async def first(base_url: str, model: str, args, vocab: int) -> dict:
    (result,) = await _together(base_url, model, prompts(1, args.first_len, vocab, 11), 16)
    return {"first request TTFT ms": result["ttft"] * 1e3,
            "first request e2e ms": result["e2e"] * 1e3}


async def decode1(base_url: str, model: str, args, vocab: int) -> dict:
    batch = prompts(1, args.decode_context, vocab, 12)
    await _together(base_url, model, [batch[0][:16]], 4)  # warm the path, not the cache
    (result,) = await _together(base_url, model, batch, args.decode_tokens)
    return {f"decode batch 1 @ {args.decode_context} ms/token": result["tpot"] * 1e3}


async def prefill(base_url: str, model: str, args, vocab: int) -> dict:
    batch = prompts(args.prefill_seqs, args.prefill_len, vocab, 13)
    await _together(base_url, model, prompts(1, 16, vocab, 14), 1)
    start = time.perf_counter()
    await _together(base_url, model, batch, 1)
    wall = time.perf_counter() - start
    return {f"prefill {args.prefill_seqs}x{args.prefill_len} tokens/s":
            args.prefill_seqs * args.prefill_len / wall}


async def decode128(base_url: str, model: str, args, vocab: int) -> dict:
    batch = prompts(args.batch_seqs, args.batch_context, vocab, 15)
    results = await _together(base_url, model, batch, args.batch_tokens)
    # the window where every request is decoding: no prefill of another request inside it
    begin = max(r["times"][0] for r in results)
    end = min(r["times"][-1] for r in results)
    # a server may put several tokens in one chunk when its client falls behind (vLLM merges
    # a request's pending outputs): weigh each chunk by its request's tokens per chunk
    tokens = sum(sum(1 for t in r["times"] if begin < t <= end)
                 * (r["output_tokens"] - 1) / max(len(r["times"]) - 1, 1) for r in results)
    if end <= begin or tokens == 0:
        raise RuntimeError(f"decode{args.batch_seqs}: no window where all requests decode "
                           f"(raise --batch-tokens, now {args.batch_tokens})")
    return {f"decode {args.batch_seqs} seqs @ {args.batch_context} tokens/s":
            tokens / (end - begin)}


def serve_args(base_url: str, model: str, argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    workload_options(ap)
    ns = ap.parse_args(argv)
    ns.base_url, ns.model, ns.api_key = base_url, model, None
    return ns


async def serve(base_url: str, model: str, args, vocab: int) -> dict:
    ns = serve_args(base_url, model, [
        "--num-requests", str(args.serve_requests), "--input-len", str(args.serve_input),
        "--output-len", str(args.serve_output), "--vocab", str(vocab)])  # fmt: skip
    result = await serve_run(ns)
    check(result, "serve")
    name = f"bench.serve {args.serve_requests}x{args.serve_input}/{args.serve_output}"
    return {f"{name} total tokens/s": result["total_tokens_per_s"],
            f"{name} TTFT p99 ms": result["ttft"]["p99_ms"],
            f"{name} TPOT p99 ms": result["tpot"]["p99_ms"]}


async def poisson(base_url: str, model: str, args, vocab: int) -> dict:
    out = {}
    # each rate sends prompts of its own (another seed): with the same prompts a later rate
    # would time prefix-cache hits of the earlier one's, not prefills
    for i, rate in enumerate(args.rates):
        ns = serve_args(base_url, model, [
            "--num-requests", str(args.poisson_requests), "--request-rate", str(rate),
            "--input-len", str(args.poisson_input), "--output-len", str(args.poisson_output),
            "--vocab", str(vocab), "--seed", str(100 + i)])  # fmt: skip
        # each request's arrival and figures, for reading a tail: requests-SIDE-rR-RATE.jsonl
        ns.requests_out = args.run_dir / f"requests-{args.trace_name}-{rate:g}per-s.jsonl"
        result = await serve_run(ns)
        check(result, f"poisson@{rate}")
        for metric in ("ttft", "tpot"):
            for q in ("p50", "p99"):
                out[f"poisson {rate:g}/s {metric.upper()} {q} ms"] = result[metric][f"{q}_ms"]
    return out


async def vllm_bench(base_url: str, model: str, args, vocab: int) -> dict:
    result_file = args.run_dir / f"vllm-bench-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
           "--backend", "openai", "--base-url", base_url.removesuffix("/v1"),
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(args.model_dir),
           "--dataset-name", "random", "--random-input-len", str(args.serve_input),
           "--random-output-len", str(args.serve_output), "--num-prompts",
           str(args.serve_requests), "--request-rate", "inf", "--ignore-eos", "--disable-tqdm",
           "--save-result", "--result-dir", str(result_file.parent),
           "--result-filename", result_file.name]  # fmt: skip
    env = vllm_env(args.vllm_site)
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    output, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}:\n"
                           f"{output.decode(errors='replace')[-3000:]}")
    result = json.loads(result_file.read_text())
    name = f"vllm bench serve {args.serve_requests}x{args.serve_input}/{args.serve_output}"
    return {f"{name} total tokens/s": result["total_token_throughput"],
            f"{name} TTFT p99 ms": result["p99_ttft_ms"],
            f"{name} TPOT p99 ms": result["p99_tpot_ms"]}


def check(result: dict, name: str) -> None:
    if result["failed"]:
        raise RuntimeError(f"{name}: {result['failed']} requests failed: {result['errors']}")


RUNNERS = {"first": first, "decode1": decode1, "prefill": prefill, "decode128": decode128,
           "serve": serve, "poisson": poisson, "vllmbench": vllm_bench}
