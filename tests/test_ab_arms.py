"""A/B arms without processes: which arm a key lands on (worked out here from the hash rule,
and pinned as a table), what re-weighting moves, the bodies the admin API refuses, and the
intervals against published values (Newcombe 1998, Statistics in Medicine 17:857 and 873)."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from microserve.backend import Client
from router.admin import StrategyBody, WeightBody
from router.arm_stats import ArmStats, difference, newcombe, percentile, wilson
from router.arms import pick, point, sticky_key

KEYS = ["user:alice", "user:bob", "header:42", "header:carol", "user:dave", "request:r1"]


def by_hand(key: str, weights: list[float]) -> int:
    """The rule of docs/router.md, written out: BLAKE2b-64 of the key, big-endian, over 2**64,
    times the weights' sum, then the first arm whose running total exceeds it."""
    x = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
    x *= sum(weights)
    total = 0.0
    for i, w in enumerate(weights):
        total += w
        if x < total:
            return i
    raise AssertionError("unreachable")


# the points: alice .9319, bob .5709, 42 .0373, carol .9823, dave .3270, r1 .5390
TABLE = {
    (1, 1): [1, 1, 0, 1, 0, 1],
    (3, 1): [1, 0, 0, 1, 0, 0],
    (1, 2, 1): [2, 1, 0, 2, 1, 1],
    (1, 0, 1): [2, 2, 0, 2, 0, 2],
    (0, 1): [1, 1, 1, 1, 1, 1],
}


@pytest.mark.parametrize("weights", list(TABLE))
def test_each_key_lands_on_the_arm_its_hash_covers(weights):
    assert [pick(k, list(weights)) for k in KEYS] == TABLE[weights]
    assert [by_hand(k, list(weights)) for k in KEYS] == TABLE[weights]
    assert round(point("user:alice"), 4) == 0.9319


def test_raising_b_moves_keys_only_from_a_to_b():
    keys = [f"user:{i}" for i in range(2000)]
    before = [pick(k, [3, 1]) for k in keys]
    after = [pick(k, [3, 2]) for k in keys]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert moved and set(moved) == {(0, 1)}
    # b's slice grew from 1/4 to 2/5: the keys whose points lie in [0.6, 0.75) moved
    assert all((0.6 <= point(k) < 0.75) == (b != a) for k, b, a in zip(keys, before, after))
    # and stopping b (weight 0) sends every key to a
    assert {pick(k, [3, 0]) for k in keys} == {0}


def test_the_key_is_the_header_the_user_or_else_the_request_id():
    client = Client("alice", {"x-user": "carol"})
    assert sticky_key("header:x-user", client, "r1") == "header:carol"
    assert sticky_key("user", client, "r1") == "user:alice"
    assert sticky_key("request_id", client, "r1") == "request:r1"
    assert sticky_key("header:x-team", client, "r1") == "request:r1"
    assert sticky_key("user", Client(None, {}), "r1") == "request:r1"
    assert sticky_key("user", None, "r1") == "request:r1"


def test_wilson_and_newcombe_match_the_published_intervals():
    for (s, n), want in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605),
                         (0, 20): (0.0, 0.1611), (1, 29): (0.0061, 0.1718),
                         (29, 29): (0.8830, 1.0)}.items():
        assert [round(v, 4) for v in wilson(s, n)] == list(want), (s, n)
    assert wilson(0, 0) == (0.0, 1.0)
    # 56/70 - 48/80, Newcombe's method 10: 0.0524 to 0.3339
    assert [round(v, 4) for v in newcombe(48, 80, 56, 70)] == [0.0524, 0.3339]


def test_arm_stats_count_goodput_and_give_percentiles():
    a, b = ArmStats(), ArmStats()
    for i in range(100):
        a.record(0.1 * (i + 1), 0.01, 1.0 + i, good=i < 80)
        b.record(0.2, 0.02, 2.0, good=i < 90)
    a.record(None, None, None, good=False)
    d = a.describe()
    assert (d["requests"], d["finished"], d["failed"]) == (101, 100, 1)
    assert d["goodput"]["fraction"] == 80 / 101
    assert d["ttft"]["p50"] == pytest.approx(5.0) and d["ttft"]["p99"] == pytest.approx(9.9)
    assert d["ttft"]["mean"] == pytest.approx(5.05)
    assert d["ttft"]["ci95"][0] < 5.05 < d["ttft"]["ci95"][1]
    diff = difference(a, b)
    assert diff["goodput"]["diff"] == pytest.approx(0.9 - 80 / 101)
    assert diff["jct"]["diff"] == pytest.approx(2.0 - 50.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0


ARM = {"name": "a", "builtin": "data_parallel"}
BAD = {
    "duplicate names": ({"arms": [ARM, ARM]}, "arm names must be unique, got ['a', 'a']"),
    "negative weight": ({"arms": [{**ARM, "weight": -1}]}, "greater than or equal to 0"),
    "zero sum": ({"arms": [{**ARM, "weight": 0}, {**ARM, "name": "b", "weight": 0}]},
                 "positive sum, got [0.0, 0.0]"),
    "two sources": ({"arms": [{**ARM, "source": "x"}]}, "give exactly one of"),
    "no source": ({"arms": [{"name": "a"}]}, "give exactly one of"),
    "bad name": ({"arms": [{**ARM, "name": "a b"}]}, "should match pattern"),
    "empty": ({"arms": []}, "at least 1 item"),
    "bad sticky": ({"arms": [ARM], "sticky_by": "cookie"}, "got 'cookie'"),
    "bad header": ({"arms": [ARM], "sticky_by": "header:a b"}, "got 'header:a b'"),
    "slo without arms": ({"builtin": "pd", "slo": {"ttft_s": 1}}, "slo go with arms only"),
    "args outside": ({"arms": [ARM], "args": {"ratio": 1}}, "args go inside each arm"),
    "slo zero": ({"arms": [ARM], "slo": {"ttft_s": 0}}, "greater than 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arms_bodies_are_refused_naming_the_problem(case):
    body, message = BAD[case]
    with pytest.raises(ValidationError) as e:
        StrategyBody.model_validate(body)
    assert message in str(e.value)
    with pytest.raises(ValidationError):
        WeightBody.model_validate({"weight": -0.5})
