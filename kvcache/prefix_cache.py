"""Radix prefix cache over token ids, at page granularity.

Each edge of the tree holds a run of whole pages: `key` has `len(pages) * page_size` tokens.
Only full pages are ever cached; a sequence's last, partial page stays private to it.

The tree holds one pool reference on every page in it. A sequence that reuses a cached prefix
takes its own references (through the KV manager), so "nobody but the tree holds this page" is
simply `refcount == 1`. Pins are separate from references (paper §3.5: the router's global
policy can keep a prefix that the engine's own LRU would drop), counted per node along the path.

    root ── [a b c d][e f g h] ──┬── [i j k l]          page_size = 4
                                 └── [x y z w][...]     children keyed by their first page

Scale (a decoded context grows one page at a time, for tens of thousands of pages):
- A sequence that continues its own last insert extends that leaf in place rather than hanging
  a one-page child under it, so a long context is one edge, not a chain as deep as its pages.
  Handles (`CachedPrefix`) therefore remember the absolute position where their prefix ends.
- Nothing recurses; `_touch` walks up nodes (branch points), not pages.
- What can be evicted is counted by the page pool as references come and go (O(1) to ask):
  the cache marks a page evictable while it sits in an unpinned node. Holders take pages from
  position 0 on (a page table, a reservation), so the pages only the tree holds are the tail of
  any path: all of them can be freed by trimming leaves, tail first.
- Leaves wait for eviction in a heap ordered by last use, pushed when used; stale entries are
  skipped, and the heap is rebuilt once it holds more entries than the tree has pages.

With a host tier attached (kvcache/prefix_host.py), evicted pages move to host memory instead
of leaving the tree; "leaf" for device eviction then means a device node without device
children.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kvcache.integrity import IntegrityError
from kvcache.page_pool import PagePool
from kvcache.prefix_host import HostLevel


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "start", "last_access", "pin_count",
                 "uid", "on_host")

    def __init__(self, key: list[int], pages: list[int], parent: "_Node | None",
                 start: int, uid: int):
        self.key = key  # tokens on the edge from the parent (a list: a growing edge extends it)
        self.pages = pages  # one page per `page_size` tokens of key
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page
        self.parent = parent
        self.start = start  # position of key[0] in the sequence (tokens above this node)
        self.last_access = 0  # logical clock, set by PrefixCache
        self.pin_count = 0
        self.uid = uid  # creation order: deterministic tie-break for eviction
        self.on_host = False  # its pages are host pages (kvcache/prefix_host.py)

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass(frozen=True)
class CachedPrefix:
    """Where a sequence's cached prefix ends in the tree (see `PrefixCache.insert`): `end`
    tokens from the root, at or above `node`'s end.

    The node may since have been split (the original node keeps the lower end) or extended in
    place by another sequence; `PrefixCache` finds the position again from `node` upward."""

    node: _Node
    end: int


@dataclass(frozen=True)
class PrefixMatch:
    matched_len: int  # tokens matched in device pages, a multiple of page_size
    pages: list[int]  # the device pages covering them (no references taken)
    host_len: int = 0  # tokens matched past them in host pages (`load` brings them back)
    node: "_Node | None" = field(default=None, repr=False, compare=False)  # where it ends


class PrefixCache(HostLevel):
    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self._uids = itertools.count()
        # One tree per namespace (0: the base model; a LoRA adapter's id otherwise): KV is
        # computed with the namespace's weights, so a prefix matches only within it. A root
        # is the node without a parent; an adapter's goes once its tree is empty.
        self._root = _Node([], [], None, 0, next(self._uids))  # the base model's
        self._roots: dict[int, _Node] = {0: self._root}
        self._clock = 0
        self.num_pages = 0  # pages currently in the tree
        self._pinned: set[_Node] = set()  # nodes with pin_count > 0 (stats walk only these)
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, uid, leaf), lazily
        self._init_host()

    # ---- lookup -------------------------------------------------------------------------------

    def _root_of(self, namespace: int) -> _Node:
        if namespace not in self._roots:
            self._roots[namespace] = _Node([], [], None, 0, next(self._uids))
        return self._roots[namespace]

    def match(self, tokens: list[int], namespace: int = 0) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages, within `namespace`, on the device
        and then on the host; marks it recently used."""
        if namespace not in self._roots:
            return PrefixMatch(0, [])
        node, pages = self._walk(tokens, self._roots[namespace])
        self._touch(node)
        n_host = sum(len(n.pages) for n in self._host_path(node))
        device = pages[: len(pages) - n_host]
        return PrefixMatch(len(device) * self.page_size, device, n_host * self.page_size, node)

    def _walk(self, tokens: list[int], node: "_Node | None" = None) -> tuple[_Node, list[int]]:
        """Follow `tokens` down the tree page by page from `node` (the root by default),
        splitting the last edge where the match ends inside it, so the returned node ends
        exactly at the match."""
        ps = self.page_size
        node, pos, pages = node or self._root, 0, []
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return node, pages

    def _common_pages(self, key: list[int], tokens: list[int], pos: int) -> int:
        """How many whole pages of `key` equal `tokens[pos:]`: one slice compare when the
        whole edge matches (a long edge), page by page only to find where it stops."""
        ps = self.page_size
        n = min(len(key), (len(tokens) - pos) // ps * ps)
        if key[:n] == tokens[pos : pos + n]:
            return n // ps
        k = 0
        while key[k * ps : (k + 1) * ps] == tokens[pos + k * ps : pos + (k + 1) * ps]:
            k += 1
        return k

    def _split(self, node: _Node, n_pages: int) -> _Node:
        """Cut `node`'s edge after `n_pages` pages; returns the new upper node. The original
        node keeps the lower end (handles that end there stay valid)."""
        cut = n_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:n_pages], node.parent, node.start,
                      next(self._uids))
        upper.last_access = node.last_access
        upper.pin_count = node.pin_count  # a pin covers both halves of a pinned edge
        upper.on_host = node.on_host
        if upper.pin_count:
            self._pinned.add(upper)
        node.parent.children[tuple(node.key[: self.page_size])] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        node.start += cut
        upper.children[tuple(node.key[: self.page_size])] = node
        return upper

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        end = node
        while node is not None:
            node.last_access = self._clock
            node = node.parent
        # its earlier heap entries are stale now: the leaf's on the host, if the path ends in
        # one, and its deepest device node's (a device leaf if only host nodes hang below it)
        if end.on_host:
            self._push_leaf(end)
        while end.on_host:
            end = end.parent
        self._push_leaf(end)

    # ---- insertion ----------------------------------------------------------------------------

    def insert(
        self, tokens: list[int], pages: list[int], after: "CachedPrefix | None" = None,
        namespace: int = 0,
    ) -> tuple[list[int], "CachedPrefix"]:
        """Cache the whole pages of `tokens` whose KV is in `pages`.

        Where a prefix is already cached, the tree keeps its own pages and ignores the caller's;
        the tree takes a reference on each page it adopts. `after`, the handle a previous insert
        of the same sequence returned, continues from where that one ended: `tokens` and
        `pages` are then only what follows it, and the walk does not start at the root. New
        pages that continue an unpinned leaf extend it; otherwise they hang as a new leaf.

        Returns the tree's pages for the inserted range (a caller switches its page table to
        them and releases duplicates), and a handle for the next insert. `namespace` is the
        tree a first insert (no `after`) goes into; a handle stays in its own. A handle stays valid
        while its owner holds references on the pages up to it (so they cannot be evicted).
        """
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        tokens = tokens[: n_full * ps]
        start = self._resume(after) if after else self._root_of(namespace)
        node, cached = self._walk(tokens, start)
        on_host = self._host_path(node)
        if on_host:  # computed again here: the device pages replace the host copies
            n_host = sum(len(n.pages) for n in on_host)
            cached = cached[: len(cached) - n_host] + self._adopt(on_host, pages, start.end)
        pos = len(cached) * ps
        if pos < len(tokens):
            new_pages = pages[len(cached) : n_full]
            self.pool.retain(new_pages)
            if node.parent is not None and not node.children and node.pin_count == 0:
                node.key.extend(tokens[pos:])  # a context growing page by page: one edge
                node.pages.extend(new_pages)
            else:
                leaf = _Node(list(tokens[pos:]), list(new_pages), node, node.end,
                             next(self._uids))
                node.children[tuple(leaf.key[:ps])] = leaf
                node = leaf
            self.pool.mark_evictable(new_pages, True)
            self.num_pages += len(new_pages)
            cached = cached + new_pages
            self._maybe_compact()
        self._touch(node)
        return cached, CachedPrefix(node, node.end)

    def _resume(self, after: CachedPrefix) -> _Node:
        """The node ending exactly at `after.end`, splitting one if it now ends inside it."""
        node = after.node
        while node.parent is not None and after.end <= node.start:  # split since: go up
            node = node.parent
        if after.end < node.end:  # extended since, by this or another sequence
            node = self._split(node, (after.end - node.start) // self.page_size)
        return node

    # ---- pins -----------------------------------------------------------------------------------

    def pin(self, tokens: list[int]) -> int:
        """Protect the cached whole-page prefix of `tokens` from eviction, its part on the
        device (a host tail is not loaded for it). Returns tokens pinned."""
        node, pages = self._walk(tokens)
        self._touch(node)
        n_host = sum(len(n.pages) for n in self._host_path(node))
        pages = pages[: len(pages) - n_host]
        while node.on_host:
            node = node.parent
        while node.parent is not None:
            node.pin_count += 1
            if node.pin_count == 1:
                self.pool.mark_evictable(node.pages, False)
                self._pinned.add(node)
            node = node.parent
        return len(pages) * self.page_size

    def unpin(self, tokens: list[int]) -> int:
        """Undo one `pin` of the same prefix. Raises ValueError if that prefix is not pinned."""
        node, pages = self._walk(tokens)
        pages = pages[: len(pages) - sum(len(n.pages) for n in self._host_path(node))]
        while node.on_host:
            node = node.parent
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        if not path or any(n.pin_count == 0 for n in path):
            raise ValueError(f"prefix of {len(tokens)} tokens is not pinned")
        for n in path:
            n.pin_count -= 1
            if n.pin_count == 0:
                self.pool.mark_evictable(n.pages, True)
                self._pinned.discard(n)
                self._push_leaf(n)
        return len(pages) * self.page_size

    # ---- eviction -----------------------------------------------------------------------------

    def num_evictable(self) -> int:
        """Pages that `evict` could free now: in unpinned nodes, held only by the tree. O(1)."""
        return self.pool.num_evictable

    def evict(self, num_pages: int, demote: bool = True) -> int:
        """Free at least `num_pages` device pages by trimming least-recently-used leaves, or as
        many as possible. Returns the number of pages freed.

        A leaf gives up the pages at its end that only the tree holds (all of them if nobody
        holds any), unless it is pinned; once empty it is dropped, which may make its parent a
        leaf. A leaf longer than what is still needed loses only its tail. With a host tier
        and `demote`, the pages given up move to the host while it has room (evicting its
        oldest); else they leave the tree, with whatever hangs below them on the host.
        """
        freed, held = 0, []
        while self._heap and freed < num_pages:
            entry = heapq.heappop(self._heap)
            last_access, _, node = entry
            if (last_access != node.last_access or node.on_host or not node.pages
                    or self._has_device_child(node)):
                continue  # stale: used since (a newer entry waits), grew children, dropped
            if node.pin_count:
                continue  # unpin pushes it again
            free_tail = 0
            for page in reversed(node.pages):
                if self.pool.refcount(page) != 1:
                    break
                free_tail += 1
            if free_tail == 0:
                held.append(entry)  # a sequence holds its tail: a candidate again later
                continue
            take = min(num_pages - freed, free_tail)
            parent = node.parent
            demoted = None
            if demote and self.host_pool is not None:
                demoted = self._demote_tail(node, take)
            if demoted is None:
                self._drop_host_children(node)
                demoted = self._drop_tail(node, take)
            freed += demoted
            self._push_leaf(node if node.pages and not node.on_host else parent)
        for entry in held:
            heapq.heappush(self._heap, entry)
        return freed

    def _has_device_child(self, node: _Node) -> bool:
        return any(not child.on_host for child in node.children.values())

    def _drop_tail(self, node: _Node, n_pages: int) -> int:
        """Remove the last `n_pages` pages of a leaf (the whole leaf if that is all of it),
        from its pool (the host's for a node on the host)."""
        keep = len(node.pages) - n_pages
        dropped = node.pages[keep:]
        if keep == 0:
            parent = node.parent
            del parent.children[tuple(node.key[: self.page_size])]
            if parent.parent is None and not parent.children:  # an adapter's tree is empty
                self._roots = {ns: root for ns, root in self._roots.items()
                               if ns == 0 or root is not parent}
        del node.pages[keep:], node.key[keep * self.page_size :]
        if node.on_host:
            self.num_host_pages -= len(dropped)
            return self.host_pool.release(dropped)
        self.num_pages -= len(dropped)
        return self.pool.release(dropped)

    def _push_leaf(self, node: _Node) -> None:
        """Queue `node` for eviction if it is a leaf: on the host, one without children; on
        the device, one without device children (not the root)."""
        if node.on_host:
            if not node.children:
                heapq.heappush(self._host_heap, (node.last_access, node.uid, node))
        elif node.parent is not None and node.pages and not self._has_device_child(node):
            heapq.heappush(self._heap, (node.last_access, node.uid, node))

    def _maybe_compact(self) -> None:
        """Drop the heaps' stale entries once they outnumber the tree's pages (amortized O(1))."""
        if len(self._heap) + len(self._host_heap) > 2 * (self.num_pages + self.num_host_pages
                                                        ) + 1024:
            self._heap, self._host_heap = [], []
            for node in self._iter_nodes():
                self._push_leaf(node)

    # ---- inspection -----------------------------------------------------------------------------

    def all_pages(self) -> list[int]:
        """The device pages in the tree."""
        return [p for node in self._iter_nodes() if not node.on_host for p in node.pages]

    def num_pinned_pages(self) -> int:
        return sum(len(n.pages) for n in self._pinned)

    def num_sole_pages(self) -> int:
        """Pages in the tree that nothing else holds (no page table): the evictable ones and
        those pinned. O(pinned pages)."""
        rc = self.pool.refcount
        return self.pool.num_evictable + sum(rc(p) == 1 for n in self._pinned for p in n.pages)

    def _iter_nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Tree shape, positions, page ownership and the evictable marks agree with the pool."""
        ps, seen, seen_host = self.page_size, set(), set()
        for node in self._iter_nodes():
            if node.parent is None:
                continue
            self._check_host_node(node, seen_host)
            if not len(node.key) == len(node.pages) * ps > 0:
                raise IntegrityError("edge not in whole pages")
            if node.parent.children.get(tuple(node.key[:ps])) is not node:
                raise IntegrityError("child keyed wrongly")
            if node.start != node.parent.end:
                raise IntegrityError(f"node at {node.start} under {node.parent.end}")
            if node.pin_count < 0:
                raise IntegrityError(f"node at {node.start}: pin count {node.pin_count}")
            for p in ([] if node.on_host else node.pages):
                if p in seen:
                    raise IntegrityError(f"page {p} twice in the prefix cache")
                if self.pool.refcount(p) < 1:
                    raise IntegrityError(f"cached page {p} is free")
                if self.pool.is_marked(p) != (node.pin_count == 0):
                    raise IntegrityError(f"page {p}: evictable mark {self.pool.is_marked(p)}, "
                                         f"pin {node.pin_count}")
                seen.add(p)
        if (len(seen), len(seen_host)) != (self.num_pages, self.num_host_pages):
            raise IntegrityError(f"{len(seen)} device and {len(seen_host)} host pages in tree, "
                                 f"counted {self.num_pages} and {self.num_host_pages}")
        pinned = {n for n in self._iter_nodes() if n.pin_count > 0 and n.parent is not None}
        if pinned != self._pinned:
            raise IntegrityError(f"{len(pinned)} pinned nodes, tracked {len(self._pinned)}")
