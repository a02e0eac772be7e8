"""Radix prefix cache over token ids, at page granularity.

Each edge of the tree holds a run of whole pages: `key` has `len(pages) * page_size` tokens.
Only full pages are ever cached; a sequence's last, partial page stays private to it.

The tree holds one pool reference on every page in it. A sequence that reuses a cached prefix
takes its own references (through the KV manager), so "nobody but the tree holds this page" is
simply `refcount == 1`. Eviction removes least-recently-used leaves whose pages only the tree
holds and that nobody pinned. Pins are separate from references (paper §3.5: the router's global
policy can keep a prefix that the engine's own LRU would drop), counted per node along the path.

    root ── [a b c d][e f g h] ──┬── [i j k l]          page_size = 4
                                 └── [x y z w][...]     children keyed by their first page
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from kvcache.page_pool import PagePool


class _Node:
    __slots__ = ("key", "pages", "children", "parent", "last_access", "pin_count", "uid")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "_Node | None", uid: int):
        self.key = key  # tokens on the edge from the parent
        self.pages = pages  # one page per `page_size` tokens of key
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page
        self.parent = parent
        self.last_access = 0  # logical clock, set by PrefixCache
        self.pin_count = 0
        self.uid = uid  # creation order: deterministic tie-break for eviction


@dataclass(frozen=True)
class CachedPrefix:
    """Where a sequence's cached prefix ends in the tree (see `PrefixCache.insert`).

    Splits keep it valid: splitting an edge creates a new upper node and the original node
    keeps the lower end, which is where the sequence's prefix ends."""

    node: _Node


@dataclass(frozen=True)
class PrefixMatch:
    matched_len: int  # tokens matched, a multiple of page_size
    pages: list[int]  # the cached pages covering them (no references taken)


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self._uids = itertools.count()
        self._root = _Node((), [], None, next(self._uids))
        self._clock = 0
        self.num_pages = 0  # pages currently in the tree

    # ---- lookup -------------------------------------------------------------------------------

    def match(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages; marks it recently used."""
        node, pages = self._walk(tokens)
        self._touch(node)
        return PrefixMatch(len(pages) * self.page_size, pages)

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

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], pos: int) -> int:
        ps, n = self.page_size, 0
        while (n + 1) * ps <= len(key) and pos + (n + 1) * ps <= len(tokens):
            if key[n * ps : (n + 1) * ps] != tuple(tokens[pos + n * ps : pos + (n + 1) * ps]):
                break
            n += 1
        return n

    def _split(self, node: _Node, n_pages: int) -> _Node:
        """Cut `node`'s edge after `n_pages` pages; returns the new upper node."""
        cut = n_pages * self.page_size
        upper = _Node(node.key[:cut], node.pages[:n_pages], node.parent, next(self._uids))
        upper.last_access = node.last_access
        upper.pin_count = node.pin_count  # a pin covers both halves of a pinned edge
        node.parent.children[node.key[: self.page_size]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[node.key[: self.page_size]] = node
        return upper

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    # ---- insertion ----------------------------------------------------------------------------

    def insert(
        self, tokens: list[int], pages: list[int], after: "CachedPrefix | None" = None
    ) -> tuple[list[int], "CachedPrefix"]:
        """Cache the whole pages of `tokens` whose KV is in `pages`.

        Where a prefix is already cached, the tree keeps its own pages and ignores the caller's;
        the tree takes a reference on each page it adopts. `after`, the handle a previous insert
        of the same sequence returned, continues from where that one ended: `tokens` and
        `pages` are then only what follows it, and the walk does not start at the root.

        Returns the tree's pages for the inserted range (a caller switches its page table to
        them and releases duplicates), and a handle for the next insert. A handle stays valid
        while its owner holds references on the pages up to it (so they cannot be evicted).
        """
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        tokens = tokens[: n_full * ps]
        node, cached = self._walk(tokens, after.node if after else None)
        pos = len(cached) * ps
        if pos < len(tokens):
            new_pages = pages[len(cached) : n_full]
            leaf = _Node(tuple(tokens[pos:]), list(new_pages), node, next(self._uids))
            node.children[leaf.key[:ps]] = leaf
            self.pool.retain(new_pages)
            self.num_pages += len(new_pages)
            cached = cached + new_pages
            node = leaf
        self._touch(node)
        return cached, CachedPrefix(node)

    # ---- pins -----------------------------------------------------------------------------------

    def pin(self, tokens: list[int]) -> int:
        """Protect the cached whole-page prefix of `tokens` from eviction. Returns tokens pinned."""
        node, pages = self._walk(tokens)
        self._touch(node)
        while node is not self._root:
            node.pin_count += 1
            node = node.parent
        return len(pages) * self.page_size

    def unpin(self, tokens: list[int]) -> int:
        """Undo one `pin` of the same prefix. Raises ValueError if that prefix is not pinned."""
        node, pages = self._walk(tokens)
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        if not path or any(n.pin_count == 0 for n in path):
            raise ValueError(f"prefix of {len(tokens)} tokens is not pinned")
        for n in path:
            n.pin_count -= 1
        return len(pages) * self.page_size

    # ---- eviction -----------------------------------------------------------------------------

    def _only_tree_holds(self, node: _Node) -> bool:
        return node.pin_count == 0 and all(self.pool.refcount(p) == 1 for p in node.pages)

    def num_evictable(self) -> int:
        """Pages that `evict` could free now: unpinned subtrees that only the tree holds."""

        def visit(node: _Node) -> tuple[int, bool]:
            total, whole = 0, True
            for child in node.children.values():
                n, ok = visit(child)
                total += n
                whole = whole and ok
            if node is not self._root and whole and self._only_tree_holds(node):
                return total + len(node.pages), True
            return total, False

        return visit(self._root)[0]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages by dropping LRU leaves, or as many as possible.

        Returns the number of pages freed. A leaf is dropped only if it is unpinned and only the
        tree holds its pages; a leaf longer than what is still needed loses only its tail pages.
        Dropping a whole leaf may make its parent a droppable leaf.
        """
        heap = [(n.last_access, n.uid, n) for n in self._leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            if node.children or not self._only_tree_holds(node):
                continue
            take = min(num_pages - freed, len(node.pages))
            freed += self._drop_tail(node, take)
            parent = node.parent
            if not node.pages and parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def _drop_tail(self, node: _Node, n_pages: int) -> int:
        """Remove the last `n_pages` pages of a leaf (the whole leaf if that is all of it)."""
        keep = len(node.pages) - n_pages
        dropped = node.pages[keep:]
        if keep == 0:
            del node.parent.children[node.key[: self.page_size]]
        node.pages, node.key = node.pages[:keep], node.key[: keep * self.page_size]
        self.num_pages -= len(dropped)
        return self.pool.release(dropped)

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                leaves.append(node)
        return leaves

    # ---- inspection -----------------------------------------------------------------------------

    def all_pages(self) -> list[int]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out

    def num_pinned_pages(self) -> int:
        return sum(
            len(n.pages) for n in self._iter_nodes() if n.pin_count > 0 and n is not self._root
        )

    def _iter_nodes(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Tree shape and page ownership are consistent with the pool."""
        ps, seen = self.page_size, set()
        for node in self._iter_nodes():
            if node is self._root:
                continue
            assert len(node.key) == len(node.pages) * ps > 0, "edge not in whole pages"
            assert node.parent.children.get(node.key[:ps]) is node, "child keyed wrongly"
            assert node.pin_count >= 0
            for p in node.pages:
                assert p not in seen, f"page {p} twice in the prefix cache"
                assert self.pool.refcount(p) >= 1, f"cached page {p} is free"
                seen.add(p)
        assert len(seen) == self.num_pages, f"{len(seen)} pages in tree, counted {self.num_pages}"
