"""Time to first token of 1,000- and 16-token prompts (max_tokens 1, one request at a time),
three ways interleaved in random order so that drift hits all alike: the engine's
/v1/completions, the engine's /microserving/start_generate, and the router's /v1/completions.

    microserve up deploy/gpu-dp.toml --model random:llama-3.1-8b --engine-api-key ekey &
    python bench/scripts/ttft_interleaved.py [N]      # N measured requests per way and length

Time to first token = time to the first non-empty bytes of the streamed answer.
"""
import asyncio
import random
import statistics
import sys
import time
import uuid

import httpx

ROUTER, ENGINE, KEY = "http://127.0.0.1:8000", "http://127.0.0.1:8001", "ekey"

async def first_byte(client, url, body, headers):
    t = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as r:
        assert r.status_code == 200, (url, r.status_code)
        dt = None
        async for b in r.aiter_raw():
            if dt is None and b.strip():
                dt = time.perf_counter() - t
    return dt * 1e3

async def main(n):
    rng = random.Random(0)
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=60) as c:
        model = (await c.get(ENGINE + "/v1/models", headers=auth)).json()["data"][0]["id"]
        for length in (1000, 16):
            res = {"engine-openai": [], "engine-start_generate": [], "router": []}
            for i in range(n + 3):
                for name in rng.sample(list(res), 3):
                    p = [rng.randrange(128000) for _ in range(length)]
                    if name == "engine-start_generate":
                        body = {"request_id": uuid.uuid4().hex, "prompt": p,
                                "sampling": {"max_tokens": 1, "temperature": 0, "ignore_eos": True}}
                        dt = await first_byte(c, ENGINE + "/microserving/start_generate", body, auth)
                    else:
                        body = {"model": model, "prompt": p, "max_tokens": 1, "temperature": 0,
                                "ignore_eos": True, "stream": True}
                        url = (ENGINE if name == "engine-openai" else ROUTER) + "/v1/completions"
                        dt = await first_byte(c, url, body, auth if name != "router" else {})
                    if i >= 3:
                        res[name].append(dt)
            for name, v in res.items():
                v.sort()
                print(f"len {length:5d} {name:24s} p50 {statistics.median(v):6.2f} ms  "
                      f"min {v[0]:6.2f}  p90 {v[int(0.9*len(v))]:6.2f}")

asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
