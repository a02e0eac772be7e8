"""Routing LoRA requests by adapter affinity against round robin, over engines of one live
deployment (issue 41's target: >= 1.3x throughput over two engines with 32 adapters).

    python -m bench.lora_routing --model random:llama-3.1-8b --devices cuda:0,cuda:1 \\
        --adapters 32 --rank 16 --max-loras 8 --skew 1.0 --requests 512 --json out.json

Writes --adapters random PEFT adapters (bench.lora_gpu's), then a deployment file with one
engine per device, each registering every adapter (--lora-modules) with --max-loras slots, and
starts it (`microserve up`). For each strategy (--strategies: data_parallel round robin, then
lora_affinity; the list --repeat times over, alternating, to cancel drift) it swaps the
strategy in, sends --requests requests (--input-len random token ids, fresh each run so no
run reuses another's KV; --output-len tokens, ignore_eos; at most --concurrency in flight),
each naming an adapter drawn uniformly (--skew 0) or Zipf(--skew) — the same draws, in the same
order, in every run — and prints one JSON line: output tokens/s, wall time, and each engine's
adapter slot writes during the run (copies into a slot: what affinity saves) and prompt tokens
(how the requests spread), and the prompt tokens served from the engines' prefix caches. The
last line is affinity's mean throughput over round robin's, with each run's. `--devices
cpu,cpu` with a small model is a smoke run of this module.

`--turns T` makes the traffic conversations: --requests // T of them, each under one adapter
(the same draws), at most --concurrency at a time, each turn sent when the last one is
answered, its prompt the last turn's prompt, --output-len ids standing for the answer, and
--input-len new ids. Round robin then sends a conversation's turns to either engine, where
its earlier turns' KV may not be; affinity's prefix score sends them where it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.lora_gpu import popularity, write_random_adapter
from bench.strategies import Deployment
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model


def deployment_file(path: Path, model: str, port: int, devices: list[str], adapters: Path,
                    names: list[str], args) -> None:
    modules = [f"{n}={adapters / n}" for n in names]
    lines = [f"model = {json.dumps(model)}", "", "[router]", f"port = {port}",
             'strategy = "data_parallel"', ""]
    for i, device in enumerate(devices):
        engine_args = ["--device", device, "--max-loras", str(args.max_loras),
                       "--max-lora-rank", str(args.rank), "--lora-dir", str(adapters),
                       "--lora-modules", *modules, *args.engine_arg]
        lines += ["[[engines]]", f'name = "e{i}"', f"args = {json.dumps(engine_args)}", ""]
    path.write_text("\n".join(lines))


async def run(client: httpx.AsyncClient, args, names: list[str], vocab: int, seed: int) -> dict:
    """Every request, at most --concurrency in flight (with --turns, conversations); fresh
    prompts per `seed`."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(args.concurrency)
    cached = [0]

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    async def post(adapter: str, prompt: list[int]) -> int:
        r = await client.post("/v1/completions", json={
            "model": adapter, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        usage = r.json()["usage"]
        cached[0] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage["completion_tokens"]

    async def one(adapter: str) -> int:
        prompt = ids(args.input_len)
        async with gate:
            return await post(adapter, prompt)

    async def conversation(adapter: str) -> int:
        """--turns requests in a row, each prompt the one before, an answer (--output-len
        ids standing for the reply as the client sends it back) and a new message."""
        tokens, prompt = 0, []
        async with gate:
            for turn in range(args.turns):
                prompt = prompt + (ids(args.output_len) if turn else []) + ids(args.input_len)
                tokens += await post(adapter, prompt)
        return tokens

    start = time.perf_counter()
    if args.turns == 1:
        adapters = popularity(args.requests, names, args.skew, args.seed)
        tokens = await asyncio.gather(*(one(a) for a in adapters))
    else:
        adapters = popularity(args.requests // args.turns, names, args.skew, args.seed)
        tokens = await asyncio.gather(*(conversation(a) for a in adapters))
    wall = time.perf_counter() - start
    return {"output_tokens_per_s": sum(tokens) / wall, "wall_s": wall,
            "requests": len(adapters) * args.turns, "cached_prompt_tokens": cached[0]}


async def engine_counts(admin: httpx.AsyncClient) -> dict[str, dict]:
    await asyncio.sleep(1.0)  # the router polls the engines' stats twice a second
    engines = (await admin.get("/admin/engines")).json()["engines"]
    return {e["name"]: {k: e["load"].get(k, 0) for k in ("lora_slot_writes", "prompt_tokens")}
            for e in engines}


async def wait_for_engines(admin: httpx.AsyncClient, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            engines = (await admin.get("/admin/engines")).json()["engines"]
            if sum(e["state"] == "up" for e in engines) == count:
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        await asyncio.sleep(1)
    raise TimeoutError(f"{count} engines not up within {timeout_s} s")


async def main_async(args) -> dict:
    model_dir = str(resolve_model(args.model))
    config = ModelConfig.from_dir(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="lora-routing-"))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_random_adapter(tmp / name, config, args.rank, seed=i)
    deploy = tmp / "deploy.toml"
    deployment_file(deploy, args.model, args.port, args.devices.split(","), tmp, names, args)
    up = Deployment(str(deploy), args.port, None, args.log)
    up.start()
    results = {"model": args.model, "devices": args.devices, "adapters": args.adapters,
               "rank": args.rank, "max_loras": args.max_loras, "skew": args.skew,
               "requests": args.requests, "concurrency": args.concurrency,
               "turns": args.turns}
    base = f"http://127.0.0.1:{args.port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=3600, headers={
                "Authorization": f"Bearer {up.api_key}"}) as client, httpx.AsyncClient(
                base_url=base, timeout=60,
                headers={"Authorization": f"Bearer {up.admin_token}"}) as admin:
            await wait_for_engines(admin, len(args.devices.split(",")), args.start_timeout_s)
            print(json.dumps(results), flush=True)
            runs = args.strategies.split(",") * args.repeat
            for seed, strategy in enumerate(runs, start=1):
                r = await admin.put("/admin/strategy", json={"builtin": strategy})
                r.raise_for_status()
                before = await engine_counts(admin)
                figures = await run(client, args, names, config.vocab_size, seed)
                after = await engine_counts(admin)
                figures["engines"] = {n: {k: after[n][k] - before[n][k] for k in after[n]}
                                      for n in after}
                results.setdefault(strategy, []).append(figures)
                print(strategy, json.dumps(figures), flush=True)
    finally:
        up.stop()
    if "lora_affinity" in results and "data_parallel" in results:
        rates = {s: [f["output_tokens_per_s"] for f in results[s]]
                 for s in ("lora_affinity", "data_parallel")}
        results["affinity_over_round_robin"] = (statistics.mean(rates["lora_affinity"])
                                                / statistics.mean(rates["data_parallel"]))
        results["affinity_over_round_robin_each_run"] = [
            a / d for a, d in zip(rates["lora_affinity"], rates["data_parallel"])]
        print("affinity_over_round_robin", results["affinity_over_round_robin"],
              results["affinity_over_round_robin_each_run"], flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="one engine per entry")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent; 0: uniform")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--turns", type=int, default=1,
                    help="requests per conversation: each turn's prompt extends the last "
                         "(--requests // --turns conversations, one adapter each; "
                         "--concurrency conversations at a time)")
    ap.add_argument("--strategies", default="data_parallel,lora_affinity")
    ap.add_argument("--repeat", type=int, default=1, help="run the strategies' list this many "
                    "times over, alternating")
    ap.add_argument("--seed", type=int, default=0, help="the adapters' draws (every run's)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="more args for every engine (repeat: --engine-arg=--num-pages ...)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--start-timeout-s", type=int, default=600)
    ap.add_argument("--log", default=None, help="microserve up's output (default: dropped)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.turns < 1 or args.requests < args.turns:
        ap.error(f"--turns {args.turns} must be within [1, --requests {args.requests}]")
    results = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
