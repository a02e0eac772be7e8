"""A discrete-event model of balanced P/D on one P and one D, for choosing the adaptive ratio's
settings before spending GPU time on them. Not a benchmark: every figure it prints comes from
the cost model below, whose terms are what router/balance_model.py fitted on the GPUs.

    P: one FIFO queue; a request's head (prompt[:s]) costs b_P·s seconds.
    D: steps back to back while it has work. A step runs every decoding sequence (one token
       each) and up to `budget` tokens of prompt tails in arrival order, and takes
       a + c_m·(decoding sequences) + b_D·(tail tokens) seconds. A tail finished in a step
       gives its first token at the step's end; each later step gives one more.

A request of n prompt tokens arrives (Poisson), waits for P, is handed to D when P is done
(the transfer's time left out: no share changes it) and leaves after o tokens. The share left
to D is fixed, or picked by router/balance_model.py's model from the arrivals it has seen,
every `poll_s` (the router polls its engines twice a second), with the cost terms given rather
than fitted: what the simulation isolates is how the picks follow the rate it reads.

    python -m bench.pd_sim --rate 18 --policy fixed:0.3 --policy adaptive:10 \
        --policy adaptive:30 --seeds 8

`--policy dp` runs the same arrivals round robin over two engines that each prefill (chunked,
in the order prompts came) and decode, with D's step terms: data parallel on the same two
GPUs, what balanced P/D is measured against. Over eight of its own arrival seeds it put data
parallel's P99 JCT at 18 req/s within 2% of one measured run on two H200s (2026-11-28); on
that run's own arrivals (`--arrivals bench`) it is 20-45% too slow with the terms added, and
no variant here (`--step-cost`, `--terms`) puts the GPUs' P/D and data parallel both within
10% (docs/benchmarks.md, "P/D with the device's own step times").
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import deque
from dataclasses import dataclass

from bench.workloads import WORKLOADS, schedule
from router.balance_model import BalanceModel

# The terms fitted on two H100s at 18 req/s of 3,000/100 (2026-11-27, call 6 of
# docs/benchmarks.md's "The GPU suites after the restructuring ..." section)
H100X2 = {"p_token_s": 23.94e-6, "d_step_s": 5.97e-3, "d_per_seq_s": 135e-6,
          "d_token_s": 22.5e-6}
# ... and on two H200s at 18 req/s (2026-11-28, the adaptive run of docs/benchmarks.md's "P/D at
# concurrency 1 after the page copy stopped compiling at run time" section)
H200X2 = {"p_token_s": 23.1e-6, "d_step_s": 5.0e-3, "d_per_seq_s": 101e-6, "d_token_s": 24.1e-6}
# ... and on two H200s at 20 req/s with P's cost from its device time (CUDA events; the host's
# step time read it 3-7% cheap), 2026-11-28, "P/D with the device's own step times"
H200X2_DEVICE = {"p_token_s": 24.9e-6, "d_step_s": 4.86e-3, "d_per_seq_s": 117e-6,
                 "d_token_s": 24.1e-6}
# ... and with a prompt token's cost growing with the tokens before it (`ctx_s`: attention), from
# the device timeline's step times on two H200s (2026-11-28, call 7 of "P/D with the device's own
# step times"): P's 24.7 µs a token over positions 0-2,099, D's tail steps over 2,100-2,999, and
# the decode-only steps' 6.93 / 8.87 ms at batches 12.9 / 27.0. Meant with `--step-cost roofline`.
H200X2_CTX = {"p_token_s": 23.2e-6, "d_step_s": 5.16e-3, "d_per_seq_s": 137e-6,
              "d_token_s": 23.2e-6, "ctx_s": 1.46e-9}
TERMS = {"h100x2": H100X2, "h200x2": H200X2, "h200x2-device": H200X2_DEVICE,
         "h200x2-ctx": H200X2_CTX}
COSTS = ("additive", "roofline")  # what a mixed step costs (mixed_engine)


@dataclass
class Done:
    arrival: float
    first: float  # first token
    end: float
    share: float


def simulate(rate: float, requests: int, n: int, o: int, policy: str, seed: int,
             terms: dict = H100X2, budget: int = 2048, poll_s: float = 0.5,
             source: str = "poisson", cost: str = "additive") -> list[Done]:
    """One run: `requests` Poisson arrivals at `rate` of n prompt and o output tokens each,
    under `policy` ("fixed:R" or "adaptive:WINDOW_S"); `source` as `arrival_times`'."""
    kind, _, arg = policy.partition(":")
    clock = [0.0]
    model = None
    if kind == "adaptive":
        model = BalanceModel(now=lambda: clock[0], rate_window_s=float(arg))
        model.fitted = lambda: terms
    share, next_poll = 0.2 if model else float(arg), 0.0
    b_p, a, c_m, b_d = (terms["p_token_s"], terms["d_step_s"], terms["d_per_seq_s"],
                        terms["d_token_s"])
    ctx = terms.get("ctx_s", 0.0)
    # P: FIFO; each request's hand-over time to D
    handed = []  # (time at D, arrival, tail tokens, share)
    p_free = 0.0
    for arrival in arrival_times(rate, requests, seed, source):
        clock[0] = arrival
        if model is not None:
            model.arrived(n, o)
            if arrival >= next_poll:
                best = model.best(0.0, 0.5)
                share = share if best is None else best.ratio
                next_poll = arrival + poll_s
        tail = max(1, round(share * n))
        start = max(arrival, p_free)
        p_free = start + prompt_cost(b_p, ctx, 0, n - tail)
        handed.append((p_free, arrival, tail, share))
    handed.sort()
    return mixed_engine(handed, o, a, c_m, b_d, budget, cost, n, ctx)


def arrival_times(rate: float, requests: int, seed: int, source: str = "poisson"
                  ) -> list[float]:
    """`source` "poisson": this model's own arrivals; "bench": the very times
    `bench.strategies` sends at that rate in all and seed (bench/workloads.py's schedule), so
    that a run of the model replays a measured run's arrivals."""
    if source == "bench":
        return [t for t, _, _ in schedule(requests, rate, WORKLOADS["synthetic"], seed)]
    if source != "poisson":
        raise ValueError(f"arrivals {source!r}: poisson or bench")
    return poisson(rate, requests, seed)


def prompt_cost(per_token: float, ctx: float, first: int, count: int) -> float:
    """Seconds for prompt tokens at positions [first, first + count): each `per_token` plus
    `ctx` per token before it."""
    return per_token * count + ctx * (count * first + count * (count - 1) / 2)


def poisson(rate: float, requests: int, seed: int) -> list[float]:
    """`requests` Poisson arrival times at `rate`, the same for every policy of a seed."""
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


def mixed_engine(handed: list[tuple], o: int, a: float, c_m: float, b_d: float,
                 budget: int, cost: str = "additive", n: int = 0, ctx_s: float = 0.0
                 ) -> list[Done]:
    """One engine stepping back to back while it has work: each step decodes every sequence
    and computes up to `budget` tokens of prompts (in the order they came), and takes
    a + c_m·(decoding) + b_d·(prompt tokens) (`cost` "additive"), or max(a, b_d·(prompt
    tokens)) + c_m·(decoding) ("roofline": the weights a decode step reads are read once by a
    step whose prompt chunk keeps the GPU computing that long anyway). A prompt token at
    position p costs b_d + ctx_s·p (attention over the p tokens before it; `n`: the prompts'
    length, a request's tokens being its last ones). `handed`: (time it may start, arrival,
    prompt tokens it computes, share) per request, sorted."""
    if cost not in COSTS:
        raise ValueError(f"step cost {cost!r}: one of {COSTS}")
    out: list[Done] = []
    tails: deque[list] = deque()  # [tokens left, arrival, share, next position]
    decoding: list[tuple[int, int, float, float, float]] = []  # (left, id, arrival, first, share)
    now, i, k = 0.0, 0, 0
    while i < len(handed) or tails or decoding:
        if not tails and not decoding:
            now = max(now, handed[i][0])
        while i < len(handed) and handed[i][0] <= now:
            _, arrival, tail, s = handed[i]
            tails.append([tail, arrival, s, max(0, n - tail)])
            i += 1
        room = budget - len(decoding)
        taken, finished_tails, prompt_s = 0, [], 0.0
        for entry in tails:
            if room - taken <= 0:
                break
            step = min(entry[0], room - taken)
            prompt_s += prompt_cost(b_d, ctx_s, entry[3], step)
            entry[0] -= step
            entry[3] += step
            taken += step
            if entry[0] == 0:
                finished_tails.append(entry)
        if cost == "roofline":
            now += max(a, prompt_s) + c_m * len(decoding)
        else:
            now += a + c_m * len(decoding) + prompt_s
        still = []
        for left, rid, arrival, first, s in decoding:
            if left == 1:
                out.append(Done(arrival, first, now, s))
            else:
                still.append((left - 1, rid, arrival, first, s))
        decoding = still
        for entry in finished_tails:
            tails.remove(entry)
            k += 1
            if o == 1:
                out.append(Done(entry[1], now, now, entry[2]))
            else:
                decoding.append((o - 1, k, entry[1], now, entry[2]))
    return out


def data_parallel(rate: float, requests: int, n: int, o: int, seed: int, terms: dict = H100X2,
                  budget: int = 2048, source: str = "poisson", cost: str = "additive"
                  ) -> list[Done]:
    """The same arrivals round robin over two engines that each prefill and decode (the
    `dp` strategy), with D's step terms (prompt tokens at P's cost)."""
    arrivals = arrival_times(rate, requests, seed, source)
    out = []
    for half in (arrivals[0::2], arrivals[1::2]):
        out += mixed_engine([(t, t, n, 0.0) for t in half], o, terms["d_step_s"],
                            terms["d_per_seq_s"], terms["p_token_s"], budget, cost, n,
                            terms.get("ctx_s", 0.0))
    return out


def summary(done: list[Done], o: int) -> dict:
    def q(xs, p):
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]

    jct = [d.end - d.arrival for d in done]
    ttft = [d.first - d.arrival for d in done]
    tpot = [(d.end - d.first) / (o - 1) for d in done] if o > 1 else [0.0]
    return {"jct_p99_s": q(jct, 99), "jct_mean_s": statistics.fmean(jct),
            "ttft_p99_s": q(ttft, 99), "tpot_p90_ms": 1e3 * q(tpot, 90),
            "tpot_p99_ms": 1e3 * q(tpot, 99), "share": statistics.fmean(d.share for d in done)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, nargs="+", default=[18.0], help="requests/s in all")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--prompt", type=int, default=3000)
    ap.add_argument("--output", type=int, default=100)
    ap.add_argument("--policy", action="append", required=True,
                    help="fixed:RATIO, adaptive:RATE_WINDOW_S or dp; repeat")
    ap.add_argument("--terms", choices=sorted(TERMS), default="h100x2",
                    help="the cost terms (see TERMS): fitted on two H100s, on two H200s from "
                         "host times, from device times, or with a per-position cost")
    ap.add_argument("--seeds", type=int, default=8, help="runs per policy, seeds 0..N-1")
    ap.add_argument("--arrivals", choices=("poisson", "bench"), default="poisson",
                    help="bench: the arrival times bench.strategies sends at this rate and "
                         "seed (3,000/100 synthetic), to replay a measured run")
    ap.add_argument("--step-cost", choices=COSTS, default="additive",
                    help="a mixed step's cost: its terms added, or roofline (max of the "
                         "decode step's and the prompt chunk's, plus the per-sequence term)")
    args = ap.parse_args()
    terms = TERMS[args.terms]
    for rate in args.rate:
        base = None
        for policy in args.policy:
            def run(seed: int) -> list[Done]:
                if policy == "dp":
                    return data_parallel(rate, args.requests, args.prompt, args.output, seed,
                                         terms, source=args.arrivals, cost=args.step_cost)
                return simulate(rate, args.requests, args.prompt, args.output, policy, seed,
                                terms, source=args.arrivals, cost=args.step_cost)
            runs = [summary(run(seed), args.output) for seed in range(args.seeds)]
            mean = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
            base = base or mean
            print(f"{rate:5.1f}/s {policy:>14}: P99 JCT {mean['jct_p99_s']:.2f} s "
                  f"({mean['jct_p99_s'] / base['jct_p99_s']:.3f}x the first), TTFT p99 "
                  f"{mean['ttft_p99_s']:.2f} s, TPOT p90/p99 {mean['tpot_p90_ms']:.1f}/"
                  f"{mean['tpot_p99_ms']:.1f} ms, share {mean['share']:.3f} "
                  f"(mean of {args.seeds} seeds)")


if __name__ == "__main__":
    main()
