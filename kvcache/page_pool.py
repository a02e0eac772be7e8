"""Page pool: which KV pages are free, and how many holders each used page has.

Plain Python bookkeeping over page ids; the tensor that holds the pages lives in the model
runner (`kvcache.paged`). A page's holders are sequences (through their page tables),
reservations, and the prefix cache (one reference for as long as the page is in the tree).
A page returns to the free list when its last holder lets go.

The pool also keeps the prefix cache's eviction count, because only the pool sees every
reference come and go: the cache marks the pages it could evict (in the tree, not pinned), and
`num_evictable` is the number of marked pages that nobody but the cache holds (refcount 1). It
moves by one at the 1 <-> 2 refcount transitions of marked pages, so asking costs O(1).
"""

from __future__ import annotations

from kvcache.integrity import IntegrityError


class PagePool:
    """Fixed set of page ids `0 .. num_pages-1` with reference counts.

    `alloc` and `release` are O(pages touched). Allocation order is deterministic (a LIFO stack
    that starts as 0, 1, 2, ...), which lets tests assert exact page ids and keeps recently freed
    (cache-warm) pages in use.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages  # owned by this pool
        self._free = list(range(num_pages - 1, -1, -1))  # stack; pop() gives the lowest id first
        self._marked = bytearray(num_pages)  # 1: the prefix cache may evict it (set by the cache)
        self.num_evictable = 0  # marked pages only the cache holds (refcount 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages, each with one reference. Returns None (taking nothing) if fewer
        than `n` are free: running out is an expected result the caller handles (evict, wait)."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def mark_evictable(self, pages: list[int], evictable: bool) -> None:
        """The prefix cache says whether it may evict `pages` (they are in its tree, unpinned);
        each of them is held by the cache, so in use."""
        for p in pages:
            if self._marked[p] != evictable:
                self._marked[p] = evictable
                if self._refcount[p] == 1:
                    self.num_evictable += 1 if evictable else -1

    def retain(self, pages: list[int]) -> None:
        """Add one reference to each of `pages` (all must be in use)."""
        for p in pages:
            rc = self._refcount[p]
            if rc <= 0:
                raise IntegrityError(f"retain of free page {p}")
            if rc == 1 and self._marked[p]:
                self.num_evictable -= 1
            self._refcount[p] = rc + 1

    def release(self, pages: list[int]) -> int:
        """Drop one reference from each of `pages`; pages that reach zero become free.

        Returns how many pages were freed. Pages are pushed in reverse so that releasing
        [a, b, c] and allocating three again gives [a, b, c] back.
        """
        freed = 0
        for p in reversed(pages):
            rc = self._refcount[p]
            if rc <= 0:
                raise IntegrityError(f"release of free page {p}")
            self._refcount[p] = rc - 1
            if rc == 2 and self._marked[p]:
                self.num_evictable += 1
            elif rc == 1:
                if self._marked[p]:  # the cache dropped it
                    self._marked[p] = 0
                    self.num_evictable -= 1
                self._free.append(p)
                freed += 1
        return freed

    def check_integrity(self) -> None:
        """Free list and refcounts agree: a page is free exactly when nobody holds it."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("page on the free list twice")
        for p, rc in enumerate(self._refcount):
            if rc < 0:
                raise IntegrityError(f"page {p} has refcount {rc}")
            if (rc == 0) != (p in free):
                raise IntegrityError(f"page {p}: refcount {rc}, on free list {p in free}")
            if rc == 0 and self._marked[p]:
                raise IntegrityError(f"free page {p} marked evictable")
        sole = sum(1 for p, rc in enumerate(self._refcount) if rc == 1 and self._marked[p])
        if sole != self.num_evictable:
            raise IntegrityError(f"{sole} evictable pages, counted {self.num_evictable}")

    def is_marked(self, page: int) -> bool:
        return bool(self._marked[page])
