"""bench.strategies' parts that need no deployment: strategy specs, length draws, schedules.
(tests/test_router_live.py runs the whole benchmark against a live P/D deployment.)"""

from __future__ import annotations

import random
import statistics

import pytest

from bench.strategies import WORKLOADS, StrategyRun, draw_length, parse_strategy, schedule


@pytest.mark.parametrize("text, want", [
    ("dp", StrategyRun("dp", "data_parallel", {})),
    ("1p1d", StrategyRun("1p1d", "pd", {})),
    ("1p2d", StrategyRun("1p2d", "pd", {})),
    ("1p1d-balance-0.2", StrategyRun("1p1d-balance-0.2", "balanced_pd", {"ratio": 0.2})),
    ("1p1d-balance-adaptive", StrategyRun("1p1d-balance-adaptive", "balanced_pd",
                                          {"adaptive": True})),
    ("dp3=data_parallel@g0,g1,g2", StrategyRun("dp3", "data_parallel", {}, ["g0", "g1", "g2"])),
    ('bal=balanced_pd{"ratio": 0.25}', StrategyRun("bal", "balanced_pd", {"ratio": 0.25})),
    ("dp@decode-0", StrategyRun("dp", "data_parallel", {}, ["decode-0"])),
    ("least=data_parallel", StrategyRun("least", "data_parallel", {})),
])
def test_strategy_specs(text, want):
    assert parse_strategy(text) == want


@pytest.mark.parametrize("text", ["nonsense", "1p1d-balance-2", 'x=pd{"ratio": }', "a b"])
def test_bad_strategy_specs_say_why(text):
    with pytest.raises(ValueError, match="strategy"):
        parse_strategy(text)


def test_a_preset_mutated_by_one_run_stays_intact():
    parse_strategy("1p1d-balance-adaptive").args["ratio"] = 0.5
    assert parse_strategy("1p1d-balance-adaptive").args == {"adaptive": True}


def test_workload_lengths_have_the_papers_means():
    rng = random.Random(0)
    synthetic_in = [draw_length(rng, WORKLOADS["synthetic"][0]) for _ in range(20000)]
    assert abs(statistics.fmean(synthetic_in) - 3000) < 0.2
    assert 4.8 < statistics.pstdev(synthetic_in) < 5.2
    chat_in = [draw_length(rng, WORKLOADS["chat"][0]) for _ in range(50000)]
    chat_out = [draw_length(rng, WORKLOADS["chat"][1]) for _ in range(50000)]
    assert abs(statistics.fmean(chat_in) - 200) < 6 and abs(statistics.fmean(chat_out) - 260) < 6
    assert min(chat_in) >= 4 and max(chat_out) <= 2048


def test_schedules_repeat_per_rate_and_arrive_at_the_rate():
    a = schedule(4000, 5.0, WORKLOADS["synthetic"], seed=3)
    assert a == schedule(4000, 5.0, WORKLOADS["synthetic"], seed=3)  # every strategy sees it
    assert a != schedule(4000, 5.0, WORKLOADS["synthetic"], seed=4)
    times = [t for t, _, _ in a]
    assert times[0] == 0.0 and times == sorted(times)
    assert abs(times[-1] / (len(times) - 1) - 1 / 5.0) < 0.01  # mean gap 1 / rate


def test_plot_lines_come_from_the_recorded_runs(tmp_path):
    """series() takes each strategy's runs in rate order (JCT in seconds, hollow when not every
    request answered), and plot() draws the recorded pipeline check to a PNG."""
    import json
    from pathlib import Path

    from bench.plot_strategies import plot, series

    runs = [
        {"strategy": "dp", "rate_per_gpu": 2.0, "completed": 9, "requests": 10,
         "jct": {"mean_ms": 2500.0, "p99_ms": 4000.0}, "ttft": {"mean_ms": 80.0}},
        {"strategy": "dp", "rate_per_gpu": 1.0, "completed": 5, "requests": 5,
         "jct": {"mean_ms": 1500.0, "p99_ms": 2000.0}, "ttft": {"mean_ms": 50.0}},
        {"strategy": "pd", "rate_per_gpu": 1.0, "completed": 0, "requests": 5,
         "jct": {}, "ttft": {}},
    ]
    assert series(runs, "jct", "p99_ms") == {"dp": [(1.0, 2.0, True), (2.0, 4.0, False)]}
    assert series(runs, "ttft", "mean_ms") == {"dp": [(1.0, 50.0, True), (2.0, 80.0, False)]}
    record = json.loads((Path(__file__).parent.parent / "docs/strategies/cpu-pipeline.json")
                        .read_text())
    pytest.importorskip("matplotlib")
    for layout in ("latency", "ratio"):
        out = tmp_path / f"{layout}.png"
        plot([record], layout, str(out), None)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rates_are_per_gpu_rates_or_closed_loops():
    from bench.strategies import parse_rate

    assert [parse_rate(r) for r in ("0.5", "12", "c1", "c16")] == [0.5, 12.0, "c1", "c16"]
    for bad, why in (("c0", "a number"), ("0", "must be > 0"), ("fast", "a number"),
                     ("nan", "must be > 0")):
        with pytest.raises(ValueError, match=why):
            parse_rate(bad)
