"""Plots of bench.strategies results, laid out as the paper's figures.

    python -m bench.plot_strategies RUN.json --out docs/strategies/fig11.png
    python -m bench.plot_strategies IN3000.json IN5000.json --layout ratio --out fig13.png

--layout latency (Fig. 10, 11): four panels — mean TTFT, mean TPOT, mean JCT and P99 JCT
against the per-GPU request rate, one line per strategy, from one or more result files.
--layout ratio (Fig. 13): P99 JCT against the per-GPU rate, one panel per workload (an input
length each), one line per strategy (the balance ratios, and the adaptive one).
Runs of one strategy from several files join into one line; --strategies picks the lines.

Runs that did not answer every request are drawn hollow: past saturation, their latencies
count only the requests that finished in time. Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json

PANELS = {
    "latency": [("ttft", "mean_ms", "mean TTFT (ms)"), ("tpot", "mean_ms", "mean TPOT (ms)"),
                ("jct", "mean_ms", "mean JCT (s)"), ("jct", "p99_ms", "P99 JCT (s)")],
    "ratio": [("jct", "p99_ms", "P99 JCT (s)")],
}


def series(runs: list[dict], metric: str, stat: str) -> dict[str, list[tuple[float, float, bool]]]:
    """strategy -> [(per-GPU rate, value, complete)], in rate order; JCT in seconds."""
    out: dict[str, list[tuple[float, float, bool]]] = {}
    scale = 1e-3 if metric == "jct" else 1.0
    for r in runs:
        if stat not in r[metric] or "concurrency" in r:
            continue  # no request finished, or a closed-loop run (no rate)
        complete = r["completed"] == r["requests"]
        out.setdefault(r["strategy"], []).append(
            (r["rate_per_gpu"], r[metric][stat] * scale, complete))
    return {k: sorted(v) for k, v in out.items()}


def _label(record: dict) -> str:
    lengths = record["lengths"]
    return (f"{record['workload']}: input {lengths['input'][1]:g}, "
            f"output {lengths['output'][1]:g}")


def plot(records: list[dict], layout: str, out: str, title: str | None,
         strategies: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_workload: dict[str, list[dict]] = {}
    for rec in records:
        by_workload.setdefault(_label(rec), []).extend(
            r for r in rec["runs"] if strategies is None or r["strategy"] in strategies)
    if layout == "latency":
        runs = [r for rs in by_workload.values() for r in rs]
        panels = [(runs, *p, None) for p in PANELS["latency"]]
    else:
        panels = [(runs, *PANELS["ratio"][0], label) for label, runs in by_workload.items()]
    colors: dict[str, str] = {}  # one color per strategy in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (runs, metric, stat, ylabel, sub) in zip(axes[0], panels):
        for strategy, points in series(runs, metric, stat).items():
            color = colors.setdefault(strategy, f"C{len(colors)}")
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, "-", color=color, label=strategy)
            for x, y, complete in points:
                ax.plot(x, y, "o", color=color, mfc=color if complete else "none")
        ax.set_xlabel("per-GPU request rate (req/s)")
        ax.set_ylabel(ylabel)
        if sub:
            ax.set_title(sub, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or ", ".join(by_workload), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench.strategies JSON files")
    ap.add_argument("--layout", choices=sorted(PANELS), default="latency")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default=None)
    ap.add_argument("--strategies", default=None, help="comma-separated: only these lines")
    args = ap.parse_args()
    records = []
    for path in args.results:
        with open(path) as f:
            records.append(json.load(f))
    plot(records, args.layout, args.out, args.title,
         args.strategies.split(",") if args.strategies else None)
    print(args.out)


if __name__ == "__main__":
    main()
