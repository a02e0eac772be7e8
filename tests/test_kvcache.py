"""Exact tests of the page pool, the radix prefix cache and per-sequence page tables."""

import numpy as np
import pytest

from kvcache.manager import KVCacheManager, PageCopy
from kvcache.page_pool import PagePool
from kvcache.prefix_cache import PrefixCache

PS = 4


def toks(n, start=0):
    return list(range(start, start + n))


# ---- page pool ------------------------------------------------------------------------------


def test_pool_alloc_order_refcounts_and_reuse():
    pool = PagePool(6)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(2) == [3, 4]
    assert pool.alloc(2) is None  # only page 5 left: nothing taken
    assert pool.num_free == 1
    pool.retain([1])
    assert pool.release([0, 1, 2]) == 2  # page 1 still held once
    assert pool.refcount(1) == 1
    assert pool.alloc(2) == [0, 2]  # freed pages come back in their order
    pool.check_integrity()


def test_pool_rejects_bad_size():
    with pytest.raises(ValueError, match="num_pages must be >= 1, got 0"):
        PagePool(0)


# ---- prefix cache ---------------------------------------------------------------------------


def make_cache(num_pages=16):
    pool = PagePool(num_pages)
    return pool, PrefixCache(pool, PS)


def insert_seq(pool, cache, tokens):
    """A sequence computes `tokens`, caches them, then finishes."""
    pages = pool.alloc(-(-len(tokens) // PS))
    kept, _ = cache.insert(tokens, pages)
    pool.release(pages)
    return kept


def test_match_is_whole_pages_only():
    pool, cache = make_cache()
    assert insert_seq(pool, cache, toks(10)) == [0, 1]  # 10 tokens: 2 whole pages cached
    assert pool.num_free == 14  # the partial page went back
    m = cache.match(toks(10))
    assert (m.matched_len, m.pages) == (8, [0, 1])
    m = cache.match(toks(7))
    assert (m.matched_len, m.pages) == (4, [0])
    assert cache.match([99] + toks(7)).matched_len == 0
    cache.check_integrity()


def test_insert_shares_prefix_and_splits_edges():
    pool, cache = make_cache()
    insert_seq(pool, cache, toks(12))  # pages 0,1,2 on one edge
    b = toks(8) + [50, 51, 52, 53]
    # b shares 2 pages, diverges on the third: its own pages 3,4 for the shared part are
    # duplicates, page 5 is new.
    pages = pool.alloc(3)
    assert pages == [3, 4, 5]
    assert cache.insert(b, pages)[0] == [0, 1, 5]
    pool.release(pages)
    assert pool.num_free == 16 - 4  # 0,1,2 and 5 cached; 3,4 free again
    assert cache.match(b).pages == [0, 1, 5]
    assert cache.match(toks(12)).pages == [0, 1, 2]
    cache.check_integrity()


def test_evict_lru_leaves_first_and_parents_after_children():
    pool, cache = make_cache()
    assert insert_seq(pool, cache, toks(8)) == [0, 1]
    assert insert_seq(pool, cache, toks(4) + [70, 71, 72, 73]) == [0, 3]  # 2 was a duplicate
    assert insert_seq(pool, cache, [90, 91, 92, 93]) == [2]
    cache.match(toks(8))  # the [0, 1] path is now the most recent
    # LRU order of leaves: page 3, then page 2, then page 1; page 0 becomes a leaf last.
    assert cache.evict(1) == 1
    assert pool.refcount(3) == 0 and pool.refcount(2) == 1
    assert cache.evict(2) == 2
    assert pool.refcount(2) == 0 and pool.refcount(1) == 0 and pool.refcount(0) == 1
    assert cache.evict(5) == 1  # only page 0 was left
    assert cache.num_pages == 0 and pool.num_free == 16
    cache.check_integrity()


def test_evict_trims_a_long_leaf_from_its_tail():
    pool, cache = make_cache()
    assert insert_seq(pool, cache, toks(16)) == [0, 1, 2, 3]  # one edge
    assert cache.evict(1) == 1 and pool.refcount(3) == 0
    assert cache.match(toks(16)).pages == [0, 1, 2]
    assert cache.evict(2) == 2 and cache.match(toks(16)).pages == [0]
    cache.check_integrity()


def test_evict_skips_pages_held_by_sequences_and_pins():
    pool, cache = make_cache()
    insert_seq(pool, cache, toks(4))  # page 0
    insert_seq(pool, cache, [50, 51, 52, 53])  # page 1
    insert_seq(pool, cache, [60, 61, 62, 63])  # page 2
    held = cache.match(toks(4)).pages
    pool.retain(held)  # a running sequence reuses page 0
    assert cache.pin([50, 51, 52, 53, 54]) == 4  # whole pages only
    assert cache.num_evictable() == 1
    assert cache.evict(3) == 1 and pool.refcount(2) == 0
    cache.unpin([50, 51, 52, 53])
    assert cache.evict(3) == 1 and pool.refcount(1) == 0
    pool.release(held)
    assert cache.evict(3) == 1 and pool.refcount(0) == 0
    cache.check_integrity()


def test_pin_survives_a_split_of_the_pinned_edge():
    pool, cache = make_cache()
    insert_seq(pool, cache, toks(12))  # one edge of pages 0, 1, 2
    assert cache.pin(toks(12)) == 12
    # Splits the pinned edge after page 0; the new branch gets page 4 (3 was a duplicate).
    assert insert_seq(pool, cache, toks(4) + [77, 78, 79, 80]) == [0, 4]
    assert cache.evict(16) == 1 and pool.refcount(4) == 0  # only the unpinned branch goes
    assert [pool.refcount(p) for p in (0, 1, 2)] == [1, 1, 1]
    assert cache.unpin(toks(12)) == 12  # unpins both halves
    assert cache.evict(16) == 3 and cache.num_pages == 0
    cache.check_integrity()


def test_stats_count_pages_by_holder_with_pins_and_a_split_pinned_edge():
    """stats() counts without walking the pool; check_integrity compares it with the walk."""
    m = KVCacheManager(num_pages=16, page_size=4)

    def counts():
        m.check_integrity()
        s = m.stats()
        return s.free_pages, s.used_pages, s.cached_pages, s.pinned_pages

    m.open("a", toks(12))
    assert m.allocate("a", 14) and counts() == (12, 4, 0, 0)  # 3 whole pages and a partial
    m.cache_tokens("a", toks(12))
    assert m.pin(toks(12)) == 12 and counts() == (12, 4, 0, 3)
    m.open("b", toks(4) + [90, 91, 92, 93])  # shares page 0, splitting the pinned edge
    assert m.allocate("b", 8) and counts() == (11, 5, 0, 3)
    m.free("a")  # pages 1, 2 pinned and held only by the cache; 0 still b's
    assert counts() == (12, 2, 2, 3)
    assert m.unpin(toks(12)) == 12 and counts() == (12, 2, 2, 0)
    m.free("b")
    assert counts() == (13, 0, 3, 0)


def test_unpin_of_unpinned_prefix_is_an_error():
    pool, cache = make_cache()
    insert_seq(pool, cache, toks(8))
    with pytest.raises(ValueError, match="prefix of 8 tokens is not pinned"):
        cache.unpin(toks(8))


# ---- manager --------------------------------------------------------------------------------


def test_manager_open_reuses_prefix_and_allocates_rest():
    m = KVCacheManager(num_pages=8, page_size=PS)
    assert m.open("a", toks(9)) == 0
    assert m.allocate("a", 10)
    assert m.page_table("a") == [0, 1, 2]
    m.cache_tokens("a", toks(10))  # 2 whole pages go to the tree
    m.free("a")
    assert m.stats().free_pages == 6 and m.stats().cached_pages == 2
    # Same prompt again: reuse both pages, allocate the rest.
    assert m.open("b", toks(9)) == 8
    assert m.allocate("b", 10)
    assert m.page_table("b") == [0, 1, 2]
    s = m.stats()
    assert (s.free_pages, s.cached_pages, s.used_pages) == (5, 0, 3)
    m.check_integrity()
    m.free("b")
    m.check_integrity()


def test_manager_concurrent_duplicates_switch_to_cached_pages():
    m = KVCacheManager(num_pages=8, page_size=PS)
    for sid in ("a", "b"):
        assert m.open(sid, toks(8)) == 0
        assert m.allocate(sid, 8)
    assert m.page_table("a") == [0, 1] and m.page_table("b") == [2, 3]
    m.cache_tokens("a", toks(8))
    m.cache_tokens("b", toks(8))  # b's pages are duplicates: it switches to a's
    assert m.page_table("b") == [0, 1]
    assert m.stats().free_pages == 6
    m.check_integrity()
    m.free("a")
    m.free("b")
    assert m.stats().cached_pages == 2
    m.check_integrity()


def test_manager_allocate_evicts_and_fails_cleanly():
    m = KVCacheManager(num_pages=4, page_size=PS)
    m.open("a", [])
    assert m.allocate("a", 12)
    m.cache_tokens("a", toks(12))
    m.free("a")  # 3 cached pages, 1 free
    m.open("b", [])
    assert m.allocate("b", 8)  # takes the free page and trims one page off the cached edge
    assert m.page_table("b") == [2, 3]  # the tail page (2) was evicted, then reused
    assert m.stats().cached_pages == 2
    assert not m.allocate("b", 24)  # needs 4 more: impossible
    assert m.page_table("b") == [2, 3]  # unchanged
    m.check_integrity()


def test_manager_cannot_allocate_pages_a_running_sequence_shares():
    m = KVCacheManager(num_pages=3, page_size=PS)
    m.open("a", [])
    m.allocate("a", 8)
    m.cache_tokens("a", toks(8))
    assert m.open("b", toks(8)) == 8  # b reuses both cached pages
    m.free("a")
    m.open("c", [])
    assert not m.allocate("c", 8)  # only one free page; cached ones are in use by b
    assert m.allocate("c", 4)
    m.check_integrity()


def test_fork_shares_whole_pages_and_copies_the_partial_one():
    m = KVCacheManager(num_pages=8, page_size=PS)
    m.open("p", [])
    m.allocate("p", 10)
    assert m.page_table("p") == [0, 1, 2]
    assert m.fork_sequence("p", "c", 10) == PageCopy(src=2, dst=3, num_tokens=2)
    assert m.page_table("c") == [0, 1, 3]
    assert m.pool.refcount(0) == 2 and m.pool.refcount(2) == 1
    assert m.fork_sequence("p", "d", 8) is None
    assert m.page_table("d") == [0, 1]
    with pytest.raises(ValueError, match="fork at 13 tokens beyond the parent's 12"):
        m.fork_sequence("p", "e", 13)
    for sid in ("p", "c", "d"):
        m.free(sid)
    assert m.stats().free_pages == 8
    m.check_integrity()


def test_fork_without_a_free_page_changes_nothing():
    m = KVCacheManager(num_pages=2, page_size=PS)
    m.open("p", [])
    m.allocate("p", 6)
    assert m.fork_sequence("p", "c", 6) is False
    assert not m.has("c") and m.pool.refcount(0) == 1
    m.check_integrity()


def test_prefix_cache_can_be_disabled():
    m = KVCacheManager(num_pages=4, page_size=PS, enable_prefix_cache=False)
    m.open("a", [])
    m.allocate("a", 8)
    m.cache_tokens("a", toks(8))
    m.free("a")
    assert m.open("b", toks(8)) == 0
    assert m.stats().free_pages == 4


def test_insert_continues_from_a_handle_after_a_split():
    pool, cache = make_cache()
    pages = pool.alloc(2)
    kept, handle = cache.insert(toks(8), pages)  # a running sequence caches 2 pages
    # Another sequence shares page 0 then diverges: the edge [0, 1] splits; the handle's node
    # keeps the lower half, which is still where the first sequence's prefix ends.
    other = pool.alloc(2)
    assert cache.insert(toks(4) + [60, 61, 62, 63], other)[0] == [0, other[1]]
    more = pool.alloc(1)
    assert cache.insert(toks(4, start=8), more, after=handle)[0] == more
    assert cache.match(toks(12)).pages == pages + more
    cache.check_integrity()


def test_manager_cache_tokens_incrementally_equals_at_once():
    a = KVCacheManager(num_pages=16, page_size=PS)
    b = KVCacheManager(num_pages=16, page_size=PS)
    for m in (a, b):
        m.open("s", [])
        m.allocate("s", 22)
    for n in range(1, 23):  # one token at a time, like decode
        a.cache_tokens("s", toks(n))
    b.cache_tokens("s", toks(22))
    assert a.cache.match(toks(22)).pages == b.cache.match(toks(22)).pages == [0, 1, 2, 3, 4]
    a.check_integrity()


def test_prep_recv_reserves_after_the_cached_prefix_and_gives_slots():
    m = KVCacheManager(num_pages=8, page_size=PS)
    m.open("warm", toks(9))
    m.allocate("warm", 9)  # pages [0, 1, 2]
    m.cache_tokens("warm", toks(9))  # pages 0, 1 cached
    m.free("warm")
    # Receive 14 tokens: 8 are cached (pages 0, 1), the rest get fresh pages (LIFO: 2, 3).
    assert m.prep_recv("r", toks(14)) == 8
    assert m.page_table("r") == [0, 1, 2, 3]
    assert m.slot_ranges("r", 8, 14) == [(8, 6)]  # slots 8..13: pages 2 and 3 are adjacent
    with pytest.raises(ValueError, match="positions up to 17 beyond the 16 held"):
        m.slot_ranges("r", 8, 17)
    with pytest.raises(ValueError, match="positions up to 17 beyond the 16 held"):
        m.slots("r", 8, 17)
    m.check_integrity()
    # Not enough pages: None, and nothing is held.
    assert m.prep_recv("big", toks(40, start=100)) is None
    assert not m.has("big")
    m.free("r")
    m.check_integrity()
    assert m.stats().used_pages == 0


def test_slot_ranges_are_the_run_length_form_of_each_positions_slot_over_scattered_pages():
    m = KVCacheManager(num_pages=16, page_size=PS)
    for rid, n in (("a", 6), ("b", 8), ("c", 4)):  # interleave so "c"'s pages are not adjacent
        m.open(rid, toks(n, start=100 * len(rid) + n))
        m.allocate(rid, n)
    m.free("b")
    m.allocate("a", 30)  # "a" grows into b's freed pages and then fresh ones
    table = m.page_table("a")
    for begin in range(0, 30):
        for end in range(begin, 31):
            runs = []
            for s in (table[i // PS] * PS + i % PS for i in range(begin, end)):
                if runs and runs[-1][0] + runs[-1][1] == s:
                    runs[-1][1] += 1
                else:
                    runs.append([s, 1])
            assert m.slot_ranges("a", begin, end) == [tuple(r) for r in runs], (table, begin, end)
            # ... and the same slots one per position, as a sender's copy reads them
            assert m.slots("a", begin, end).tolist() == [table[i // PS] * PS + i % PS
                                                         for i in range(begin, end)]
            assert m.slots("a", begin, end).dtype == np.int64
    assert len(m.slot_ranges("a", 0, 30)) > 1  # the table really is scattered


def test_truncate_releases_trailing_pages_and_restarts_caching():
    m = KVCacheManager(num_pages=8, page_size=PS)
    m.open("a", toks(12))
    m.allocate("a", 12)
    m.cache_tokens("a", toks(12))  # 3 pages cached
    m.free("a")
    assert m.prep_recv("b", toks(12)) == 12
    m.truncate("b", 2)  # the shared last page goes back to the cache only
    assert m.page_table("b") == [0, 1] and m.num_cached_pages("b") == 2
    assert m.allocate("b", 12)
    m.cache_tokens("b", toks(12))  # the duplicate of the cached third page is swapped back
    assert m.page_table("b") == [0, 1, 2]
    m.free("b")
    m.check_integrity()
    assert m.stats().used_pages == 0


# ---- at scale: long contexts, handles across extensions and splits ---------------------------


def test_a_30000_page_context_is_one_edge_and_evicts_to_the_exact_pages():
    """A decoded context cached page by page, 30,000 pages (120,000 tokens at page size 4):
    before, each page hung one level deeper and counting what could be evicted recursed
    through all of them (RecursionError past ~1,000 pages)."""
    n = 30_000
    m = KVCacheManager(num_pages=n + 16, page_size=PS)
    tokens = [t % 49152 for t in range(n * PS)]
    m.open("long", [])
    for k in range(1, n + 1):  # one page completes per step, as decode makes them
        assert m.allocate("long", k * PS)
        m.cache_tokens("long", tokens)  # caches the first len(page table) pages
    assert m.page_table("long") == list(range(n))
    cache = m.cache
    assert len(cache._root.children) == 1 and len(list(cache._iter_nodes())) == 2  # one edge
    assert cache.num_evictable() == 0  # all held by the sequence
    m.free("long")
    assert cache.num_evictable() == n and m.can_allocate(n + 16)
    assert cache.match(tokens).pages == list(range(n))
    # A new sequence needs 20 pages: the context's last 4 are evicted, and the pool hands out
    # the most recently freed pages first, then the 16 never used.
    m.open("next", [])
    assert m.allocate("next", 20 * PS)
    assert m.page_table("next") == [n - 4, n - 3, n - 2, n - 1] + [n + i for i in range(16)]
    assert cache.match(tokens).pages == list(range(n - 4))
    assert cache.num_evictable() == n - 4
    m.free("next")
    assert cache.evict(n) == n - 4 and cache.num_pages == 0 and m.pool.num_free == n + 16
    m.check_integrity()


def test_handles_survive_another_sequence_extending_and_a_split():
    pool, cache = make_cache(32)
    a_tokens = toks(24)
    b_tokens = toks(8) + [90, 91, 92, 93]
    a_pages = pool.alloc(2)  # [0, 1]
    kept, a = cache.insert(a_tokens[:8], a_pages)
    assert kept == [0, 1]
    # b reaches the same node through its own insert (its copies 2, 3 are duplicates).
    b_pages = pool.alloc(2)
    kept, b = cache.insert(b_tokens[:8], b_pages)
    assert kept == [0, 1] and b.node is a.node and b.end == 8
    pool.retain(kept)
    pool.release(b_pages)
    # a grows its edge in place: pages 2 and 3 are its next two.
    a_more = pool.alloc(2)
    assert a_more == [2, 3]
    kept, a = cache.insert(a_tokens[8:16], a_more, after=a)
    assert kept == [2, 3] and a.end == 16 and len(a.node.pages) == 4  # one edge of 4 pages
    # b continues from where *its* prefix ended (8), inside that edge now: it is split there.
    b_more = pool.alloc(1)
    assert b_more == [4]
    kept, b = cache.insert(b_tokens[8:12], b_more, after=b)
    assert kept == [4] and b.end == 12
    assert cache.match(a_tokens[:16]).pages == [0, 1, 2, 3]
    assert cache.match(b_tokens).pages == [0, 1, 4]
    # A match ending inside a's edge splits it again; a's handle still continues right.
    assert cache.match(a_tokens[:12]).pages == [0, 1, 2]
    a_last = pool.alloc(2)
    kept, a = cache.insert(a_tokens[16:24], a_last, after=a)
    assert kept == a_last == [5, 6] and a.end == 24
    assert cache.match(a_tokens).pages == [0, 1, 2, 3, 5, 6]
    cache.check_integrity()
    pool.check_integrity()
    # Everything held is let go: the whole tree can be evicted, least recently used first.
    pool.release([0, 1] + a_more + a_last + [0, 1] + b_more)
    assert cache.num_evictable() == cache.num_pages == 7
    assert cache.evict(1) == 1 and pool.refcount(4) == 0  # b's branch was used least recently
    assert cache.evict(7) == 6 and pool.num_free == 32
    cache.check_integrity()
    pool.check_integrity()


def test_a_handle_below_a_split_point_walks_up_to_its_end():
    """b's handle ends where a split later starts a's lower half: it continues from above."""
    pool, cache = make_cache(32)
    tokens = toks(20)
    kept, a = cache.insert(tokens[:8], pool.alloc(2))  # [0, 1]
    kept, b = cache.insert(tokens[:8], pool.alloc(2))  # b ends at 8 too (2, 3 duplicates)
    kept, a = cache.insert(tokens[8:16], pool.alloc(2), after=a)  # edge [0, 1, 4, 5]
    assert kept == [4, 5]
    assert cache.match(tokens[:8]).pages == [0, 1]  # splits at 8: a's node now starts there
    assert a.node.start == 8 and b.end == 8
    other = [70, 71, 72, 73]
    kept, b = cache.insert(other, pool.alloc(1), after=b)
    assert kept == [6] and cache.match(tokens[:8] + other).pages == [0, 1, 6]
    assert cache.match(tokens[:16]).pages == [0, 1, 4, 5]
    cache.check_integrity()


def test_a_pinned_leaf_is_not_extended_and_its_pin_stays_its_own():
    pool, cache = make_cache(16)
    tokens = toks(16)
    kept, a = cache.insert(tokens[:8], pool.alloc(2))  # [0, 1]
    assert cache.pin(tokens[:8]) == 8
    kept, a = cache.insert(tokens[8:12], pool.alloc(1), after=a)  # a new leaf, not an extension
    assert kept == [2] and a.node.pin_count == 0
    pool.release([0, 1, 2])  # the sequence is done
    assert cache.num_evictable() == 1 and cache.num_pinned_pages() == 2
    assert cache.evict(3) == 1 and pool.refcount(2) == 0  # only the unpinned page goes
    assert cache.unpin(tokens[:8]) == 8
    assert cache.num_evictable() == 2 and cache.evict(3) == 2
    cache.check_integrity()
    pool.check_integrity()


CORRUPT = """
import sys
from kvcache.integrity import IntegrityError
from kvcache.manager import KVCacheManager
kv = KVCacheManager(num_pages=8, page_size=4)
kv.open("a", [])
kv.allocate("a", 8)  # (no assert here: -O would drop the call)
kv.check_integrity()
kv.pool._refcount[kv.page_table("a")[0]] += 1  # a reference nobody holds
try:
    kv.check_integrity()
except IntegrityError as e:
    print(e)
    sys.exit(0)
sys.exit(1)
"""


def test_integrity_checks_raise_even_under_python_O():
    """Not asserts: `python -O` keeps them, so stats?check=1 cannot say "ok" over a corrupt
    pool."""
    import subprocess
    import sys

    for flags in ([], ["-O"]):
        done = subprocess.run([sys.executable, *flags, "-c", CORRUPT], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "page 0: refcount 2 != 1"
