"""The host KV tier's bookkeeping (kvcache/host_tier.py) to the exact page id, and the swap or
recompute choice by cost. No torch."""

import pytest

from engine.policies import PrefillProfile
from kvcache.host_tier import HostState, HostTier, swap_or_recompute
from kvcache.integrity import IntegrityError

PS = 4


def test_a_swap_round_trip_holds_then_frees_exact_pages():
    tier = HostTier(num_pages=6, page_size=PS)
    assert tier.reserve("a", 9) == [0, 1, 2]  # 3 pages for 9 tokens
    assert tier.reserve("b", 4) == [3]
    assert tier.state("a") is HostState.COPYING_OUT
    tier.copied_out("a")
    assert tier.state("a") is HostState.HELD and tier.pool.num_free == 2
    assert tier.start_in("a") == [0, 1, 2]
    assert tier.copied_in("a") == 9
    assert "a" not in tier and tier.pool.num_free == 5
    assert tier.reserve("c", 8) == [0, 1]  # freed pages are taken again first
    tier.check_integrity()


def test_too_few_host_pages_is_an_answer_not_an_error():
    tier = HostTier(num_pages=2, page_size=PS)
    assert tier.reserve("big", 12) is None
    assert "big" not in tier and tier.pool.num_free == 2
    tier.check_integrity()


def test_abort_frees_host_pages_in_any_state():
    tier = HostTier(num_pages=8, page_size=PS)
    for rid in ("out", "held", "in"):
        tier.reserve(rid, 5)
    tier.copied_out("held")
    tier.copied_out("in")
    tier.start_in("in")
    assert [tier.release(rid) for rid in ("out", "held", "in", "unknown")] == [2, 2, 2, 0]
    assert tier.pool.num_free == 8
    tier.check_integrity()


def test_moves_out_of_order_are_refused():
    tier = HostTier(num_pages=4, page_size=PS)
    tier.reserve("a", 3)
    with pytest.raises(ValueError, match="'a' is copying_out, not held"):
        tier.start_in("a")
    with pytest.raises(ValueError, match="'b' is not on the host, not copying_in"):
        tier.copied_in("b")
    with pytest.raises(ValueError, match="already has host pages"):
        tier.reserve("a", 3)


def test_integrity_catches_a_page_held_twice():
    tier = HostTier(num_pages=4, page_size=PS)
    tier.reserve("a", 4)
    tier.reserve("b", 4)
    tier._swapped["b"].pages = [0]  # a bug elsewhere: b's entry names a's page
    with pytest.raises(IntegrityError, match="host page 0: refcount 1 != 2"):
        tier.check_integrity()


# An 8B model's KV: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token; a copy of
# 40 GB/s; a prefill of 10 ms + 0.06 ms per token (H100-like).
KV_BYTES = 2 * 32 * 8 * 128 * 2
PREFILL = PrefillProfile(fixed_s=0.010, per_token_s=0.00006).predict


def test_swap_when_copying_back_beats_recomputing():
    # 2,000 tokens: 262 MB, 6.6 ms back; recomputing them: 130 ms
    assert swap_or_recompute(2000, 2000, KV_BYTES, 40e9, PREFILL) == "swap"
    # both ways on the path: 13.1 ms, still less
    assert swap_or_recompute(2000, 2000, KV_BYTES, 40e9, PREFILL,
                             copy_out_overlapped=False) == "swap"


def test_recompute_when_the_prefix_cache_keeps_most_of_it_or_copies_are_slow():
    assert swap_or_recompute(2000, 0, KV_BYTES, 40e9, PREFILL) == "recompute"
    # a 1 GB/s link: 262 ms to copy back against 130 ms to recompute
    assert swap_or_recompute(2000, 2000, KV_BYTES, 1e9, PREFILL) == "recompute"
    # the boundary: 10 ms + 0.06 ms x 500 = 40 ms; 500 x 128 KiB at 1.6777 GB/s = 40 ms
    rate = 500 * KV_BYTES / PREFILL(500)
    assert swap_or_recompute(500, 500, KV_BYTES, rate, PREFILL) == "recompute"  # a tie
    assert swap_or_recompute(500, 500, KV_BYTES, rate * 1.01, PREFILL) == "swap"
