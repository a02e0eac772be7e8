"""The balance ratio that the engines' measured rates say minimises job completion time.

Balanced P/D (strategies/balanced_pd.py) cuts each prompt of n tokens at s: P prefills
prompt[:s], sends its KV, and D prefills the remaining r = (n - s) / n inside its decode
steps. Moving work to D unloads P (its queue) but slows every sequence D decodes. With the
request rate λ, mean prompt n and output o, this models both sides from what the engines
report (their cumulative step counters, polled twice a second) and picks r:

    P, a queue of prefill work:   S_P = b_P·n(1-r)            the prompt's service time
                                  ρ_P = λ·S_P                  P's utilisation
                                  W_P = S_P·ln(ρ_P / (1-q)) / (2(1-ρ_P))
                                      the wait at quantile q (0.9): M/D/1's wait is about
                                      half M/M/1's, whose tail is ρ·exp(-(1-ρ)t / S)
    D, decoding m sequences:      step(m, c) = a + c_m·m + b_D·c   (c prefill tokens in it)
        D is always stepping; per second λ·n·r·b_D of its time goes to prompt tails, so
        TPOT = (a + c_m·m) / (1 - u),  u = λ·n·r·b_D,  and m = λ·o·TPOT (Little's law):
                                  TPOT = a / (1 - u - c_m·λ·o)
        at quantile q: k = λ·(o - 1)·TPOT prompt tails land on D while a sequence decodes,
        a Poisson count, about k + z_q·√k of them at q:
                                  TPOT_q = a / (1 - u·(1 + z_q/√k) - c_m·λ·o)
    JCT(r) = W_P + S_P + b_D·n·r + (o - 1)·TPOT_q (the transfer's own ms left out: no r in it)

Why the wait's tail and not its mean: the mean's optimum sits where P is ~0.9 busy, a step
from where its queue runs away; the rate the model sees moves a few percent from poll to poll,
and each pick a little low builds a queue that the mean does not price. On two H200s at 9
req/s per GPU the mean's picks ended at 0.3, the best fixed ratio, yet P's queue p50 was 965
ms against 71 at a fixed 0.3, and the P99 JCT +31%. At q the wait grows as ln(ρ/(1-q)) / (1-ρ),
which keeps the pick off that edge. D's TPOT is priced at the same quantile: at its mean the
model picked 0.333 on two H200s at 18 req/s (2026-11-27), TPOT p90 25.8 ms against 15.2 at
a fixed 0.3, P99 JCT +21%; on the terms fitted in that run the quantile's pick is 0.30.

b_P, b_D are seconds per prompt token (P's step time over its prompt tokens, its steps' own
cost included; D's from its steps after the decode part), a and c_m D's decode step time against its batch, all fitted by
exponentially weighted least squares over the polls (`HALF_LIFE` polls), so the model follows
the traffic and the engines as they change. The ratio is the grid point of [lo, hi] with the
least predicted JCT among those where both sides keep up (ρ_P < 1, TPOT finite); where none
does, the one that serves the most requests while D's TPOT stays within 3x its idle step
(`_capacity`): the excess queues on P rather than slowing every decode on D. Until three
requests have arrived, `None`: the strategy uses its fixed ratio. From then on it picks, with
each fit at its prior (Llama-3.1-8B on an H100) until the polls bring data: waiting for the
fits cost the first seconds at a fixed ratio P could not keep up with, and on two H200s at 9
req/s per GPU the queue P built then was not drained in a 28-s run (P99 JCT +43% over the
best fixed ratio, whose share the model's later picks matched).

Why a model and not the old rule (equalise P's and D's queued prefill tokens, a sequence on D
counted as `decode_cost` tokens): on two H100s (2026-11-26) that rule settled at 0.41-0.50 in
every run, while the best fixed ratio was 0.1-0.3 and moved with the rate.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

HALF_LIFE = 20.0  # polls (10 s at the router's 0.5 s): how fast old observations fade
# Arrivals counted over this window for λ. Over 10 s a Poisson stream's count varies ±7.5% at
# 18 req/s, and the pick follows: on two H100s (2026-11-27, 18 req/s of 3,000/100) the 10-s
# rate read 19.6-20 for eight seconds, the picks rose to 0.33-0.35 and D's TPOT p90 to 27 ms
# against 19 at a fixed 0.3 (P99 JCT +26-27% in two runs). Over 30 s the picks were 0.39 at
# the third arrival, then 0.26-0.35, and P99 JCT 0.935x the fixed 0.3's in the same run. The
# model prices a rate that lasts; a burst of a few seconds is better queued on P than pushed
# onto every sequence D decodes.
RATE_WINDOW_S = 30.0
GRID = 0.01  # the ratios tried
OVERLOAD_TPOT = 3.0  # overloaded: D's TPOT kept within this many times its idle step
# P's polls that count, where its engine does not time its steps on the device (CPU; on a GPU
# the fit takes the device's busy seconds, engine/loop_stats.py's DeviceTimeline, and every
# poll counts): those where its loop idled at most this share of the time. Steps ran
# ahead of the GPU (async scheduling), so a step's GPU work finishes while the loop idles after
# it, and its step time then reads the prompt cheaper than it is: on two H200s P's 10-s log
# windows gave 18.7-21.2 µs per prompt token where it idled 16-55% of the time and 23.0-24.4
# where it idled 5% or less; the fit, at 21.3, led the adaptive share to 0.26 where P was
# 0.95 busy.
P_MAX_IDLE = 0.1


def shows_cost(stats, last) -> bool:
    """Whether a poll (EngineStats `last` → `stats`) shows what an engine's steps cost: its
    loop idled at most P_MAX_IDLE of its step and idle time (see above)."""
    busy = stats.step_seconds - last.step_seconds
    idle = stats.idle_seconds - last.idle_seconds
    return idle <= P_MAX_IDLE * (busy + idle)
_PRIOR_B = 25e-6  # s per prompt token (Llama-3.1-8B on an H100: ~40k tokens/s)
_PRIOR_A = 5e-3  # s per decode step at batch 1 (the same)


class Fit:
    """y ≈ Σ x_i·θ_i by exponentially weighted least squares (normal equations, k <= 3).

    A prior keeps the fit defined where the data cannot separate two terms (a steady load
    moves D's steps and sampled tokens together): it counts as `PRIOR_POLLS` observations of
    typical size `scale` that say θ = prior, and does not fade, so a direction the traffic
    never varies stays at its prior while the others follow the data."""

    PRIOR_POLLS = 0.1

    def __init__(self, scale: tuple[float, ...]):
        self.k, self.scale = len(scale), scale
        self.xx = [[0.0] * self.k for _ in range(self.k)]
        self.xy = [0.0] * self.k
        self.n = 0
        self.decay = 0.5 ** (1.0 / HALF_LIFE)

    def add(self, x: tuple[float, ...], y: float) -> None:
        d = self.decay
        for i in range(self.k):
            self.xy[i] = d * self.xy[i] + x[i] * y
            for j in range(self.k):
                self.xx[i][j] = d * self.xx[i][j] + x[i] * x[j]
        self.n += 1

    def solve(self, prior: tuple[float, ...]) -> list[float]:
        w = [self.PRIOR_POLLS * s * s for s in self.scale]
        a = [[self.xx[i][j] + (w[i] if i == j else 0.0) for j in range(self.k)]
             + [self.xy[i] + w[i] * prior[i]] for i in range(self.k)]
        for c in range(self.k):  # Gauss-Jordan with partial pivoting
            p = max(range(c, self.k), key=lambda r: abs(a[r][c]))
            a[c], a[p] = a[p], a[c]
            for r in range(self.k):
                if r != c:
                    f = a[r][c] / a[c][c]
                    a[r] = [v - f * u for v, u in zip(a[r], a[c])]
        return [max(0.0, a[i][self.k] / a[i][i]) for i in range(self.k)]


@dataclass(frozen=True)
class Prediction:
    ratio: float
    jct_s: float  # at the model's quantile
    p_utilisation: float
    tpot_s: float


class BalanceModel:
    """Fed by `observe` (each engine's stats when they change) and `arrived` (each request),
    asked by `best(lo, hi)`."""

    def __init__(self, now=time.monotonic, quantile: float = 0.9,
                 rate_window_s: float = RATE_WINDOW_S):
        self.now, self.quantile = now, quantile  # the JCT minimised is the one at `quantile`
        self.rate_window_s = rate_window_s  # λ: the arrivals of the last this many seconds
        self._z = statistics.NormalDist().inv_cdf(quantile)
        # P: step seconds = b_P·prompt tokens (its steps' own cost spread over the tokens of
        # the chunks it actually runs). D: step seconds = a·steps + c_m·sampled tokens (a
        # decode step samples one per sequence) + b_D·prompt tokens.
        # Scales: a poll's typical counts; priors: D's prompt tokens as dear as P's (one
        # model, one GPU kind) and a decode step's batch adding a tenth per 64 sequences.
        self.p = Fit(scale=(1e4,))
        self.d = Fit(scale=(50.0, 1e3, 1e3))
        self._last: dict[tuple[str, str], object] = {}  # (side, engine) -> stats last taken
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt, output)

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        t = self.now()
        self._arrivals.append((t, prompt_tokens, output_tokens))
        while self._arrivals and self._arrivals[0][0] < t - self.rate_window_s:
            self._arrivals.popleft()

    def observe(self, side: str, stats, engine: str = "") -> None:
        """`stats` (EngineStats) of a prefill (`side` "p") or decode ("d") engine; the
        difference from the last one given for that engine is one observation. Engines of
        one side feed one fit (one model, one GPU kind)."""
        last = self._last.get((side, engine))
        self._last[side, engine] = stats
        if last is None or stats is last:
            return
        steps = stats.steps - last.steps
        busy = stats.step_seconds - last.step_seconds
        prompt = stats.prompt_tokens_computed - last.prompt_tokens_computed
        sampled = stats.tokens_sampled - last.tokens_sampled
        if steps <= 0 or busy <= 0:  # idle (or restarted: counters went back)
            return
        if side == "p":
            device = stats.device_busy_seconds - last.device_busy_seconds
            if device > 0:  # the GPU's own time in steps (CUDA events): exact, idle or not
                self.p.add((prompt,), device)
            elif shows_cost(stats, last):
                self.p.add((prompt,), busy)
        else:
            self.d.add((steps, sampled, prompt), busy)

    def rate(self) -> tuple[float, float, float] | None:
        """(λ requests/s, mean prompt, mean output) over the window, or None yet."""
        if len(self._arrivals) < 3:
            return None
        # k arrivals span k - 1 gaps (k / span would say 27/s for three at 18/s)
        span = max(self._arrivals[-1][0] - self._arrivals[0][0], 1e-3)
        n = sum(a[1] for a in self._arrivals) / len(self._arrivals)
        o = sum(a[2] for a in self._arrivals) / len(self._arrivals)
        return (len(self._arrivals) - 1) / span, n, o

    def fitted(self) -> dict[str, float]:
        """The fitted terms in seconds: P's per prompt token; D's per decode step, per
        sequence in its batch, per prompt token."""
        (b_p,) = self.p.solve((_PRIOR_B,))
        a, c_m, b_d = self.d.solve((_PRIOR_A, _PRIOR_A * 0.1 / 64, b_p))
        return {"p_token_s": b_p, "d_step_s": a, "d_per_seq_s": c_m, "d_token_s": b_d}

    def predict(self, ratio: float, lam: float, n: float, o: float, prefills: int = 1,
                decodes: int = 1) -> Prediction:
        """JCT at `ratio` with λ spread evenly over `prefills` P and `decodes` D engines."""
        f = self.fitted()
        b_p, a, c_m, b_d = f["p_token_s"], f["d_step_s"], f["d_per_seq_s"], f["d_token_s"]
        lam_p, lam_d = lam / max(prefills, 1), lam / max(decodes, 1)
        service = b_p * n * (1 - ratio)
        rho = lam_p * service
        tails = lam_d * n * ratio * b_d  # D's share of time on prompt tails, on average
        decoding = c_m * lam_d * o
        free = 1 - tails - decoding
        tpot = a / free if free > 0 else math.inf
        if rho >= 1 or not math.isfinite(tpot):
            return Prediction(ratio, math.inf, rho, tpot)
        wait = service * math.log(rho / (1 - self.quantile)) / (2 * (1 - rho)) \
            if rho > 1 - self.quantile else 0.0
        # the TPOT at the quantile: the prompt tails that land on D while a sequence decodes
        # (k on average over its (o - 1)·TPOT) are a Poisson count, at the quantile about
        # k + z·√k of them
        k = lam_d * max(o - 1, 0) * tpot
        surge = 1 + self._z / math.sqrt(k) if k > 0 else 1.0
        free_q = 1 - tails * surge - decoding
        if free_q <= 0:
            return Prediction(ratio, math.inf, rho, math.inf)
        tpot_q = a / free_q
        jct = wait + service + b_d * n * ratio + max(o - 1, 0) * tpot_q
        return Prediction(ratio, jct, rho, tpot_q)

    def best(self, lo: float, hi: float, prefills: int = 1, decodes: int = 1
             ) -> Prediction | None:
        """The ratio in [lo, hi] with the least predicted JCT for the engines there are;
        None until there is data."""
        load = self.rate()
        if load is None:
            return None
        steps = max(0, round((hi - lo) / GRID))
        ratios = [lo + (hi - lo) * i / steps for i in range(steps + 1)] if steps else [lo]
        preds = [self.predict(r, *load, prefills, decodes) for r in ratios]
        stable = [p for p in preds if math.isfinite(p.jct_s)]
        if stable:
            return min(stable, key=lambda p: p.jct_s)
        return max(preds, key=lambda p: self._capacity(p.ratio, *load[1:], prefills, decodes))

    def _capacity(self, ratio: float, n: float, o: float, prefills: int = 1,
                  decodes: int = 1) -> float:
        """Requests/s the engines serve at `ratio` with D's TPOT held within OVERLOAD_TPOT
        times its idle step: where no ratio keeps up, the share that serves the most while
        decoding stays fast. The excess then waits in P's queue (and is refused there after
        the queue time), where it costs time to first token only; pushed onto D it would
        slow every sequence D decodes (2xH200, 24 req/s of 3,000/100: ratio 0.3 gave a mean
        JCT of 5.8 s, the ratio that loads both sides equally, 0.43, 10.1 s)."""
        f = self.fitted()
        p_cap = 1 / max(n * (1 - ratio) * f["p_token_s"], 1e-12)
        d_cost = n * ratio * f["d_token_s"] + f["d_per_seq_s"] * o
        d_cap = (1 - 1 / OVERLOAD_TPOT) / max(d_cost, 1e-12)
        return min(prefills * p_cap, decodes * d_cap)
