"""What a Poisson run's TTFT tail is made of, from `bench.serve --requests-out` files (bench.peers
keeps one per side, round and rate: requests-SIDE-rROUND-RATEper-s.jsonl).

    python -m bench.scripts.poisson_tail requests-engine-r1-16per-s.jsonl [...] [--top 5]

For each file: TTFT p50 / p99 (as bench.serve ranks them), the mean TTFT of requests by how
many others were sent in the `--window-ms` before them (a burst's later arrivals wait for the
earlier ones' prompts), and the `--top` slowest first tokens with their neighbours: when each
was sent, how many requests came in the window before it, and those requests' TTFTs. A tail
made of requests with several recent neighbours is queueing behind their prompts; one made of
requests that came alone is something else (a long step in flight, a host delay).
"""

from __future__ import annotations

import argparse
import json
import statistics
from bisect import bisect_left
from pathlib import Path

from bench.serve import pct


def read(path: Path) -> list[dict]:
    """The answered requests of a file, in the order they were sent."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "ttft_ms" in r), key=lambda r: r["sent_s"])


def tail(rows: list[dict], window_ms: float, top: int) -> dict:
    sent = [r["sent_s"] for r in rows]
    # each request's neighbours: those sent in the window before it
    recent = [rows[bisect_left(sent, r["sent_s"] - window_ms / 1e3):i] for i, r in enumerate(rows)]
    by_recent: dict[int, list[float]] = {}
    for r, before in zip(rows, recent):
        by_recent.setdefault(min(len(before), 3), []).append(r["ttft_ms"])
    ttft = pct([r["ttft_ms"] / 1e3 for r in rows])  # ranked as bench.serve ranks them
    slowest = sorted(range(len(rows)), key=lambda i: -rows[i]["ttft_ms"])[:top]
    return {
        "requests": len(rows), "ttft_p50_ms": ttft["p50_ms"], "ttft_p99_ms": ttft["p99_ms"],
        "mean_ttft_ms_by_recent": {f"{k}{'+' if k == 3 else ''}": statistics.fmean(v)
                                   for k, v in sorted(by_recent.items())},
        "slowest": [{"i": rows[i]["i"], "sent_s": rows[i]["sent_s"], "ttft_ms": rows[i]["ttft_ms"],
                     "recent": len(recent[i]),
                     "recent_ttft_ms": [x["ttft_ms"] for x in recent[i]]} for i in slowest],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--window-ms", type=float, default=100.0,
                    help="a neighbour is a request sent this long before (default: 100)")
    ap.add_argument("--top", type=int, default=5, help="the slowest first tokens shown")
    args = ap.parse_args()
    for path in args.files:
        print(path.name, json.dumps(tail(read(path), args.window_ms, args.top), indent=1))


if __name__ == "__main__":
    main()
