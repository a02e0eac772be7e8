"""A/B arms: several strategies serving at once over the same engines, each request on one.

    PUT /admin/strategy {"arms": [{"name": "a", "builtin": "data_parallel", "weight": 1},
                                  {"name": "b", "builtin": "balanced_pd",
                                   "args": {"ratio": 0.3}, "weight": 1}],
                         "sticky_by": "header:X-User", "slo": {"ttft_s": 2, "tpot_s": 0.025}}

Assignment is sticky and stateless: a request's key (a header, the body's `user`, or its
request id; the request id whenever the key is missing) hashes with BLAKE2b to a point in
[0, 1), and the arm whose slice of the cumulative weights covers the point gets it. The same key
lands on the same arm as long as the weights stay; raising one arm's weight moves only the keys
its slice grows over (so with two arms, raising b's weight moves keys only from a to b). A
request keeps the arm, and the strategy instance, it started on whatever happens to the arms
meanwhile (router/host.py holds it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import accumulate

from microserve.backend import Client
from microserve.metrics import Registry
from router.arm_stats import MEASURES, ArmStats, Slo, difference
from router.handover import BUCKETS

STICKY_KINDS = ("user", "request_id")  # and "header:NAME"
# TPOT lives in milliseconds: finer buckets than the stages'
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03,
                0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


def point(key: str) -> float:
    """The key's place in [0, 1): BLAKE2b's first 8 bytes, big-endian, over 2**64. Stable
    across processes and Python versions (unlike hash())."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def pick(key: str, weights: list[float]) -> int:
    """The index of the arm whose cumulative-weight slice covers the key's point. Arms of
    weight 0 have an empty slice; the weights must have a positive sum."""
    total = sum(weights)
    target = point(key) * total
    for index, upper in enumerate(accumulate(weights)):
        if target < upper and weights[index] > 0:
            return index
    # float rounding at the very top: the last arm with weight
    return max(i for i, w in enumerate(weights) if w > 0)


def sticky_key(sticky_by: str, client: Client | None, request_id: str) -> str:
    """What a request is assigned by: the header's value, the `user` field, or (when those
    are missing, and for "request_id") the request id."""
    if client is not None:
        if sticky_by == "user" and client.user:
            return "user:" + client.user
        if sticky_by.startswith("header:"):
            value = client.headers.get(sticky_by.removeprefix("header:"))
            if value:
                return "header:" + value
    return "request:" + request_id


def check_sticky_by(value: str) -> str:
    if value in STICKY_KINDS or (value.startswith("header:") and
                                 _header_name(value.removeprefix("header:"))):
        return value
    raise ValueError(f"sticky_by must be 'user', 'request_id' or 'header:NAME' (NAME a header's "
                     f"name), got {value!r}")


def _header_name(name: str) -> bool:
    return bool(name) and len(name) <= 256 and all(
        c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~") for c in name)


@dataclass(eq=False)
class Arm:
    """One arm: its strategy (a LoadedStrategy of router/host.py) and what it measured. An
    arm kept across PUTs (same name, same strategy and arguments) keeps its instance and its
    numbers; only its weight changes."""

    name: str
    weight: float
    loaded: object  # LoadedStrategy (router/host.py imports this module)
    slo: Slo = field(default_factory=Slo)  # the experiment's, for the requests it finishes
    stats: ArmStats = field(default_factory=ArmStats)


@dataclass(eq=False)
class Experiment:
    arms: list[Arm]
    sticky_by: str = "request_id"
    slo: Slo = field(default_factory=Slo)

    def arm(self, name: str) -> Arm | None:
        return next((a for a in self.arms if a.name == name), None)

    def choose(self, client: Client | None, request_id: str) -> Arm:
        key = sticky_key(self.sticky_by, client, request_id)
        return self.arms[pick(key, [a.weight for a in self.arms])]

    def describe(self) -> dict:
        """Each arm's strategy, weight and numbers, and each arm's difference from the first
        arm (other minus first) with its interval."""
        base = self.arms[0]
        return {"sticky_by": self.sticky_by,
                "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
                "intervals": "95%: goodput Wilson score; means normal approximation; "
                             "differences Newcombe (goodput) and Welch normal (means)",
                "arms": [{"name": a.name, "weight": a.weight, "strategy": a.loaded.describe(),
                          **a.stats.describe()} for a in self.arms],
                "differences": {f"{a.name}-{base.name}": difference(base.stats, a.stats)
                                for a in self.arms[1:]}}


class ArmMetrics:
    """Per-arm series in the router's /metrics."""

    def __init__(self, registry: Registry):
        self.requests = registry.counter(
            "microserve_router_arm_requests_total",
            "A/B requests by arm and how they ended (finished, failed).", ["arm", "outcome"])
        self.good = registry.counter(
            "microserve_router_arm_good_total",
            "A/B requests that finished within the experiment's SLO (TTFT and TPOT).", ["arm"])
        buckets = {"ttft": BUCKETS, "tpot": TPOT_BUCKETS, "jct": BUCKETS}
        what = {"ttft": "time to first token", "tpot": "time per output token after the first",
                "jct": "time from arrival to the last token"}
        self.histograms = {m: registry.histogram(f"microserve_router_arm_{m}_seconds",
                                                 f"A/B requests' {what[m]}, by arm.",
                                                 buckets[m], ["arm"]) for m in MEASURES}

    def record(self, arm: Arm, times: dict[str, float] | None) -> None:
        """One request of `arm` ended: `times` (ttft, tpot when it had more than one output
        token, jct) if it finished, None if it failed."""
        if times is None:
            arm.stats.record(None, None, None, False)
            self.requests.inc(arm=arm.name, outcome="failed")
            return
        good = arm.slo.met(times["ttft"], times.get("tpot"))
        arm.stats.record(times["ttft"], times.get("tpot"), times["jct"], good)
        self.requests.inc(arm=arm.name, outcome="finished")
        if good:
            self.good.inc(arm=arm.name)
        for measure, value in times.items():
            self.histograms[measure].observe(value, arm=arm.name)
