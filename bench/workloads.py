"""What `bench.strategies` sends, and when: the workloads' lengths, Poisson schedules at one
rate, and runs whose traffic shifts (`--phases`, issue 44's `auto` target):

    --phases chat@8:60,synthetic@3:60,chat@8:60

Each phase is WORKLOAD@RATE:SECONDS: Poisson arrivals at RATE requests/s per GPU of that
workload's lengths (a name of WORKLOADS, or IN:STD/OUT:STD normal lengths such as 500:50/100:10)
for SECONDS, one phase after the other with no pause. Every strategy gets the same schedule
(the lengths and arrival times), with token ids of its own. A request belongs to the phase it
arrived in; each phase's goodput is the requests of that phase that met the SLO per second of
the phase and per GPU, and the whole run's is the sum over the phases' seconds.
`compare_phases` puts strategies side by side: each one's goodput over the run and in each
phase as a ratio to the best of the others.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from bench.serve import pct
from bench.slo import SLO

# (distribution, mean, spread) per workload and side; "normal": spread is the std deviation,
# "lognormal": spread is sigma of the log, and the mean is the distribution's mean.
WORKLOADS = {
    "synthetic": (("normal", 3000, 5), ("normal", 100, 5)),
    "synthetic-5000": (("normal", 5000, 5), ("normal", 100, 5)),
    "chat": (("lognormal", 200, 1.0), ("lognormal", 260, 0.8)),
}
CHAT_CLIP = (4, 2048)


def parse_lengths(text: str) -> tuple[str, float, float]:
    mean, _, std = text.partition(":")
    return "normal", float(mean), float(std or 0)


def draw_length(rng: random.Random, dist: tuple[str, float, float]) -> int:
    kind, mean, spread = dist
    if kind == "normal":
        return max(1, round(rng.gauss(mean, spread)))
    mu = math.log(mean) - spread * spread / 2  # a log-normal's mean is exp(mu + sigma^2 / 2)
    return min(max(round(rng.lognormvariate(mu, spread)), CHAT_CLIP[0]), CHAT_CLIP[1])


def schedule(n: int, rate: float, dists, seed: int) -> list[tuple[float, int, int]]:
    """n requests: (arrival time in s from the run's start, input length, output length).
    The same for every strategy at one rate."""
    rng = random.Random(f"{seed}/{float(rate)!r}")
    t, out = 0.0, []
    for _ in range(n):
        out.append((t, draw_length(rng, dists[0]), draw_length(rng, dists[1])))
        t += rng.expovariate(rate)
    return out


_LENGTHS = re.compile(r"\d+(\.\d+)?(:\d+(\.\d+)?)?/\d+(\.\d+)?(:\d+(\.\d+)?)?$")
_PHASE = re.compile(r"(?P<workload>[\w.:/-]+)@(?P<rate>[\d.]+):(?P<seconds>[\d.]+)$")


@dataclass(frozen=True)
class Phase:
    workload: str  # a name of WORKLOADS, or input and output lengths as IN:STD/OUT:STD
    rate_per_gpu: float
    seconds: float

    @property
    def dists(self):
        if self.workload in WORKLOADS:
            return WORKLOADS[self.workload]
        n_in, _, n_out = self.workload.partition("/")
        return parse_lengths(n_in), parse_lengths(n_out)


def parse_phases(text: str) -> list[Phase]:
    phases = []
    for part in text.split(","):
        m = _PHASE.match(part.strip())
        if m is None:
            raise ValueError(f"phase {part!r}: expected WORKLOAD@RATE:SECONDS, e.g. chat@8:60")
        phase = Phase(m["workload"], float(m["rate"]), float(m["seconds"]))
        if phase.workload not in WORKLOADS and not _LENGTHS.match(phase.workload):
            raise ValueError(f"phase {part!r}: the workload must be one of "
                             f"{', '.join(sorted(WORKLOADS))} or IN:STD/OUT:STD")
        if not (phase.rate_per_gpu > 0 and phase.seconds > 0):
            raise ValueError(f"phase {part!r}: rate and seconds must be > 0")
        phases.append(phase)
    return phases


def phased_schedule(phases: list[Phase], gpus: int, seed: int
                    ) -> list[tuple[float, int, int, int]]:
    """(arrival s from the run's start, input length, output length, phase index) for every
    request: each phase's Poisson arrivals within its own seconds."""
    out, start = [], 0.0
    for k, phase in enumerate(phases):
        rng = random.Random(f"{seed}/phase/{k}/{phase.workload}/{phase.rate_per_gpu!r}")
        dists, t = phase.dists, start + rng.expovariate(phase.rate_per_gpu * gpus)
        while t < start + phase.seconds:
            out.append((t, draw_length(rng, dists[0]), draw_length(rng, dists[1]), k))
            t += rng.expovariate(phase.rate_per_gpu * gpus)
        start += phase.seconds
    return out


def phase_report(phases: list[Phase], phase_of: list[int], answers: list[dict | None], slo: SLO,
           gpus: int) -> list[dict]:
    """Per phase: its requests, those answered and those meeting the SLO, goodput per GPU
    over the phase's seconds, TTFT, TPOT and JCT percentiles. `answers[i]`: request i's record
    (bench.serve.one's), None or with "error" if it did not answer."""
    rows = []
    for k, phase in enumerate(phases):
        mine = [a for a, p in zip(answers, phase_of) if p == k]
        ok = [a for a in mine if a is not None and "error" not in a]
        met = sum(slo.met(a) for a in ok)
        rows.append({"workload": phase.workload, "rate_per_gpu": phase.rate_per_gpu,
                     "seconds": phase.seconds, "requests": len(mine), "completed": len(ok),
                     "met": met, "goodput_per_gpu": met / phase.seconds / gpus,
                     "ttft": pct([a["ttft"] for a in ok]), "tpot": pct([a["tpot"] for a in ok]),
                     "jct": pct([a["e2e"] for a in ok])})
    return rows


def overall_goodput(rows: list[dict], gpus: int) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["met"] for r in rows) / seconds / gpus if seconds else 0.0


def compare_phases(runs: list[dict]) -> list[str]:
    """Lines putting phased runs side by side: per strategy, its goodput over the run and in
    each phase, and its ratio to the best other strategy's (issue 44: `auto` >= 1.1x over the
    run, within 5% of the best in every phase)."""
    if len(runs) < 2:
        return []
    lines = ["# goodput per GPU (ratio to the best other strategy): whole run | each phase"]
    for run in runs:
        others = [r for r in runs if r is not run]

        def ratio(mine: float, theirs: list[float]) -> str:
            best = max(theirs)
            return f"{mine:.2f} ({mine / best:.2f}x)" if best > 0 else f"{mine:.2f} (-)"

        whole = ratio(run["phased_goodput_per_gpu"], [r["phased_goodput_per_gpu"] for r in others])
        each = [ratio(p["goodput_per_gpu"], [r["phases"][k]["goodput_per_gpu"] for r in others])
                for k, p in enumerate(run["phases"])]
        lines.append(f"# {run['strategy']:>24}: {whole} | " + " | ".join(each))
    return lines
