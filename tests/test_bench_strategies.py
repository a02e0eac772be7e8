"""bench.strategies' parts that need no deployment: strategy specs, length draws, schedules.
(tests/test_router_live.py runs the whole benchmark against a live P/D deployment.)"""

from __future__ import annotations

import random
import statistics

import pytest

from bench.strategies import StrategyRun, parse_strategy
from bench.workloads import WORKLOADS, draw_length, schedule


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


# ---- runs whose traffic shifts (--phases) --------------------------------------------------------


def test_phases_parse_and_their_schedule_keeps_each_phase_in_its_seconds():
    from bench.workloads import Phase, parse_phases, phased_schedule

    phases = parse_phases("chat@8:3,40:3/5:1@2:1.5")
    assert phases == [Phase("chat", 8.0, 3.0), Phase("40:3/5:1", 2.0, 1.5)]
    assert phases[1].dists == (("normal", 40.0, 3.0), ("normal", 5.0, 1.0))
    planned = phased_schedule(phases, 2, seed=3)
    assert planned == phased_schedule(phases, 2, seed=3)  # every strategy gets this one
    first = [p for p in planned if p[3] == 0]
    second = [p for p in planned if p[3] == 1]
    assert planned == first + second and len(first) + len(second) == len(planned)
    assert all(0 < t < 3.0 for t, *_ in first) and all(3.0 <= t < 4.5 for t, *_ in second)
    assert [t for t, *_ in planned] == sorted(t for t, *_ in planned)
    assert all(4 <= n_in <= 2048 for _, n_in, _, _ in first)  # chat's clipped lengths
    assert 30 < sum(n_in for _, n_in, _, _ in second) / len(second) < 50
    for bad, message in [("chat@0:5", "rate and seconds must be > 0"),
                         ("x@1:1", "must be one of chat, synthetic, synthetic-5000 or IN:STD"),
                         ("chat:1", "expected WORKLOAD@RATE:SECONDS")]:
        with pytest.raises(ValueError, match=message):
            parse_phases(bad)


def test_phase_report_counts_what_met_the_slo_in_each_phase_and_compares_strategies():
    from bench.slo import SLO
    from bench.workloads import Phase, compare_phases, overall_goodput, phase_report

    phases = [Phase("chat", 1.0, 2.0), Phase("synthetic", 1.0, 4.0)]
    good = {"ttft": 0.5, "tpot": 0.010, "e2e": 1.5}
    slow = {"ttft": 3.0, "tpot": 0.010, "e2e": 4.0}  # TTFT over 2 s
    choppy = {"ttft": 0.5, "tpot": 0.030, "e2e": 3.5}  # TPOT over 25 ms
    answers = [good, good, slow, None, choppy, good, {"error": "503"}]
    phase_of = [0, 0, 0, 1, 1, 1, 1]
    rows = phase_report(phases, phase_of, answers, SLO(), gpus=2)
    assert [(r["requests"], r["completed"], r["met"]) for r in rows] == [(3, 3, 2), (4, 2, 1)]
    assert [r["goodput_per_gpu"] for r in rows] == [2 / 2.0 / 2, 1 / 4.0 / 2]
    assert [(r["jct"]["p50_ms"], r["jct"]["mean_ms"]) for r in rows] == [(1500, 2333.3333333333335),
                                                                        (3500, 2500)]
    assert overall_goodput(rows, 2) == 3 / 6.0 / 2
    runs = [{"strategy": "auto", "phases": rows, "phased_goodput_per_gpu": 0.25},
            {"strategy": "dp", "phases": [{**rows[0], "goodput_per_gpu": 1.0},
                                          {**rows[1], "goodput_per_gpu": 0.1}],
             "phased_goodput_per_gpu": 0.2}]
    assert compare_phases(runs)[1:] == [
        "#                     auto: 0.25 (1.25x) | 0.50 (0.50x) | 0.12 (1.25x)",
        "#                       dp: 0.20 (0.80x) | 1.00 (2.00x) | 0.10 (0.80x)"]


def test_rounds_compare_each_strategy_with_the_first_on_the_same_arrivals():
    from bench.strategies import compare_rounds

    def run(label, rnd, p99, rate=9):
        return {"strategy": label, "round": rnd, "rate_per_gpu": rate, "jct": {"p99_ms": p99}}

    runs = [run("0.3", 0, 2000), run("adaptive", 0, 2200), run("0.3", 1, 4000),
            run("adaptive", 1, 3600), run("0.3", 0, 900, rate=3), run("adaptive", 0, 900, 3)]
    assert compare_rounds(runs) == [
        "# rounds at 3/GPU: P99 JCT ms per round; ratio to 0.3 in the same round (mean [min, max])",
        "#                        0.3: 900  1.000 [1.000, 1.000]",
        "#                   adaptive: 900  1.000 [1.000, 1.000]",
        "# rounds at 9/GPU: P99 JCT ms per round; ratio to 0.3 in the same round (mean [min, max])",
        "#                        0.3: 2000 4000  1.000 [1.000, 1.000]",
        "#                   adaptive: 2200 3600  1.000 [0.900, 1.100]",
    ]


def test_rounds_must_be_at_least_one():
    from bench.strategies import main

    with pytest.raises(SystemExit):
        main(["--base-url", "http://x", "--admin-token", "t", "--strategy", "dp", "--rates", "1",
              "--rounds", "0"])


def test_a_runs_line_shows_each_gpu_engines_busy_share():
    from bench.strategies import _busy

    run = {"wall_s": 20.0, "engine_counters": {
        "prefill-0": {"device_busy_seconds": 19.8}, "decode-0": {"device_busy_seconds": 12.0},
        "cpu-0": {"device_busy_seconds": 0.0}}}
    assert _busy(run) == "; GPU busy: prefill-0 0.99, decode-0 0.60"
    assert _busy({"wall_s": 20.0, "engine_counters": {"cpu-0": {"prompt_tokens": 5}}}) == ""
    assert _busy({"wall_s": 0.0, "engine_counters": {}}) == ""


def test_process_alive_sees_a_running_process_but_not_an_exited_or_zombie_one():
    import subprocess
    import time

    from bench.strategies import process_alive

    running = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    try:
        deadline = time.monotonic() + 10
        while process_alive(zombie.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # `true` exits at once; unreaped, it stays a zombie
        assert process_alive(running.pid)
        assert not process_alive(zombie.pid) and zombie.returncode is None  # not reaped
        assert not process_alive(reaped.pid)
    finally:
        running.kill()
        running.wait()
        zombie.wait()


async def test_waiting_for_a_deployment_whose_process_exited_fails_at_once():
    """pd_two_gpus.sh's `up` died (e.g. a missing package): the bench says so, not after its
    readiness timeout."""
    import argparse
    import subprocess
    import time

    from bench.strategies import Bench

    gone = subprocess.Popen(["true"])
    gone.wait()
    bench = Bench("http://127.0.0.1:9", None, "t", argparse.Namespace())
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"the deployment's process {gone.pid} has exited"):
            await bench.wait_ready(900.0, None, gone.pid)
    finally:
        await bench.close()
    assert time.monotonic() - start < 5


def test_trace_s_takes_seconds_from_zero_and_refuses_the_rest(capsys):
    """--trace-s 0 turns the trace off; a negative, infinite or non-number value is refused
    by the parser (a negative one would poll the router without a pause)."""
    from bench.strategies import parser

    base = ["--base-url", "http://x", "--strategy", "dp", "--rates", "1"]
    assert parser().parse_args([*base, "--trace-s", "0"]).trace_s == 0.0
    assert parser().parse_args([*base, "--trace-s", "0.5"]).trace_s == 0.5
    for bad in ("-1", "inf", "nan", "x"):
        with pytest.raises(SystemExit):
            parser().parse_args([*base, "--trace-s", bad])
        assert "a number of seconds >= 0" in capsys.readouterr().err
