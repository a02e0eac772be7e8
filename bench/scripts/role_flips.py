"""Role flips under load (issue 44's target: a flip completes within 2 s with no request failed):
bench.serve's load on a running router while engines' roles are flipped through the admin API,
one flip every --every-s; each flip's drain time and the calls it left open, then the load's
failures.

    microserve up deploy/gpu-1p1d.toml --model random:llama-3.1-8b    # strategy pd
    MICROSERVE_ADMIN_TOKEN=... python -m bench.scripts.role_flips --num-requests 600 \\
        --request-rate 8 --input-len 3000 --output-len 100 --vocab 128000 --every-s 8 \\
        --flips prefill-0=decode,prefill-0=prefill,decode-0=prefill,decode-0=decode

(bench/scripts/role_flips.sh starts the deployment and runs this.)

Prints one `flip` line per flip (engine, roles, waited_s, left, HTTP status), then `load`:
requests, failed, and TTFT/TPOT p99; exits 1 if a flip took longer than --limit-s or a
request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx

from bench.serve import run, workload_options


async def flips(args) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.admin_token}"}
    router = args.base_url.removesuffix("/v1")
    out = []
    async with httpx.AsyncClient(base_url=router, headers=headers, timeout=600) as http:
        for spec in args.flips.split(","):
            await asyncio.sleep(args.every_s)
            engine, role = spec.split("=")
            r = await http.post(f"/admin/engines/{engine}/role",
                                json={"role": role, "wait_s": args.wait_s})
            flip = r.json() if r.status_code == 200 else {"engine": engine, "to": role}
            flip["status"] = r.status_code
            out.append(flip)
            print(f"flip {flip['engine']} {flip.get('from')} -> {flip['to']}: waited_s "
                  f"{flip.get('waited_s', float('nan')):.3f} left {flip.get('left')} "
                  f"status {r.status_code}", flush=True)
    return out


async def main_async(args) -> int:
    done, load = await asyncio.gather(flips(args), run(args))
    print(f"load: requests {load['requests']} failed {load['failed']} errors {load['errors']} "
          f"ttft p99 {load['ttft'].get('p99_ms', float('nan')):.0f} ms tpot p99 "
          f"{load['tpot'].get('p99_ms', float('nan')):.1f} ms", flush=True)
    slow = [f for f in done if f["status"] != 200 or f["waited_s"] > args.limit_s]
    return 1 if slow or load["failed"] else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"))
    ap.add_argument("--admin-token", default=os.environ.get("MICROSERVE_ADMIN_TOKEN"))
    ap.add_argument("--flips", required=True, help="ENGINE=ROLE,...: in this order")
    ap.add_argument("--every-s", type=float, default=5.0, help="seconds before each flip")
    ap.add_argument("--wait-s", type=float, default=2.0, help="each flip's wait_s")
    ap.add_argument("--limit-s", type=float, default=2.0, help="a flip slower than this fails")
    workload_options(ap)
    args = ap.parse_args()
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
