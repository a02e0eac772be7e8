"""What an `auto` run saw, phase by phase, from its `strategy_trace` (bench.strategies samples
GET /admin/strategy every --trace-s seconds of a run into its JSON):

    python -m bench.scripts.auto_trace OUT/gpu-1p1d-seats96-1.json [--strategy auto]

For each phase of the run (a phased run; else the run as one): each engine's median smoothed
step and prompt share, its median queue and sequences decoding, and the share of samples in
which each role rule was holding; then each flip with the second of the run it was first seen
in and the phase it fell in. This is how to tell why a rule fired late (issue 44: `interference`
held only ~97 and ~278 s into a 3000/100 phase on four H200s, 2026-11-28).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def phase_bounds(run: dict) -> list[tuple[str, float, float]]:
    """(name, start s, end s) of each phase of `run`, in the run's seconds."""
    rows = run.get("phases") or []
    if not rows:
        return [("run", 0.0, float("inf"))]
    out, start = [], 0.0
    for row in rows:
        end = start + row["seconds"]
        out.append((f"{row['workload']}@{row['rate_per_gpu']:g}", start, end))
        start = end
    out[-1] = (out[-1][0], out[-1][1], float("inf"))  # the drain after the last arrival
    return out


def summarize(run: dict) -> list[str]:
    """The report's lines for one run of bench.strategies' JSON."""
    trace = run.get("strategy_trace") or []
    if not trace:
        return [f"{run['strategy']}: no strategy_trace (not `auto`, or --trace-s 0)"]
    lines = [f"{run['strategy']}: {len(trace)} samples"]
    engines = sorted({name for sample in trace for name in sample["engines"]})
    rules = sorted({rule for sample in trace for rule in (sample.get("holding_s") or {})})
    for name, start, end in phase_bounds(run):
        samples = [s for s in trace if start <= s["t"] < end]
        if not samples:
            continue
        lines.append(f"  phase {name} ({start:g}-{end:g} s, {len(samples)} samples)")
        for engine in engines:
            seen = [s["engines"][engine] for s in samples if engine in s["engines"]]
            if not seen:
                continue

            def median(key: str) -> float:
                return statistics.median(e.get(key, 0.0) for e in seen)

            lines.append(f"    {engine}: step {1e3 * median('step_s'):.1f} ms, prompts "
                         f"{median('prompt_share'):.2f} of its time, queue "
                         f"{median('queue'):.0f} tokens, decoding {median('decoding'):.0f}")
        for rule in rules:
            held = sum(1 for s in samples if rule in (s.get("holding_s") or {}))
            lines.append(f"    {rule} holding in {held / len(samples):.0%} of samples")
    bounds = phase_bounds(run)
    for before, after in zip(trace, trace[1:]):
        # (two phases may share a name: the bounds, not the name, say which one it fell in)
        phase, start, _ = next((b for b in bounds if b[1] <= after["t"] < b[2]), ("?", 0, 0))
        flipped = after.get("flipped") or []  # runs before 2026-11-29 kept only the count
        first = before.get("flips", 0)
        for j in range(after.get("flips", 0) - first):
            what = flipped[j] if j < len(flipped) else {}
            detail = (f": {what.get('engine')} {what.get('from')} -> {what.get('to')} by "
                      f"{what.get('reason')}" if what else "")
            lines.append(f"  flip {first + j + 1} seen at {after['t']:.1f} s ({phase}, "
                         f"{after['t'] - start:.1f} s into it){detail}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="bench.strategies --json output")
    ap.add_argument("--strategy", default=None, help="only the runs with this label")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        record = json.load(f)
    runs = [r for r in record["runs"] if args.strategy in (None, r["strategy"])]
    if not runs:
        sys.exit(f"no run of {args.strategy!r} in {args.json}")
    for run in runs:
        print("\n".join(summarize(run)))


if __name__ == "__main__":
    main()
