"""router/balance_model.py: the adaptive balance ratio's model, fed engine stats made from a
known cost model (a prefill engine at 26 µs per prompt token; a decode engine whose step takes
6 ms + 50 µs per sequence + 26 µs per prompt token), as the router's poller would see them."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

import pytest

from router.balance_model import BalanceModel


@dataclass(frozen=True)
class Stats:  # the EngineStats counters the model reads
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens_computed: int = 0
    tokens_sampled: int = 0
    idle_seconds: float = 0.0
    device_busy_seconds: float = 0.0  # 0: an engine that does not time steps on a device


B, A, C = 26e-6, 6e-3, 50e-6


def poll(p: Stats, d: Stats, rng: random.Random) -> tuple[Stats, Stats]:
    """Half a second of a loaded P and D: varying prompt work and batch sizes."""
    prompt = rng.randint(8_000, 20_000)
    p = replace(p, steps=p.steps + prompt // 2048 + 1, step_seconds=p.step_seconds + prompt * B,
                prompt_tokens_computed=p.prompt_tokens_computed + prompt)
    steps, batch, tail = rng.randint(40, 80), rng.randint(10, 60), rng.randint(0, 6_000)
    d = replace(d, steps=d.steps + steps, prompt_tokens_computed=d.prompt_tokens_computed + tail,
                tokens_sampled=d.tokens_sampled + steps * batch,
                step_seconds=d.step_seconds + steps * (A + C * batch) + tail * B)
    return p, d


def fed(rate: float, polls: int = 40) -> BalanceModel:
    clock = [0.0]
    model = BalanceModel(now=lambda: clock[0])
    rng = random.Random(0)
    p, d = Stats(), Stats()
    for _ in range(polls):
        model.observe("p", p)
        model.observe("d", d)
        for _ in range(round(rate / 2)):
            model.arrived(3000, 100)
            clock[0] += 0.5 / round(rate / 2)
        p, d = poll(p, d, rng)
    return model


def test_no_pick_before_three_requests_then_one_from_the_priors():
    """At 18 requests/s of 3,000/100 before any poll, the priors (25 µs per prompt token on
    P) say P alone cannot keep up (1.35 of its time): the pick leaves D over a quarter."""
    clock = [0.0]
    model = BalanceModel(now=lambda: clock[0])
    assert model.best(0.0, 0.5) is None
    model.observe("p", Stats())
    model.observe("d", Stats())
    for _ in range(2):
        model.arrived(3000, 100)
        clock[0] += 1 / 18
    assert model.best(0.0, 0.5) is None
    model.arrived(3000, 100)
    best = model.best(0.0, 0.5)
    assert model.p.n == model.d.n == 0 and model.fitted()["p_token_s"] == pytest.approx(25e-6)
    assert 1.35 * (1 - best.ratio) == pytest.approx(best.p_utilisation) and best.p_utilisation < 1
    grid = [model.predict(r / 100, *model.rate()) for r in range(51)]
    assert best.jct_s == min(p.jct_s for p in grid)


def test_the_fits_recover_the_engines_costs():
    f = fed(rate=10, polls=120).fitted()  # a minute of traffic
    assert f["p_token_s"] == pytest.approx(B, rel=0.02)
    assert f["d_step_s"] == pytest.approx(A, rel=0.05)
    assert f["d_per_seq_s"] == pytest.approx(C, rel=0.05)
    assert f["d_token_s"] == pytest.approx(B, rel=0.05)


def test_ps_cost_comes_from_the_polls_where_its_loop_did_not_idle():
    """Polls where P idled half the time show its steps at 80% of the true cost per token
    (their GPU work finished while the loop idled); the fit takes only the saturated ones."""
    model, p = BalanceModel(now=lambda: 0.0), Stats()
    for i in range(40):
        model.observe("p", p)
        prompt = 10_000 + 500 * (i % 7)
        saturated = i % 2 == 0
        busy = prompt * B * (1.0 if saturated else 0.8)
        p = replace(p, steps=p.steps + 5, prompt_tokens_computed=p.prompt_tokens_computed + prompt,
                    step_seconds=p.step_seconds + busy,
                    idle_seconds=p.idle_seconds + (0.005 if saturated else busy))
    assert model.fitted()["p_token_s"] == pytest.approx(B, rel=1e-3)
    assert model.p.n == 20


def test_ps_cost_comes_from_its_device_time_in_every_poll_where_the_engine_reports_it():
    """On a GPU P reports its steps' device time (CUDA events): every poll counts, idle or
    not, and the loop's own step time (here off by 20% either way) is not read."""
    model, p = BalanceModel(now=lambda: 0.0), Stats()
    for i in range(40):
        model.observe("p", p)
        prompt = 10_000 + 500 * (i % 7)
        loop = prompt * B * (0.8 if i % 2 else 1.2)
        p = replace(p, steps=p.steps + 5, prompt_tokens_computed=p.prompt_tokens_computed + prompt,
                    step_seconds=p.step_seconds + loop, idle_seconds=p.idle_seconds + loop,
                    device_busy_seconds=p.device_busy_seconds + prompt * B)
    assert model.fitted()["p_token_s"] == pytest.approx(B, rel=1e-3)
    assert model.p.n == 39


def test_light_load_keeps_prefill_on_p_and_heavy_load_moves_it_to_d():
    light, heavy = fed(rate=4).best(0.0, 0.5), fed(rate=12).best(0.0, 0.5)
    assert light.ratio == 0.0  # P keeps up easily: every token moved to D slows its decode
    # 12 req/s x 3,000 tokens x 26 us = 0.94 of P: its queue dominates, D takes a share
    assert 0.1 <= heavy.ratio <= 0.4
    assert heavy.p_utilisation < 0.9


def test_the_pick_minimises_the_predicted_jct_over_the_grid():
    model = fed(rate=12)
    lam, n, o = model.rate()
    best = model.best(0.0, 0.5)
    grid = [model.predict(r / 100, lam, n, o).jct_s for r in range(0, 51)]
    assert best.jct_s == min(grid)
    assert model.predict(0.0, 30.0, n, o).jct_s == math.inf  # P cannot keep up at all


def test_overload_everywhere_keeps_decoding_fast_and_queues_on_p():
    model = fed(rate=40)
    best = model.best(0.0, 0.5)
    assert best.jct_s == math.inf
    # D's capacity with TPOT <= 3 x 6 ms: (2/3) / (3000 r 26us + 100 x 50us) = P's
    # 1 / (3000 (1 - r) 26us)  ->  r = (2/3 x 0.078 - 0.005) / (0.078 + 2/3 x 0.078) = 0.36
    assert best.ratio == pytest.approx(0.36, abs=0.02)


def test_the_tpot_priced_is_the_one_at_the_quantile_of_the_prompt_tails_landing_on_d():
    """D's TPOT is a / (1 - u - decoding) on average (u: its time on prompt tails); a sequence
    decoding for (o - 1)·TPOT sees k tails on average and, at the 90th percentile, about
    k + 1.2816·√k of them (a Poisson count)."""
    model = BalanceModel(now=lambda: 0.0)
    f = {"p_token_s": 25e-6, "d_step_s": 5e-3, "d_per_seq_s": 100e-6, "d_token_s": 25e-6}
    model.fitted = lambda: f
    lam, n, o, r = 10.0, 3000.0, 100.0, 0.2
    u, decoding = lam * n * r * 25e-6, 100e-6 * lam * o
    mean = 5e-3 / (1 - u - decoding)
    k = lam * (o - 1) * mean
    z = statistics.NormalDist().inv_cdf(0.9)  # 1.2816
    tpot = 5e-3 / (1 - u * (1 + z / math.sqrt(k)) - decoding)
    pred = model.predict(r, lam, n, o)
    assert pred.tpot_s == pytest.approx(tpot, rel=1e-6) and pred.tpot_s > 1.1 * mean
    assert model.predict(0.0, lam, n, o).tpot_s == pytest.approx(5e-3 / (1 - decoding))
    # tails that fit on average but not at the quantile: no stable ratio
    assert 1 - 20.0 * n * 0.5 * 25e-6 - 100e-6 * 20.0 * o > 0  # on average D keeps up
    assert model.predict(0.5, 20.0, n, o).jct_s == math.inf


# The terms the model fitted on two H200s (2026-11-26, random:llama-3.1-8b, 3,000/100 through
# deploy/gpu-1p1d.toml; docs/benchmarks.md), and the fixed ratios measured best there.
H200 = {"p_token_s": 25.3e-6, "d_step_s": 4.8e-3, "d_per_seq_s": 132e-6, "d_token_s": 23e-6}
# The terms it fitted on two H200s on 2026-11-27 at 18 req/s of 3,000/100: its pick then,
# with D's TPOT priced at its mean, sent 0.333 of the prompt tokens to D, and the fixed 0.3
# beat it: P99 JCT 2,823 against 3,420 ms, TPOT p90 15.2 against 25.8 ms.
H200_1127 = {"p_token_s": 24.46e-6, "d_step_s": 4.18e-3, "d_per_seq_s": 128e-6,
             "d_token_s": 26.0e-6}


@pytest.mark.parametrize("rate", [18.0, 24.0])
def test_on_the_terms_fitted_on_two_h200s_it_picks_the_best_measured_ratio(rate, monkeypatch):
    """Of 0.1, 0.2 and 0.3 (and the old rule's 0.41-0.50), 0.3 had the least mean and p99 JCT
    at both rates, and beat 0.333 at 18. At 24 no ratio keeps up and the overload rule picks
    the share that serves the most with D's TPOT within 3x its idle step."""
    model = BalanceModel(now=lambda: 0.0)
    monkeypatch.setattr(model, "fitted", lambda: H200 if rate == 24.0 else H200_1127)
    monkeypatch.setattr(model, "rate", lambda: (rate, 3000.0, 100.0))
    best = model.best(0.0, 0.5)
    if rate == 18.0:
        assert best.ratio == pytest.approx(0.30) and best.p_utilisation < 0.93, best
        assert best.jct_s < model.predict(0.33, rate, 3000.0, 100.0).jct_s
    else:
        assert best.jct_s == math.inf and best.ratio == pytest.approx(0.31, abs=0.02)


def test_two_pairs_fit_each_engine_apart_and_share_the_rate():
    """2P2D: polls of two prefill and two decode engines interleave; each engine's counters
    are differenced against its own, and λ is spread over the engines of each side, so the
    pick at 24 req/s over two pairs is the one-pair pick at 12 req/s."""
    clock = [0.0]
    model = BalanceModel(now=lambda: clock[0])
    rngs = [random.Random(0), random.Random(1)]
    stats = [[Stats(), Stats()], [Stats(), Stats()]]  # [pair][p, d]
    for _ in range(40):
        for i in (0, 1):
            model.observe("p", stats[i][0], f"prefill-{i}")
            model.observe("d", stats[i][1], f"decode-{i}")
        for _ in range(12):
            model.arrived(3000, 100)
            clock[0] += 0.5 / 12
        stats = [list(poll(*pair, rng)) for pair, rng in zip(stats, rngs)]
    f = model.fitted()
    assert f["p_token_s"] == pytest.approx(B, rel=0.02)
    assert f["d_step_s"] == pytest.approx(A, rel=0.05)
    two = model.best(0.0, 0.5, prefills=2, decodes=2)
    one = fed(rate=12).best(0.0, 0.5)
    assert two.ratio == pytest.approx(one.ratio, abs=0.02)
    assert model.best(0.0, 0.5).ratio > two.ratio  # all 24 req/s on one pair: more moves to D
