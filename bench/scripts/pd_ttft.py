"""Time to first token through a running router serving P/D: greedy requests, whose first token
P samples and hands to D with the KV, against the same requests with `logprobs`, whose first
token D samples after computing the last prompt token itself. Interleaved, `max_tokens` 1,
fresh random prompts, one warm-up round not counted.

    microserve up deploy/gpu-1p1d-shared.toml          # strategy pd
    python bench/scripts/pd_ttft.py --tokens 16,1000,3000 --repeat 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--tokens", default="16,1000,3000", help="prompt lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    flows = {"P samples (greedy)": {}, "D samples (logprobs)": {"logprobs": 0}}
    with httpx.Client(base_url=args.base_url, timeout=120) as http:
        model = http.get("/models").json()["data"][0]["id"]
        for n in (int(x) for x in args.tokens.split(",")):
            times: dict[str, list[float]] = {name: [] for name in flows}
            for i in range(args.repeat + 1):
                for name, extra in flows.items():
                    prompt = [rng.randrange(100, 30000) for _ in range(n)]
                    t0 = time.perf_counter()
                    r = http.post("/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                        **extra})
                    elapsed_ms = (time.perf_counter() - t0) * 1e3
                    r.raise_for_status()
                    if i:
                        times[name].append(elapsed_ms)
            for name, t in times.items():
                print(f"{n} tokens, {name}: median {statistics.median(t):.1f} ms, "
                      f"min {min(t):.1f}, max {max(t):.1f} (n={len(t)})")


if __name__ == "__main__":
    main()
