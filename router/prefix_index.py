"""The router's prefix index: which engine holds which context (paper §3.2, example 4).

A tree over token ids at page granularity, like each engine's own prefix cache; every node
lists the engines believed to hold its page (the path from the root to the node, that is).
The router adds to it when an engine finishes a request (it caches the prompt), when a
remote_send leaves the sender holding the prompt, and when a commit lands a context. Engines
evict on their own, so the index holds hints, not facts: a strategy acts on `match()` and the
engine calls then say what is really there (prep_recv's `matched`); `forget()` corrects it.

    root ── (t0..t15) ── (t16..t31) ── (t32..t47)      engines {"e1"}
                     │                └ (u32..u47)      engines {"e1", "e2"}
                     └ ...

One tree per LoRA adapter (`adapter`, None: the base model), as each engine keeps one per
adapter: KV computed with an adapter is held for that adapter's requests only.

No torch; plain Python, tested to the exact node.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence


class _Node:
    __slots__ = ("key", "parent", "children", "engines", "last_used")

    def __init__(self, key: tuple[int, ...], parent: _Node | None):
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.engines: set[str] = set()
        self.last_used = 0


class PrefixIndex:
    def __init__(self, page_size: int = 16, max_pages: int = 1 << 18):
        """
        Args:
            page_size: tokens per node; use the engines' page size (a partial page is never
                cached by an engine, so it is not indexed).
            max_pages: nodes kept; past this the least recently used leaves are dropped.
        """
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size {page_size} and max_pages {max_pages} must be >= 1")
        self.page_size = page_size
        self.max_pages = max_pages
        self._roots: dict[str | None, _Node] = {}  # adapter -> its tree (None: the base)
        self._num_nodes = 0
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return self._num_nodes

    def _pages(self, tokens: Sequence[int]) -> Iterable[tuple[int, ...]]:
        ps = self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            yield tuple(tokens[start : start + ps])

    def insert(self, tokens: Sequence[int], engine: str, adapter: str | None = None) -> int:
        """Record that `engine` holds the whole pages of `tokens` (computed with LoRA adapter
        `adapter`; None: the base model). Returns the tokens indexed."""
        if adapter not in self._roots:
            self._roots[adapter] = _Node((), None)
        node, now, depth = self._roots[adapter], next(self._clock), 0
        for key in self._pages(tokens):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node)
                self._num_nodes += 1
            child.engines.add(engine)
            child.last_used = now
            node, depth = child, depth + 1
        self._evict(keep=node)
        return depth * self.page_size

    def match(self, tokens: Sequence[int], adapter: str | None = None) -> dict[str, int]:
        """For each engine believed to hold a prefix of `tokens` (for LoRA adapter `adapter`;
        None: the base): its length in tokens (a page multiple). Engines holding nothing of it
        are absent. Marks the path as used."""
        out: dict[str, int] = {}
        if adapter not in self._roots:
            return out
        node, now, depth = self._roots[adapter], next(self._clock), 0
        for key in self._pages(tokens):
            node = node.children.get(key)
            if node is None:
                break
            depth += 1
            node.last_used = now
            for engine in node.engines:
                out[engine] = depth * self.page_size
        return out

    def forget(self, tokens: Sequence[int], engine: str, held: int = 0,
               adapter: str | None = None) -> None:
        """`engine` holds only the first `held` tokens of `tokens` (for `adapter`; it said
        so): drop it from the nodes past that along the path, and from everything below."""
        node = self._roots.get(adapter)
        if node is None:
            return
        for depth, key in enumerate(self._pages(tokens)):
            node = node.children.get(key)
            if node is None:
                return
            if depth * self.page_size >= held:
                self._drop_engine(node, engine)
                return

    def remove_engine(self, engine: str) -> None:
        """The engine left the pool (or restarted with an empty cache)."""
        for root in list(self._roots.values()):
            self._drop_engine(root, engine)

    def engines_of(self, tokens: Sequence[int], adapter: str | None = None) -> set[str]:
        """Engines believed to hold all whole pages of `tokens` (for `adapter`)."""
        full = len(tokens) // self.page_size * self.page_size
        return {e for e, n in self.match(tokens, adapter).items() if n == full}

    # -- upkeep ---------------------------------------------------------------------------------

    def _drop_engine(self, top: _Node, engine: str) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            node.engines.discard(engine)
            stack.extend(node.children.values())
        self._prune(top)

    def _prune(self, top: _Node) -> None:
        """Remove the nodes under (and including) `top` that no engine holds (children first;
        no recursion: a 32k-token context is 2,000 pages deep)."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):
            if node.parent is not None and not node.engines and not node.children:
                del node.parent.children[node.key]
                self._num_nodes -= 1

    def _evict(self, keep: _Node) -> None:
        """Drop least recently used leaves until at most max_pages nodes remain."""
        if self._num_nodes <= self.max_pages:
            return
        leaves = sorted((n for n in self._walk() if not n.children and n is not keep),
                        key=lambda n: n.last_used)
        # A tenth at a time, so that a full index does not sort on every insert.
        excess = self._num_nodes - self.max_pages + self.max_pages // 10
        for leaf in leaves[:excess]:
            del leaf.parent.children[leaf.key]
            self._num_nodes -= 1

    def _walk(self) -> Iterable[_Node]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
