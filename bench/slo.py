"""What a run of `bench.strategies` delivered under a service-level objective, and where its
requests' time to first token went.

Goodput (DistServe's measure): the requests per second, per GPU, that met the SLO each on its
own: time to first token <= `ttft_s` and time per output token <= `tpot_ms`, per second of the
run's wall time (its first arrival to its last answer: Poisson arrivals that came faster than
the nominal rate show as goodput above it). A run *attains*
the SLO when its p99 TTFT and p99 TPOT are within it and no request failed. The default SLO,
TTFT <= 2 s and TPOT <= 25 ms, is an interactive chat service's.

Stages: the router's `microserve_router_stage_seconds` histogram (router/handover.py), read
before and after a run; the difference gives the run's own observations, whose quantiles are
interpolated within buckets as Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

STAGE_METRIC = "microserve_router_stage_seconds"
_BUCKET = re.compile(STAGE_METRIC + r'_bucket\{(?P<labels>[^}]*)\} (?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_ms: float = 25.0

    def met(self, request: dict) -> bool:
        """Whether one answered request (bench.serve.one's record) met it. A request with one
        output token has no TPOT and is judged by its TTFT."""
        ttft, tpot = request["ttft"], request["tpot"]
        if not ttft <= self.ttft_s:  # NaN (no token) fails
            return False
        return math.isnan(tpot) or tpot * 1e3 <= self.tpot_ms

    def report(self, answered: list[dict], failed: int, wall_s: float, gpus: int,
               ttft_p99_ms: float | None, tpot_p99_ms: float | None) -> dict:
        met = sum(self.met(r) for r in answered)
        attained = (failed == 0 and ttft_p99_ms is not None
                    and ttft_p99_ms <= self.ttft_s * 1e3
                    and (tpot_p99_ms is None or tpot_p99_ms <= self.tpot_ms))
        return {"ttft_s": self.ttft_s, "tpot_ms": self.tpot_ms, "met": met,
                "goodput_per_gpu": met / wall_s / gpus if wall_s > 0 else 0.0,
                "attained": attained}


Buckets = dict[tuple[str, str], dict[float, float]]  # (strategy, stage) -> {le: cumulative}


def parse_stages(metrics_text: str) -> Buckets:
    """The stage histogram's cumulative bucket counts from a /metrics body."""
    out: Buckets = defaultdict(dict)
    for m in _BUCKET.finditer(metrics_text):
        labels = dict(_LABEL.findall(m["labels"]))
        le = labels.get("le")
        if le is None or "stage" not in labels:
            continue
        out[(labels.get("strategy", ""), labels["stage"])][float(le)] = float(m["value"])
    return dict(out)


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """histogram_quantile over cumulative `buckets` {upper bound: count}: linear within the
    bucket the rank falls in; the last finite bound if it falls in +Inf; None if empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = (bound if not math.isinf(bound) else lower), count
    return lower


def stage_quantiles(before: Buckets, after: Buckets) -> dict[str, dict]:
    """Per stage, over the requests observed between the two readings (whatever strategy
    served them: a run has one): count, p50, p90, p99 in ms."""
    merged: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for key, counts in after.items():
        prior = before.get(key, {})
        for le, c in counts.items():
            merged[key[1]][le] += c - prior.get(le, 0.0)
    out = {}
    for stage, delta in sorted(merged.items()):
        n = delta.get(math.inf, 0.0)
        if n <= 0:
            continue
        out[stage] = {"n": int(n)} | {
            f"p{round(q * 100)}_ms": round(quantile(q, delta) * 1e3, 3)
            for q in (0.5, 0.9, 0.99)}
    return out
