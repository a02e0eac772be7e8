"""Per-sequence page tables over the page pool and the prefix cache.

The scheduler talks to this class only; it never touches the pool or the tree directly.
Everything here is ids and counts, so it is tested on CPU to the exact page id.

A sequence's page table covers its KV positions in order: position `i` lives in page
`page_table[i // page_size]` at offset `i % page_size`.

    page_table:  [ p7 | p3 | p9 | p2 ]        page_size = 4, 14 tokens of KV
    tokens:       0..3 4..7 8..11 12,13 _ _
                  └ shared with the prefix cache ┘ └ private (partial) ┘
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvcache.host_tier import HostTier
from kvcache.integrity import IntegrityError
from kvcache.page_pool import PagePool
from kvcache.prefix_cache import CachedPrefix, PrefixCache
from kvcache.prefix_host import KVMover


@dataclass(frozen=True)
class PageCopy:
    """Copy the first `num_tokens` slots of page `src` into page `dst` (all layers)."""

    src: int
    dst: int
    num_tokens: int


@dataclass
class TableChanges:
    """What happened to page tables since the last `take_table_changes`, for a consumer that
    mirrors them (a GPU's persistent device page tables): `rewritten` maps a sequence to the
    first table index whose page may differ from what was there before (entries were replaced
    or dropped; pages appended at the end are not listed), `dropped` lists tables freed."""

    rewritten: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    # Too many drops went untaken (an engine that only receives and rarely steps): the
    # consumer must forget everything it mirrors instead.
    reset: bool = False

    MAX_DROPPED = 4096


@dataclass(frozen=True)
class KVStats:
    total_pages: int
    free_pages: int
    cached_pages: int  # in the prefix cache and held by nothing else: reusable or evictable
    used_pages: int  # held by at least one sequence
    pinned_pages: int
    host_cached_pages: int = 0  # prefix-cache pages demoted to the host tier


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.cache = PrefixCache(self.pool, page_size)
        self.enable_prefix_cache = enable_prefix_cache
        self._tables: dict[str, list[int]] = {}  # seq id -> page table; written only here
        self._num_cached: dict[str, int] = {}  # seq id -> leading pages already inserted in the tree
        self._cached_at: dict[str, CachedPrefix] = {}  # seq id -> where its cached pages end
        # seq id -> its prefix-cache namespace (its LoRA adapter's id), for those not in 0
        self._namespace: dict[str, int] = {}
        self._changes = TableChanges()  # since the last take_table_changes

    # ---- sequences ----------------------------------------------------------------------------

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def num_cached_pages(self, seq_id: str) -> int:
        """Leading pages of the sequence already offered to the prefix cache."""
        return self._num_cached[seq_id]

    def seq_ids(self) -> set[str]:
        return set(self._tables)

    def page_table(self, seq_id: str) -> list[int]:
        """The sequence's live page table (do not modify; it grows and may change in place,
        as `take_table_changes` reports)."""
        return self._tables[seq_id]

    def take_table_changes(self) -> TableChanges:
        """In-place table changes and freed tables since the last call (see TableChanges)."""
        changes, self._changes = self._changes, TableChanges()
        return changes

    def _rewritten(self, seq_id: str, index: int) -> None:
        old = self._changes.rewritten.get(seq_id)
        self._changes.rewritten[seq_id] = index if old is None else min(old, index)

    def pages_needed(self, seq_id: str | None, num_tokens: int) -> int:
        """Extra pages a sequence (or a new one, when seq_id is None) needs to hold num_tokens."""
        have = len(self._tables[seq_id]) if seq_id is not None else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    def open(self, seq_id: str, tokens: list[int], namespace: int = 0) -> int:
        """Start a page table for `seq_id`, reusing the longest cached whole-page prefix of
        `tokens`. Returns the number of tokens whose KV is already there (a page multiple).
        `namespace` (a LoRA adapter's id; 0 the base model) is the part of the cache the
        sequence reads and fills: KV computed under other weights is never reused.

        The caller passes only tokens whose KV it may reuse; a request that must compute at
        least one token to get logits passes its prompt without the last token.
        """
        return self._open(seq_id, tokens, namespace, load_host=False)[0]

    def open_from_tiers(self, seq_id: str, tokens: list[int], namespace: int = 0
                        ) -> tuple[int, int]:
        """`open`, and where the cached prefix goes on in host pages (the prefix cache's
        second level), load them into device pages (the copies are issued before this returns,
        ahead of any later forward). Returns the tokens whose KV is there, and how many of
        them came from the host (0 if no device pages could be found for them)."""
        return self._open(seq_id, tokens, namespace, load_host=True)

    def _open(self, seq_id: str, tokens: list[int], namespace: int, load_host: bool
              ) -> tuple[int, int]:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has KV pages")
        pages: list[int] = []
        loaded: list[int] = []
        if self.enable_prefix_cache:
            match = self.cache.match(tokens, namespace)
            pages = match.pages
            self.pool.retain(pages)  # first: loading may evict, never these
            if load_host and match.host_len:
                loaded = self.cache.load(match, self._alloc)
                self.pool.retain(loaded)
                pages = pages + loaded
        if namespace:
            self._namespace[seq_id] = namespace
        self._tables[seq_id] = list(pages)
        self._num_cached[seq_id] = len(pages)
        return len(pages) * self.page_size, len(loaded) * self.page_size

    def attach_host(self, tier: HostTier, mover: KVMover) -> None:
        """Make the host tier's pool the prefix cache's second level: evicted pages demote to
        it through `mover`, `open_from_tiers` loads them back, and the tier's swap-outs drop
        them when short of room. Without a prefix cache, nothing is cached to demote."""
        if self.enable_prefix_cache:
            self.cache.attach_host(tier.pool, mover)
            tier.reclaim = self.cache.evict_host

    def prep_recv(self, seq_id: str, tokens: list[int], headroom: int = 0,
                  namespace: int = 0) -> int | None:
        """Reserve KV for receiving `tokens` (paper Table 2): reuse the longest cached prefix
        (loading its part on the host tier back) and allocate pages for the rest, so a peer
        can write positions [matched, len(tokens)).
        Returns `matched` (a page multiple), or None, changing nothing, if pages are short, or
        would leave fewer than `headroom` pages free or evictable. `namespace` as for `open`:
        the prefix is matched, and the received KV later cached, in that part of the cache.

            tokens:  [ matched: cached pages, held | reserved: the peer writes here ]
        """
        matched, _ = self._open(seq_id, tokens, namespace, load_host=True)
        need = self.pages_needed(seq_id, len(tokens))
        if (headroom and not self.can_allocate(need + headroom)) or not self.allocate(
                seq_id, len(tokens)):
            self.free(seq_id)
            return None
        self.settle_copies()  # the peer writes the pages without our stream
        return matched

    def settle_copies(self) -> None:
        """Wait for the host-tier copies issued so far (demotions, loads) to land: before a
        thread or a peer outside the compute stream touches pages they used."""
        if self.cache.mover is not None:
            self.cache.mover.settle()

    def slots(self, seq_id: str, begin: int, end: int) -> np.ndarray:
        """The flat slots of positions [begin, end) of a sequence, one int64 per position, in
        order: what a sender's copy reads. Computed per page by numpy (a 3,000-token send
        names 2,992 slots: ~10 us, where the run-length form and its expansion took ~100 on
        this project's CPU machine and ~0.1 ms a send on an H200's host, py-spy 2026-11-29)."""
        table, ps = self._tables[seq_id], self.page_size
        if end > len(table) * ps:
            raise ValueError(f"positions up to {end} beyond the {len(table) * ps} held")
        if end <= begin:
            return np.empty(0, dtype=np.int64)
        first = begin // ps
        pages = np.asarray(table[first:(end - 1) // ps + 1], dtype=np.int64)
        flat = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()
        return flat[begin - first * ps:end - first * ps]

    def slot_ranges(self, seq_id: str, begin: int, end: int) -> list[tuple[int, int]]:
        """The flat slots (page * page_size + offset) of positions [begin, end) of a sequence,
        in run-length form [(first slot, count), ...], built per page, not per token (a
        prep_recv of 5,000 tokens answers with it)."""
        table, ps = self._tables[seq_id], self.page_size
        if end > len(table) * ps:
            raise ValueError(f"positions up to {end} beyond the {len(table) * ps} held")
        out: list[list[int]] = []
        pos = begin
        while pos < end:
            n = min(end, (pos // ps + 1) * ps) - pos  # the rest of this page
            slot = table[pos // ps] * ps + pos % ps
            if out and out[-1][0] + out[-1][1] == slot:
                out[-1][1] += n
            else:
                out.append([slot, n])
            pos += n
        return [(a, n) for a, n in out]

    def evict_cached(self) -> int:
        """Drop every cached page that no sequence holds and no pin keeps (the engine's own
        start-up requests, for one), and every page on the host tier. Returns how many device
        pages were freed."""
        freed = self.cache.evict(self.cache.num_evictable(), demote=False)
        self.cache.evict_host(self.cache.num_host_pages)
        return freed

    def num_available_pages(self) -> int:
        """Pages an allocation can take now: free ones and cached ones nothing else holds."""
        return self.pool.num_free + self.cache.num_evictable()

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_available_pages()

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the page table so it covers `num_tokens` positions, evicting cached pages if
        needed. Returns False, changing nothing, if the pages cannot be found."""
        new = self._alloc(self.pages_needed(seq_id, num_tokens))
        if new is None:
            return False
        self._tables[seq_id].extend(new)
        return True

    def _alloc(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        if n > self.pool.num_free:
            if not self.can_allocate(n):
                return None
            self.cache.evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    def cache_tokens(self, seq_id: str, tokens: list[int]) -> None:
        """Offer the sequence's whole pages of computed KV (`tokens` = the tokens whose KV is
        written, in order) to the prefix cache, so concurrent and later requests reuse them.

        If another sequence cached the same prefix first, this sequence switches to the cached
        pages and its own copies are released (their KV is the same).
        """
        if not self.enable_prefix_cache:
            return
        table, ps = self._tables[seq_id], self.page_size
        n_full = min(len(tokens) // ps, len(table))
        done = self._num_cached[seq_id]
        if n_full <= done:
            return
        # Continue from the last insert: O(new pages), not O(context), per page boundary.
        after = self._cached_at.get(seq_id)
        start = done if after else 0
        canonical, self._cached_at[seq_id] = self.cache.insert(
            tokens[start * ps : n_full * ps], table[start:n_full], after,
            self._namespace.get(seq_id, 0)
        )
        mine = table[start:n_full]
        dup = [m for m, kept in zip(mine, canonical) if m != kept]
        if dup:
            self.pool.retain([kept for m, kept in zip(mine, canonical) if m != kept])
            table[start:n_full] = canonical
            self.pool.release(dup)
            self._rewritten(seq_id, start + next(
                i for i, (m, kept) in enumerate(zip(mine, canonical)) if m != kept))
        self._num_cached[seq_id] = n_full

    def graft(self, seq_id: str, first: int, pages: list[int]) -> None:
        """Put `pages` (cached ones, holding the KV of the sequence's positions there) at
        table[first : first + len(pages)], releasing the pages they replace (BlockLLM's split
        migration: the receiver computed that part as a request of its own)."""
        table = self._tables[seq_id]
        old = table[first : first + len(pages)]
        assert len(old) == len(pages), (first, len(pages), len(table))
        self.pool.retain(pages)
        table[first : first + len(pages)] = pages
        self.pool.release(old)
        self._rewritten(seq_id, first)
        if self._num_cached[seq_id] == first:  # the leading cached run goes on through them
            self._num_cached[seq_id] = first + len(pages)
        self._cached_at.pop(seq_id, None)  # the next insert starts from the root

    def truncate(self, seq_id: str, num_pages: int) -> None:
        """Release the sequence's pages from index `num_pages` on (shared ones stay cached)."""
        table = self._tables[seq_id]
        dropped = table[num_pages:]
        del table[num_pages:]
        self.pool.release(dropped)
        if dropped:
            self._rewritten(seq_id, num_pages)
        if self._num_cached[seq_id] > num_pages:
            self._num_cached[seq_id] = num_pages
            self._cached_at.pop(seq_id, None)  # re-inserts from the root next time

    def free(self, seq_id: str) -> None:
        """Drop the sequence's page table; cached pages stay in the prefix cache."""
        table = self._tables.pop(seq_id)
        changes = self._changes
        changes.rewritten.pop(seq_id, None)
        if not changes.reset:
            changes.dropped.append(seq_id)
            if len(changes.dropped) > TableChanges.MAX_DROPPED:
                self._changes = TableChanges(reset=True)
        del self._num_cached[seq_id]
        self._cached_at.pop(seq_id, None)
        self._namespace.pop(seq_id, None)
        self.pool.release(table)

    def fork_sequence(self, parent: str, child: str, num_tokens: int) -> PageCopy | None | bool:
        """Give `child` the parent's KV for positions [0, num_tokens).

        Whole pages are shared (refcounted). A partial last page is copied into a fresh page:
        returns the PageCopy the runner must execute before the child's next forward, None if
        nothing needs copying, or False (changing nothing) if no page is free for the copy.
        """
        if child in self._tables:
            raise ValueError(f"sequence {child!r} already has KV pages")
        table = self._tables[parent]
        if num_tokens > len(table) * self.page_size:
            raise ValueError(
                f"fork at {num_tokens} tokens beyond the parent's {len(table) * self.page_size}"
            )
        n_full, rest = divmod(num_tokens, self.page_size)
        copy = None
        shared = table[:n_full]
        if rest:
            new = self._alloc(1)
            if new is None:
                return False
            copy = PageCopy(table[n_full], new[0], rest)
        self.pool.retain(shared)
        self._tables[child] = shared + ([copy.dst] if copy else [])
        self._num_cached[child] = min(self._num_cached[parent], n_full)
        if parent in self._namespace:
            self._namespace[child] = self._namespace[parent]
        return copy

    # ---- router-driven cache control ------------------------------------------------------------

    def pin(self, tokens: list[int]) -> int:
        return self.cache.pin(tokens)

    def unpin(self, tokens: list[int]) -> int:
        return self.cache.unpin(tokens)

    # ---- accounting -----------------------------------------------------------------------------

    def stats(self) -> KVStats:
        """O(pinned pages), not O(pool): routers ask twice a second, between steps. A page in
        use is held by page tables, the prefix cache or both (check_integrity), so those held
        by tables are the ones in use less those only the cache holds."""
        pool, cached_only = self.pool, self.cache.num_sole_pages()
        return KVStats(
            total_pages=pool.num_pages,
            free_pages=pool.num_free,
            cached_pages=cached_only,
            used_pages=pool.num_pages - pool.num_free - cached_only,
            pinned_pages=self.cache.num_pinned_pages(),
            host_cached_pages=self.cache.num_host_pages,
        )

    def check_integrity(self) -> None:
        """Every page is free, cached, or used, and each page's refcount equals its holders."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        holders = [0] * self.pool.num_pages
        for p in self.cache.all_pages():
            holders[p] += 1
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise IntegrityError(f"{seq_id}: page twice in one table")
            for p in table:
                holders[p] += 1
        for p, n in enumerate(holders):
            if self.pool.refcount(p) != n:
                raise IntegrityError(f"page {p}: refcount {self.pool.refcount(p)} != {n}")
        held = {p for t in self._tables.values() for p in t}
        s = self.stats()
        if (s.used_pages, s.cached_pages) != (len(held), self.cache.num_pages - len(
                held.intersection(self.cache.all_pages()))):
            raise IntegrityError(f"stats count {s.used_pages} used and {s.cached_pages} "
                                 f"cached-only pages; the tables hold {len(held)}")
        if not self._namespace.keys() <= self._tables.keys():
            raise IntegrityError("a namespace kept for a sequence without a page table")
        if s.free_pages + s.cached_pages + s.used_pages != s.total_pages:
            raise IntegrityError(f"free + cached + used pages != total: {s}")
