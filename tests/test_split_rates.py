"""router/split_migration.py's `auto` split on recorded times: the line fit to each side, the
balance point, and the margin that keeps a split from losing to a pure move."""

from __future__ import annotations

import pytest

from router.split_migration import SPLIT_MARGIN, SplitRates, _Line, _predict


def test_a_line_with_a_fixed_cost_is_fit_and_one_size_means_a_rate():
    line = _Line()
    line.add(1000, 0.030)
    assert line.fit() == (0.0, 0.030 / 1000)  # one size: no fixed cost to tell apart
    for tokens in (2000, 4000):
        line.add(tokens, 0.010 + tokens * 20e-6)
    line.samples.popleft()
    fixed, per_token = line.fit()
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(20e-6)
    assert _predict(line.fit(), 0) == 0.0 and _predict(line.fit(), 3000) == pytest.approx(0.070)


def _rates(head: list[tuple[int, float]], tail: list[tuple[int, float]]) -> SplitRates:
    rates = SplitRates()
    for tokens, seconds in head:
        rates.record("p", "d", tokens, seconds, 0, 0.0)
    for tokens, seconds in tail:
        rates.record("p", "d", 0, 0.0, tokens, seconds)
    return rates


def test_auto_splits_where_both_sides_end_together():
    """2x H200 over tcp, 8,192 tokens: computing 27.4 us a token, copying 76.7 (the figures
    of docs/benchmarks.md, no fixed costs): the balance is 8,192 * 76.7 / (27.4 + 76.7)."""
    rates = _rates([(8192, 0.2244)], [(8192, 0.6286)])
    share = rates.share("p", "d", 8192)
    assert share == pytest.approx(0.6286 / (0.2244 + 0.6286))
    assert rates.share("p", "d", 0) == 0.5 and SplitRates().share("p", "d", 100) == 0.5


def test_auto_takes_a_pure_move_when_a_split_would_not_pay():
    """cuda_ipc: the copy (20 ms) against computing (224 ms); a head's fixed cost (here 9 ms,
    fit from two sizes) leaves a split no better than the copy: share 0. The other way round
    (a slow copy, fast compute with no margin to gain): share 1."""
    rates = _rates([(656, 0.009 + 656 * 26e-6), (8192, 0.009 + 8192 * 26e-6)],
                   [(8192, 0.0198)])
    assert rates.share("p", "d", 8192) == 0.0
    rates = _rates([(8192, 0.100)], [(8192, 5.0)])
    predicted_split = 8192 * (0.100 / 8192) * (5.0 / 8192) / ((0.100 + 5.0) / 8192)
    assert predicted_split > (1 - SPLIT_MARGIN) * 0.100  # not worth a split
    assert rates.share("p", "d", 8192) == 1.0
    described = rates.describe()
    assert described["copy_tokens_per_s"] == {"p->d": pytest.approx(8192 / 5.0)}
    assert described["prefill_fixed_s"] == {"d": 0.0}
