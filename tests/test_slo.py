"""bench/slo.py and router/handover.py: goodput under an SLO, stage quantiles from Prometheus
buckets, and the stages a request's timeline yields."""

from __future__ import annotations

import math

import pytest

from bench.slo import SLO, parse_stages, quantile, stage_quantiles
from microserve.messages import SendTiming
from microserve.metrics import Registry
from router.handover import StageMetrics, Timeline


def req(ttft: float, tpot: float) -> dict:
    return {"ttft": ttft, "tpot": tpot}


def test_a_request_meets_the_slo_only_within_both_limits():
    slo = SLO(ttft_s=2.0, tpot_ms=25.0)
    assert slo.met(req(2.0, 0.025))
    assert not slo.met(req(2.001, 0.010))
    assert not slo.met(req(0.5, 0.0251))
    assert slo.met(req(0.5, float("nan")))  # one output token: no TPOT
    assert not slo.met(req(float("nan"), float("nan")))  # no token at all


def test_goodput_counts_requests_that_met_it_per_second_per_gpu():
    answered = [req(0.1, 0.010)] * 6 + [req(3.0, 0.010)] * 2 + [req(0.1, 0.030)] * 2
    out = SLO().report(answered, failed=0, wall_s=2.0, gpus=2, ttft_p99_ms=3000.0,
                       tpot_p99_ms=30.0)
    assert out == {"ttft_s": 2.0, "tpot_ms": 25.0, "met": 6, "goodput_per_gpu": 1.5,
                   "attained": False}
    good = SLO().report(answered[:6], failed=0, wall_s=3.0, gpus=1, ttft_p99_ms=100.0,
                        tpot_p99_ms=10.0)
    assert (good["met"], good["goodput_per_gpu"], good["attained"]) == (6, 2.0, True)
    assert not SLO().report(answered[:6], failed=1, wall_s=3.0, gpus=1, ttft_p99_ms=100.0,
                            tpot_p99_ms=10.0)["attained"]


def test_quantiles_interpolate_within_buckets_as_prometheus_does():
    buckets = {0.001: 0, 0.002: 10, 0.004: 30, math.inf: 40}
    assert quantile(0.5, buckets) == pytest.approx(0.003)  # rank 20: halfway through (2, 4] ms
    assert quantile(0.125, buckets) == pytest.approx(0.0015)  # rank 5 of 10 in (1, 2] ms
    assert quantile(0.99, buckets) == 0.004  # in +Inf: the last finite bound
    assert quantile(0.5, {0.001: 0, math.inf: 0}) is None


def timeline(sent: bool) -> Timeline:
    t = Timeline(arrived=10.0, generate_started=10.050, first_chunk=10.0525,
                 first_token=10.0500)
    if sent:
        t.prep_recv_s = 0.001
        t.sent(0.048, SendTiming(queued_s=0.005, prefill_s=0.040, tail_s=0.002))
    return t


def test_a_timeline_yields_the_stages_it_went_through():
    assert timeline(False).stages() == pytest.approx({"ttft": 0.050, "d_first_chunk": 0.0025})
    assert timeline(True).stages() == pytest.approx({
        "ttft": 0.050, "prep_recv": 0.001, "remote_send": 0.048, "p_queue": 0.005,
        "p_prefill": 0.040, "transfer_tail": 0.002, "send_hops": 0.001, "handover": 0.005,
        "d_first_chunk": 0.0025})
    split = Timeline(arrived=0.0)
    split.sent(0.048, SendTiming(queued_s=0.005, prefill_s=0.040, tail_s=0.002, chunks_s=0.030))
    assert split.stages()["p_chunks"] == pytest.approx(0.030)
    assert split.stages()["p_last_step"] == pytest.approx(0.010)  # the rest of p_prefill
    no_report = Timeline(arrived=0.0, first_token=0.1)
    no_report.sent(0.09, None)  # an engine that reports no timing: only the round trip
    assert no_report.stages() == pytest.approx({"ttft": 0.1, "remote_send": 0.09})


def test_stage_quantiles_come_from_the_runs_own_observations():
    registry = Registry()
    stages = StageMetrics(registry)
    for _ in range(3):
        stages.observe("PrefillDecode", timeline(True))
    before = parse_stages(registry.render())
    for _ in range(10):
        stages.observe("PrefillDecode", timeline(True))
    stages.observe("DataParallel", timeline(False))
    out = stage_quantiles(before, parse_stages(registry.render()))
    assert out["p_queue"]["n"] == 10 and out["ttft"]["n"] == 11
    # every p_queue is 5 ms, in the (4, 5] ms bucket: interpolated within it
    assert 4.0 < out["p_queue"]["p50_ms"] <= 5.0
    assert set(out) == {"ttft", "prep_recv", "remote_send", "p_queue", "p_prefill",
                        "transfer_tail", "send_hops", "handover", "d_first_chunk"}
