"""bench/pd_sim.py: the discrete-event model of balanced P/D gives the times its cost model says,
and its adaptive policy picks through router/balance_model.py."""

from __future__ import annotations

import pytest

from bench.pd_sim import H100X2, simulate, summary


def test_one_request_takes_ps_head_ds_tail_step_then_its_decode_steps():
    [done] = simulate(rate=1.0, requests=1, n=3000, o=100, policy="fixed:0.3", seed=0)
    b_p, a, c_m, b_d = (H100X2[k] for k in ("p_token_s", "d_step_s", "d_per_seq_s",
                                            "d_token_s"))
    handed = done.arrival + b_p * 2100  # P's head: 70% of the prompt
    assert done.first == pytest.approx(handed + a + b_d * 900)  # D's tail in one step
    assert done.end == pytest.approx(done.first + 99 * (a + c_m))  # 99 steps, batch of one
    assert done.share == 0.3


def test_tails_share_ds_steps_within_its_budget_and_decodes_slow_with_the_batch():
    """Two requests at once, half of each prompt on D: P hands the second over while D runs
    the first's tail; D's next step decodes the first (a batch of one) and runs the second's
    whole tail; the step after decodes both."""
    runs = simulate(rate=1e6, requests=2, n=3000, o=3, policy="fixed:0.5", seed=0)
    first, second = sorted(runs, key=lambda d: d.first)
    a, c_m, b_d = (H100X2[k] for k in ("d_step_s", "d_per_seq_s", "d_token_s"))
    assert second.first - first.first == pytest.approx(a + c_m + b_d * 1500)
    assert first.end == pytest.approx(second.first + a + 2 * c_m)  # its third token
    assert second.end == pytest.approx(first.end + a + c_m)  # alone again


def test_adaptive_runs_are_seeded_and_summarised():
    one = simulate(18.0, 200, 3000, 100, "adaptive:30", seed=1)
    assert one == simulate(18.0, 200, 3000, 100, "adaptive:30", seed=1)
    s = summary(one, 100)
    assert len(one) == 200 and 0.0 < s["share"] < 0.5
    assert s["jct_p99_s"] > s["ttft_p99_s"] > 0 and s["tpot_p99_ms"] >= s["tpot_p90_ms"]


def test_data_parallel_prefills_in_chunks_and_decodes_on_each_engine():
    """Two requests at once go one to each engine: each prefills its 3,000 tokens in two
    steps (2,048 + 952, at P's cost per token), then decodes alone."""
    from bench.pd_sim import data_parallel
    runs = data_parallel(rate=1e6, requests=2, n=3000, o=3, seed=0)
    a, c_m, b = (H100X2[k] for k in ("d_step_s", "d_per_seq_s", "p_token_s"))
    for done in runs:
        assert done.first == pytest.approx(done.arrival + 2 * a + b * 3000)
        assert done.end == pytest.approx(done.first + 2 * (a + c_m))
        assert done.share == 0.0


def test_bench_arrivals_are_the_times_bench_strategies_sends():
    """`--arrivals bench` replays a measured run: the schedule bench.strategies draws for a
    rate in all and a seed, the same times whatever the policy."""
    from bench.pd_sim import arrival_times
    from bench.workloads import WORKLOADS, schedule

    want = [t for t, _, _ in schedule(50, 18.0, WORKLOADS["synthetic"], 0)]
    assert arrival_times(18.0, 50, 0, "bench") == want
    assert arrival_times(18.0, 50, 0, "poisson") != want
    runs = simulate(18.0, 50, 3000, 100, "fixed:0.3", 0, source="bench")
    assert sorted(d.arrival for d in runs) == want
    with pytest.raises(ValueError, match="poisson or bench"):
        arrival_times(18.0, 5, 0, "trace")


def test_a_roofline_step_costs_the_larger_of_its_decode_and_its_prompt_chunk():
    [done] = simulate(rate=1.0, requests=1, n=3000, o=100, policy="fixed:0.3", seed=0,
                      cost="roofline")
    b_p, a, c_m, b_d = (H100X2[k] for k in ("p_token_s", "d_step_s", "d_per_seq_s",
                                            "d_token_s"))
    handed = done.arrival + b_p * 2100
    assert done.first == pytest.approx(handed + max(a, b_d * 900))  # the weights read once
    assert done.end == pytest.approx(done.first + 99 * (a + c_m))
    with pytest.raises(ValueError, match="step cost 'sum'"):
        simulate(1.0, 1, 3000, 100, "fixed:0.3", 0, cost="sum")


def test_a_prompt_tokens_cost_grows_with_the_tokens_before_it():
    """ctx_s: a token at position p costs b + ctx_s·p, on P (positions 0..s-1) and on D (its
    tail, s..n-1), so a tail of the same length costs D more than a head costs P."""
    terms = dict(H100X2, ctx_s=1e-9)
    [done] = simulate(rate=1.0, requests=1, n=3000, o=2, policy="fixed:0.3", seed=0,
                      terms=terms, cost="roofline")
    b_p, a, c_m, b_d = (terms[k] for k in ("p_token_s", "d_step_s", "d_per_seq_s",
                                           "d_token_s"))
    handed = done.arrival + b_p * 2100 + 1e-9 * 2100 * 2099 / 2
    tail = b_d * 900 + 1e-9 * (900 * 2100 + 900 * 899 / 2)  # positions 2,100..2,999
    assert done.first == pytest.approx(handed + max(a, tail))
    assert done.end == pytest.approx(done.first + a + c_m)
