"""Throughput of the engine vs Hugging Face `generate` on the same chat prompts (CPU).

    python -m bench.engine_vs_hf [--model DIR] [--max-tokens 256] [--record docs/benchmarks.md]

1. Starts `microserve engine` on the model, sends all prompts at once as streaming chat requests
   (greedy), and measures output tokens/s over the whole run, and per request the time to first
   token (TTFT) and the time per output token after it (TPOT).
2. Stops the engine, then runs transformers' `generate` on the same templated prompts, greedy,
   stopping at eos: once one prompt at a time, once as one left-padded batch. Its throughput
   counts only useful tokens (up to and including eos), not padding or tokens after eos.
The engine and HF never run at the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import httpx

from bench.serve import sse_chunks

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "What is 17 times 23? Show your work.",
    "Give me a short packing list for a weekend camping trip.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main differences between a virus and a bacterium? " * 2,
    "Describe the water cycle. Include evaporation, condensation, precipitation and collection, "
    "and explain how the sun drives each stage. " * 3,
    "Here are some notes from a meeting: the team agreed to move the launch to March, hire two "
    "more engineers, cut the marketing budget by ten percent, and review progress every Friday. "
    "Someone raised concerns about testing time and the vendor contract. " * 4
    + "Write a short summary of the decisions.",
    "List five tips for writing clear emails.",
    "Tell me a fun fact about octopuses.",
    "A farmer has 12 sheep, all but 5 run away. How many are left? Explain. " * 6,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launcher.cli", "engine", "--port", str(port),
           "--log-level", "warning", *extra]  # fmt: skip
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("engine did not become healthy in 300 s")


async def one_request(client: httpx.AsyncClient, question: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times, usage = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for chunk in sse_chunks(resp):
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    n = usage["completion_tokens"]
    ttft = token_times[0] - start
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
    return {"tokens": n, "ttft": ttft, "tpot": tpot, "prompt_tokens": usage["prompt_tokens"]}


async def run_engine_load(port: int, max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=len(QUESTIONS))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                 limits=limits) as client:  # fmt: skip
        await one_request(client, "Hi", 4)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, q, max_tokens) for q in QUESTIONS))
        wall = time.perf_counter() - start
    total = sum(r["tokens"] for r in results)
    return {
        "wall_s": wall,
        "output_tokens": total,
        "tokens_per_s": total / wall,
        "prompt_tokens": [r["prompt_tokens"] for r in results],
        "output_lens": [r["tokens"] for r in results],
        "ttft_p50": statistics.median(r["ttft"] for r in results),
        "ttft_max": max(r["ttft"] for r in results),
        "tpot_p50": statistics.median(r["tpot"] for r in results),
        "tpot_max": max(r["tpot"] for r in results),
    }


def run_hf(model_dir: str, max_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from microserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                   add_special_tokens=False)
        for q in QUESTIONS
    ]  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id

    def useful(row: list[int]) -> int:
        return row.index(eos) + 1 if eos in row else len(row)

    kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        seq_tokens = 0
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), **kw)  # fmt: skip
            seq_tokens += useful(out[0, len(p):].tolist())
        seq_wall = time.perf_counter() - start

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        batch_wall = time.perf_counter() - start
        batch_tokens = sum(useful(row[width:].tolist()) for row in out)
    return {
        "sequential": {"wall_s": seq_wall, "output_tokens": seq_tokens,
                       "tokens_per_s": seq_tokens / seq_wall},
        "batched": {"wall_s": batch_wall, "output_tokens": batch_tokens,
                    "tokens_per_s": batch_tokens / batch_wall},
    }  # fmt: skip


def record(path: str, argv: list[str], eng: dict, hf: dict) -> None:
    seq, bat = hf["sequential"], hf["batched"]
    today = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'CPU'}"
    lines = [
        f"\n### Engine vs HF generate, {len(QUESTIONS)} concurrent chat requests ({today})\n",
        f"- command: `python -m bench.engine_vs_hf {' '.join(argv)}`",
        f"- machine: {machine}; torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}",
        f"- prompt tokens: {sorted(eng['prompt_tokens'])}",
        f"- engine output lengths: {sorted(eng['output_lens'])}\n",
        "| run | output tokens | wall s | output tokens/s | vs engine |",
        "|---|---|---|---|---|",
        f"| microserve engine (HTTP, streaming, all at once) | {eng['output_tokens']} | "
        f"{eng['wall_s']:.1f} | {eng['tokens_per_s']:.1f} | 1.00x |",
        f"| HF generate, one prompt at a time | {seq['output_tokens']} | {seq['wall_s']:.1f} | "
        f"{seq['tokens_per_s']:.1f} | {seq['tokens_per_s'] / eng['tokens_per_s']:.2f}x |",
        f"| HF generate, one padded batch of {len(QUESTIONS)} | {bat['output_tokens']} | "
        f"{bat['wall_s']:.1f} | {bat['tokens_per_s']:.1f} | "
        f"{bat['tokens_per_s'] / eng['tokens_per_s']:.2f}x |",
        "",
        f"Engine latency: TTFT p50 {eng['ttft_p50'] * 1e3:.0f} ms, max "
        f"{eng['ttft_max'] * 1e3:.0f} ms; TPOT p50 {eng['tpot_p50'] * 1e3:.0f} ms, max "
        f"{eng['tpot_max'] * 1e3:.0f} ms.\n",
    ]
    with open(path, "a") as f:
        f.write("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra argument for `microserve engine` (repeatable)")
    ap.add_argument("--record", default=None, help="append the results to this markdown file")
    args = ap.parse_args()

    from microserve.model_files import resolve_model

    model_dir = str(resolve_model(args.model))
    port = free_port()
    proc = start_engine(model_dir, port, args.engine_arg)
    try:
        eng = asyncio.run(run_engine_load(port, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)
    print("engine:", json.dumps(eng, indent=1))
    hf = run_hf(model_dir, args.max_tokens)
    print("hf:", json.dumps(hf, indent=1))
    if args.record:
        record(args.record, sys.argv[1:], eng, hf)


if __name__ == "__main__":
    main()
