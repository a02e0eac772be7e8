"""The prefix cache's second level: KV pages in host memory (issue 40, item 4).

Eviction from the device pool demotes instead of dropping when a host tier is attached: the
evicted tail of a leaf becomes a node of its own whose pages are host page ids, and the tree
keeps it, so a later prompt still matches it. A match whose tail is on the host loads those
pages back into fresh device pages (`load`) before its sequence runs.

    root ── [a b c d][e f g h] ──┬── [i j k l]       device pages (the pool's ids)
                                 └── {x y z w}{...}  host pages (the host pool's ids)

Invariant: a node on the host has only children on the host, so along any path the device
pages come first and the host pages after them. Device eviction therefore takes "device
leaves" (device nodes with no device child), and host eviction takes leaves on the host.

The host pool is shared with the swapped-out sequences of kvcache/host_tier.py, which take
precedence: `evict_host` is how the host tier makes room for a swap-out. The tree holds one
host reference on each of its host pages. The copies themselves are the `KVMover`'s (the
engine's HostSwap); it is called at the moment the bookkeeping moves a page, so copies happen
in the order their pages are reused.

Scale: whether a node is a device leaf is a scan of its children (`_has_device_child`), O(1)
without a host tier (the first child is on the device) but O(children) for a node whose many
children all went to the host (a shared system prompt under thousands of demoted contexts),
each time one of them is evicted; a count of device children per node would make it O(1).

Plain Python; mixed into PrefixCache (kvcache/prefix_cache.py), whose fields it uses.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Protocol

from kvcache.integrity import IntegrityError
from kvcache.page_pool import PagePool

if TYPE_CHECKING:
    from kvcache.prefix_cache import PrefixMatch, _Node


class KVMover(Protocol):
    """Copies KV between the device pool and the host pool (engine/host_swap.py's HostSwap).
    Each call is ordered after every copy and forward issued before it, and before every one
    issued after it (on CUDA: on the compute stream)."""

    def demote(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy the KV of `device_pages` into `host_pages` (pairwise)."""

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy the KV of `host_pages` into `device_pages` (pairwise)."""

    def settle(self) -> None:
        """Wait until the copies issued so far have landed: before their device pages go to a
        writer or reader outside the compute stream (a peer's transfer, a sender's thread)."""


class HostLevel:
    """The host-tier half of PrefixCache: demotion, loads, host eviction, host integrity."""

    pool: PagePool
    page_size: int
    num_pages: int

    def _init_host(self) -> None:
        self.host_pool: PagePool | None = None  # set by attach_host; shared with host_tier
        self.mover: KVMover | None = None
        self.num_host_pages = 0  # host pages in the tree
        self._host_heap: list[tuple[int, int, _Node]] = []  # leaves on the host, lazily
        self._loading: set[_Node] = set()  # host nodes a load is finding device pages for

    def attach_host(self, host_pool: PagePool, mover: KVMover) -> None:
        """Demote evicted pages into `host_pool` (from now on) through `mover`."""
        self.host_pool, self.mover = host_pool, mover

    # ---- demotion ------------------------------------------------------------------------------

    def _demote_tail(self, node: _Node, n_pages: int) -> int | None:
        """Move the last `n_pages` device pages of device leaf `node` to host pages: they
        become a node of their own on the host (the node is split first if it keeps some).
        Returns the device pages freed; None, changing nothing, if the host has no room."""
        host_pages = self._host_alloc(n_pages)
        if host_pages is None:
            return None
        head = None
        if n_pages < len(node.pages):
            head = self._split(node, len(node.pages) - n_pages)  # `node` keeps the tail
        device_pages = node.pages
        self.mover.demote(device_pages, host_pages)
        node.pages, node.on_host = host_pages, True
        self.num_pages -= n_pages
        self.num_host_pages += n_pages
        self._push_leaf(node)
        if head is not None:
            self._push_leaf(head)  # a device leaf now
        return self.pool.release(device_pages)

    def _host_alloc(self, n: int) -> list[int] | None:
        """`n` host pages, evicting the tree's least recently used host pages if needed."""
        if n > self.host_pool.num_free:
            self.evict_host(n - self.host_pool.num_free)
        return self.host_pool.alloc(n)

    # ---- host hits -----------------------------------------------------------------------------

    def load(self, match: PrefixMatch, alloc: Callable[[int], list[int] | None]) -> list[int]:
        """Bring the host pages of `match` (its `host_len` tokens past the device pages) back
        into device pages from `alloc` (which may evict others, never these). Returns the new
        device pages, each held by the tree only (the caller takes its own references); []
        if `alloc` found none, the pages staying on the host."""
        if not match.host_len:
            return []
        nodes = self._host_path(match.node)
        n = sum(len(node.pages) for node in nodes)
        self._loading.update(nodes)
        try:
            device_pages = alloc(n)
        finally:
            self._loading.difference_update(nodes)
        if device_pages is None:
            return []
        host_pages = [p for node in nodes for p in node.pages]
        self.mover.load(host_pages, device_pages)
        self.host_pool.release(host_pages)
        at = 0
        for node in nodes:
            node.pages, node.on_host = device_pages[at : at + len(node.pages)], False
            at += len(node.pages)
        self.pool.mark_evictable(device_pages, True)
        self.num_pages += n
        self.num_host_pages -= n
        self._touch(match.node)
        return device_pages

    def _adopt(self, nodes: list[_Node], pages: list[int], first: int) -> list[int]:
        """A sequence computed the KV of host `nodes` itself (`pages`, the first of them at
        position `first`): the tree takes its device pages and drops the host copies.
        Returns the adopted pages, in order."""
        adopted = []
        for node in nodes:
            at = (node.start - first) // self.page_size
            mine = pages[at : at + len(node.pages)]
            self.pool.retain(mine)
            self.pool.mark_evictable(mine, True)
            self.host_pool.release(node.pages)
            self.num_host_pages -= len(mine)
            self.num_pages += len(mine)
            node.pages, node.on_host = list(mine), False
            adopted += mine
        return adopted

    def _host_path(self, node: _Node) -> list[_Node]:
        """The nodes on the host on the path ending at `node` (a suffix of it), top down."""
        path = []
        while node.on_host:
            path.append(node)
            node = node.parent
        return path[::-1]

    # ---- host eviction -------------------------------------------------------------------------

    def evict_host(self, num_pages: int) -> int:
        """Drop at least `num_pages` host pages, least recently used leaves first (the host
        tier's swap-outs come before cached prefixes), or as many as can go. Returns how many."""
        freed, skipped = 0, []
        while self._host_heap and freed < num_pages:
            entry = heapq.heappop(self._host_heap)
            last_access, _, node = entry
            if (last_access != node.last_access or not node.on_host or node.children
                    or not node.pages):
                continue  # stale: used since, loaded or adopted, grew children, dropped
            if node in self._loading:
                skipped.append(entry)
                continue
            parent = node.parent
            freed += self._drop_tail(node, min(num_pages - freed, len(node.pages)))
            self._push_leaf(node if node.pages else parent)
        for entry in skipped:
            heapq.heappush(self._host_heap, entry)
        return freed

    def _drop_host_children(self, node: _Node) -> None:
        """Drop everything under `node` (all on the host: `node` is being dropped from the
        device without demotion, and what hangs below it would hang in the air)."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            assert child.on_host and child not in self._loading, child.start
            stack.extend(child.children.values())
            self.host_pool.release(child.pages)
            self.num_host_pages -= len(child.pages)
            child.pages, child.key = [], []  # its heap entries are stale now
        node.children.clear()

    # ---- inspection ----------------------------------------------------------------------------

    def host_pages(self) -> list[int]:
        return [p for node in self._iter_nodes() if node.on_host for p in node.pages]

    def _check_host_node(self, node: _Node, seen: set[int]) -> None:
        if node.parent.on_host and not node.on_host:
            raise IntegrityError(f"device node at {node.start} under a node on the host")
        if not node.on_host:
            return
        if self.host_pool is None or node.pin_count:
            raise IntegrityError(f"host node at {node.start}: pinned or no host pool")
        for p in node.pages:
            if p in seen:
                raise IntegrityError(f"host page {p} twice in the prefix cache")
            if self.host_pool.refcount(p) < 1:
                raise IntegrityError(f"cached host page {p} is free")
            seen.add(p)
