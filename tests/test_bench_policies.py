"""bench.serve's heavy-tailed workload and bench.policies' command line (no engine: the CPU run
is in docs/benchmarks.md)."""

import argparse
import math
import statistics

import pytest

from bench import policies
from bench.serve import draw_len, workload, workload_options


def args(*argv):
    ap = argparse.ArgumentParser()
    workload_options(ap)
    return ap.parse_args(list(argv))


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    a = workload(args("--workload", "heavy-tail", "--num-requests", "50", "--seed", "3"))
    assert a == workload(args("--workload", "heavy-tail", "--num-requests", "50", "--seed", "3"))
    assert a != workload(args("--workload", "heavy-tail", "--num-requests", "50", "--seed", "4"))


def test_lognormal_lengths_have_the_documented_median_and_tail():
    """lognormal:128:1.2: median exp(ln 128 - 0.72) = 62, p99 exp(mu + 2.326 sigma) = 1,016."""
    import random

    rng = random.Random(0)
    draws = sorted(draw_len(rng, "lognormal:128:1.2", 10**6) for _ in range(20000))
    mu = math.log(128) - 0.72
    assert statistics.median(draws) == pytest.approx(math.exp(mu), rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(math.exp(mu + 2.326 * 1.2), rel=0.1)
    assert statistics.fmean(draws) == pytest.approx(128, rel=0.1)
    assert max(draw_len(rng, "lognormal:128:1.2", 300) for _ in range(1000)) == 300  # clipped


def test_uniform_and_fixed_lengths_are_kept():
    import random

    rng = random.Random(0)
    assert {draw_len(rng, "7", 100) for _ in range(10)} == {7}
    assert {draw_len(rng, "2:3", 100) for _ in range(100)} == {2, 3}


def test_an_unknown_policy_is_refused_before_any_engine_starts(capsys):
    with pytest.raises(SystemExit):
        policies.main(["--policies", "fcfs,sjf"])
    assert "'sjf' is not one of fcfs, priority, mlfq" in capsys.readouterr().err


def test_custom_takes_the_lengths_given_where_a_preset_is_the_default():
    ap = argparse.ArgumentParser()
    workload_options(ap)
    ap.set_defaults(workload="heavy-tail")  # as bench.policies does
    given = ap.parse_args(["--workload", "custom", "--input-len", "7", "--output-len", "3",
                           "--num-requests", "5"])
    assert [(len(p), n) for p, n in workload(given)] == [(7, 3)] * 5
    preset = ap.parse_args(["--input-len", "7", "--num-requests", "50"])
    assert {len(p) for p, _ in workload(preset)} != {7}  # the preset's lengths win
