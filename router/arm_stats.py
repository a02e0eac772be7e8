"""What an A/B arm measured, and how sure we are of it (docs/router.md, "A/B arms").

Per arm: TTFT, TPOT and JCT of its finished requests, its failures, and goodput under an SLO
(the fraction of its requests that finished with TTFT and TPOT within the targets). The
intervals are 95% ones:

- a fraction (goodput): Wilson's score interval, which stays inside [0, 1] and is honest for
  small counts and fractions near 0 or 1, where the textbook p ± z·sqrt(p(1-p)/n) is not;
- a mean: the normal approximation, mean ± z·s/sqrt(n) (the central limit theorem; fine from a
  few dozen requests on, which is what a live A/B has);
- the difference of two arms' fractions: Newcombe's hybrid score interval (built from the two
  Wilson intervals); of two means: Welch's normal approximation, d ± z·sqrt(s1²/n1 + s2²/n2).

Samples are kept in bounded windows (the last SAMPLES requests of an arm) for the percentiles
and standard deviations; counts are exact over the arm's whole life.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
SAMPLES = 50_000  # per measure and arm: a few MB at most, and plenty for a p99
MEASURES = ("ttft", "tpot", "jct")


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.025

    def met(self, ttft: float, tpot: float | None) -> bool:
        return ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for the fraction successes/n ((0, 1) when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(s1: int, n1: int, s2: int, n2: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's interval (his method 10) for the difference s2/n2 - s1/n1."""
    p1, p2 = s1 / n1 if n1 else 0.0, s2 / n2 if n2 else 0.0
    l1, u1 = wilson(s1, n1, z)
    l2, u2 = wilson(s2, n2, z)
    d = p2 - p1
    return (d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2),
            d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2))


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank q-th percentile of sorted values."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _spread(values) -> tuple[float, float, int]:
    n = len(values)
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values, mean) if n > 1 else 0.0, n


@dataclass
class ArmStats:
    requests: int = 0  # ended, one way or the other
    finished: int = 0
    failed: int = 0
    good: int = 0  # finished within the SLO
    samples: dict[str, deque] = field(
        default_factory=lambda: {m: deque(maxlen=SAMPLES) for m in MEASURES})

    def record(self, ttft: float | None, tpot: float | None, jct: float | None,
               good: bool) -> None:
        """One request that ended: its times if it finished (ttft None: it failed)."""
        self.requests += 1
        if ttft is None:
            self.failed += 1
            return
        self.finished += 1
        self.good += good
        for measure, value in (("ttft", ttft), ("tpot", tpot), ("jct", jct)):
            if value is not None:
                self.samples[measure].append(value)

    def describe(self) -> dict:
        low, high = wilson(self.good, self.requests)
        out = {"requests": self.requests, "finished": self.finished, "failed": self.failed,
               "goodput": {"fraction": self.good / self.requests if self.requests else None,
                           "ci95": [low, high]}}
        for measure, values in self.samples.items():
            if not values:
                out[measure] = None
                continue
            mean, sd, n = _spread(values)
            half = Z95 * sd / math.sqrt(n)
            ordered = sorted(values)
            out[measure] = {"mean": mean, "ci95": [mean - half, mean + half],
                            "p50": percentile(ordered, 50), "p99": percentile(ordered, 99),
                            "n": n}
        return out


def difference(base: ArmStats, other: ArmStats) -> dict:
    """`other` minus `base`: goodput fraction and each measure's mean, with 95% intervals."""
    out = {}
    if base.requests and other.requests:
        d = other.good / other.requests - base.good / base.requests
        out["goodput"] = {"diff": d, "ci95": list(newcombe(base.good, base.requests,
                                                           other.good, other.requests))}
    for measure in MEASURES:
        a, b = base.samples[measure], other.samples[measure]
        if len(a) < 2 or len(b) < 2:
            out[measure] = None
            continue
        (ma, sa, na), (mb, sb, nb) = _spread(a), _spread(b)
        half = Z95 * math.sqrt(sa * sa / na + sb * sb / nb)
        out[measure] = {"diff": mb - ma, "ci95": [mb - ma - half, mb - ma + half]}
    return out
