"""The prefix cache's second level (kvcache/prefix_host.py) to the exact page id: eviction
demotes to host pages, a match on them loads them back, a recomputed prefix replaces its host
copy, swap-outs take host pages first, and nothing leaks. No torch."""

import pytest

from kvcache.host_tier import HostTier
from kvcache.manager import KVCacheManager
from kvcache.page_pool import PagePool

PS = 4


def toks(n, start=0):
    return list(range(start, start + n))


class Mover:
    """Records the copies the bookkeeping asks for."""

    def __init__(self):
        self.copies = []

    def demote(self, device_pages, host_pages):
        self.copies.append(("demote", list(device_pages), list(host_pages)))

    def load(self, host_pages, device_pages):
        self.copies.append(("load", list(host_pages), list(device_pages)))

    def settle(self):
        self.copies.append(("settle",))


def make(device_pages=4, host_pages=4):
    kv = KVCacheManager(device_pages, PS)
    tier = HostTier(host_pages, PS)
    mover = Mover()
    kv.attach_host(tier, mover)
    return kv, tier, mover


def run(kv, seq_id, tokens, load=True):
    """A sequence reuses what is cached of `tokens`, computes the rest, caches it, finishes.
    Returns (tokens reused, of them loaded from the host, its page table)."""
    held, loaded = (kv.open_from_tiers if load else lambda *a: (kv.open(*a), 0))(seq_id, tokens)
    assert kv.allocate(seq_id, len(tokens))
    table = list(kv.page_table(seq_id))
    kv.cache_tokens(seq_id, tokens)
    kv.free(seq_id)
    return held, loaded, table


def check(kv, tier):
    kv.check_integrity()
    tier.check_integrity(kv.cache.host_pages())


def test_eviction_demotes_and_a_match_loads_back():
    kv, tier, mover = make()
    assert run(kv, "a", toks(9)) == (0, 0, [0, 1, 2])  # 2 whole pages cached: [0, 1]
    # b needs all 4 pages: a's 2 cached ones are evicted, to host pages 0, 1
    assert run(kv, "b", toks(16, 100)) == (0, 0, [0, 1, 2, 3])
    assert mover.copies == [("demote", [0, 1], [0, 1])]
    assert kv.stats().host_cached_pages == 2 and kv.stats().cached_pages == 4
    check(kv, tier)
    m = kv.cache.match(toks(9))
    assert (m.matched_len, m.pages, m.host_len) == (0, [], 8)
    # c matches a's prefix on the host: 2 device pages are found by demoting b's least
    # recent (its tail, pages 2, 3, to host pages 2, 3), a's KV is loaded into them, then
    # c's partial page takes b's page 1 (to the host page a's KV left)
    mover.copies.clear()
    held, loaded, table = run(kv, "c", toks(10))
    assert (held, loaded, table) == (8, 8, [2, 3, 1])
    assert mover.copies == [("demote", [2, 3], [2, 3]), ("load", [0, 1], [2, 3]),
                            ("demote", [1], [0])]
    assert kv.stats().host_cached_pages == 3 and kv.stats().cached_pages == 3
    m = kv.cache.match(toks(16, 100))  # b: page 0, then host pages 0, 2, 3
    assert (m.matched_len, m.pages, m.host_len) == (4, [0], 12)
    check(kv, tier)


def test_a_prefix_computed_again_replaces_its_host_copy():
    kv, tier, mover = make()
    run(kv, "a", toks(8))
    run(kv, "b", toks(16, 100))  # a's pages demoted
    assert kv.stats().host_cached_pages == 2
    # a sequence that does not load (a prep_recv's open) computes a's prefix again: the tree
    # takes its device pages and frees the host pages; b's are demoted to make room for it
    held, loaded, table = run(kv, "c", toks(8), load=False)
    assert (held, loaded) == (0, 0)
    assert kv.cache.match(toks(8)).pages == table
    assert kv.cache.match(toks(8)).host_len == 0
    assert sorted(kv.cache.host_pages()) == [2, 3]  # b's tail; a's host pages 0, 1 freed
    check(kv, tier)


def test_a_swap_out_drops_cached_host_pages_oldest_first():
    kv, tier, mover = make(device_pages=4, host_pages=3)
    run(kv, "a", toks(8))
    run(kv, "b", toks(16, 100))  # a's 2 pages demoted: host pages 0, 1
    assert tier.reserve("s", 8) == [1, 2]  # a's tail (host page 1) dropped, and the free one
    assert kv.cache.match(toks(8)).host_len == 4  # a's first page is still on the host
    check(kv, tier)
    assert tier.reserve("t", 12) is None  # 3 pages: 1 cached page reclaimable, 2 held by s
    assert kv.stats().host_cached_pages == 0 and tier.pool.num_free == 1
    tier.release("s")
    check(kv, tier)


def test_a_full_host_drops_from_the_device_and_what_hangs_below():
    kv, tier, mover = make(device_pages=4, host_pages=2)
    run(kv, "a", toks(16))  # 4 pages, one edge
    run(kv, "b", toks(8, 100))  # evicts a's last 2 pages to the host: a = [0, 1]{0, 1}
    assert kv.cache.match(toks(16)).host_len == 8
    tier.reserve("s", 8)  # a swap-out takes the host pages back
    assert kv.cache.match(toks(16)).host_len == 0
    run(kv, "c", toks(16, 200))  # no host room: a and b are dropped
    assert kv.stats().host_cached_pages == 0
    assert kv.cache.match(toks(16)).matched_len == 0
    check(kv, tier)
    tier.release("s")


def test_a_load_short_of_device_pages_leaves_them_on_the_host():
    kv, tier, mover = make(device_pages=4, host_pages=4)
    run(kv, "a", toks(8))
    run(kv, "b", toks(16, 100))
    kv.open("hold", toks(16, 100))  # b's 4 device pages held: none to load into
    assert kv.open_from_tiers("c", toks(9)) == (0, 0)
    assert kv.cache.match(toks(9)).host_len == 8
    kv.free("c")
    kv.free("hold")
    check(kv, tier)


def test_evict_cached_drops_both_tiers():
    kv, tier, mover = make()
    run(kv, "a", toks(8))
    run(kv, "b", toks(16, 100))
    assert kv.evict_cached() == 4
    assert kv.stats().host_cached_pages == 0 and tier.pool.num_free == 4
    assert kv.stats().free_pages == 4
    check(kv, tier)


def test_pins_keep_pages_on_the_device_and_cover_only_the_device_part():
    kv, tier, mover = make()
    run(kv, "a", toks(8))
    assert kv.pin(toks(8)) == 8
    run(kv, "b", toks(8, 100))
    run(kv, "c", toks(8, 200))  # b demoted, not a (pinned)
    assert kv.cache.match(toks(8)).matched_len == 8
    assert kv.cache.match(toks(8, 100)).host_len == 8
    assert kv.pin(toks(8, 100)) == 0  # on the host: nothing pinned
    assert kv.unpin(toks(8)) == 8
    check(kv, tier)


def test_prep_recv_counts_and_loads_the_host_part_and_settles_the_copies():
    """A receiver's matched prefix includes what it holds on the host (the router's index
    counts it as held); the copies have landed before the peer may write the pages."""
    kv, tier, mover = make()
    run(kv, "a", toks(8))
    run(kv, "b", toks(16, 100))  # a's pages on the host
    mover.copies.clear()
    assert kv.prep_recv("r", toks(12)) == 8
    assert mover.copies == [("demote", [2, 3], [2, 3]), ("load", [0, 1], [2, 3]),
                            ("demote", [1], [0]), ("settle",)]
    assert kv.page_table("r") == [2, 3, 1]
    kv.free("r")
    check(kv, tier)


class ShadowMover:
    """Tracks what each device and host page holds (the whole-prefix tokens whose KV it is),
    copying it as the engine's HostSwap copies KV."""

    def __init__(self):
        self.device, self.host = {}, {}

    def demote(self, device_pages, host_pages):
        for d, h in zip(device_pages, host_pages):
            self.host[h] = self.device[d]

    def load(self, host_pages, device_pages):
        for h, d in zip(host_pages, device_pages):
            self.device[d] = self.host[h]

    def settle(self):
        pass


@pytest.mark.parametrize("seed", range(24))  # 18 once dropped a host subtree twice
def test_random_traffic_keeps_every_reused_page_holding_its_prefix(seed):
    """Sequences sharing prefixes of a few contexts, in two namespaces (LoRA adapters), come
    and go over a small device pool and host pool, with swap-outs taking host pages, pins and
    a full eviction now and then: every page a sequence reuses (from either tier) holds
    exactly the KV of its prefix, and the books balance after every move."""
    import random

    rng = random.Random(seed)
    kv = KVCacheManager(10, PS)
    tier, mover = HostTier(6, PS), ShadowMover()
    kv.attach_host(tier, mover)
    contexts = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]
    live, swapped, pinned, loaded, most_on_host = {}, [], [], 0, 0
    for step in range(1000):
        op = rng.random()
        if op < 0.45 and len(live) < 3:
            ctx, ns = rng.choice(contexts), rng.choice([0, 0, 1])
            tokens = ctx[: rng.randrange(1, 30)] + [rng.randrange(50, 60)] * rng.randrange(3)
            sid = f"s{step}"
            held, from_host = kv.open_from_tiers(sid, tokens, ns)
            loaded += from_host
            for i, page in enumerate(kv.page_table(sid)):  # the reused pages
                assert mover.device[page] == (ns, *tokens[: (i + 1) * PS]), (step, i)
            need = kv.pages_needed(sid, len(tokens))
            if not kv.allocate(sid, len(tokens)):
                # short only if the pool says so: every evictable page was found by eviction
                assert not kv.can_allocate(need), step
                kv.free(sid)
                continue
            for i, page in enumerate(kv.page_table(sid)[held // PS :], held // PS):
                mover.device[page] = (ns, *tokens[: (i + 1) * PS])  # computed here
            kv.cache_tokens(sid, tokens)
            live[sid] = tokens
        elif op < 0.8 and live:
            sid = rng.choice(sorted(live))
            del live[sid]
            kv.free(sid)
        elif op < 0.82 and len(pinned) < 2:  # more would pin the small pool full
            tokens = rng.choice(contexts)[: rng.randrange(4, 16)]
            held = kv.pin(tokens)  # the part on the device: what an unpin names
            if held:
                pinned.append(tokens[:held])
        elif op < 0.86 and pinned:
            kv.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.865:
            kv.evict_cached()
        elif op < 0.93:
            sid = f"w{step}"
            if tier.reserve(sid, rng.randrange(1, 12)) is not None:
                swapped.append(sid)
        elif swapped:
            tier.release(swapped.pop(rng.randrange(len(swapped))))
        kv.check_integrity()
        tier.check_integrity(kv.cache.host_pages())
        most_on_host = max(most_on_host, kv.cache.num_host_pages)
    assert loaded > 0 and most_on_host > 0  # both tiers were exercised
    for sid in list(live):
        kv.free(sid)
    for tokens in pinned:
        kv.unpin(tokens)
    kv.evict_cached()
    for sid in swapped:
        tier.release(sid)
    assert kv.stats().free_pages == 10 and tier.pool.num_free == 6
