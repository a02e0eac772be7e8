"""The order a batch's lines run in: BlendServe's resource-aware prefix tree (seed 001, §3).

One prefix tree over the token ids of every line's rendered prompt. Each subtree carries the
compute and the memory traffic its requests need (`Cost`): compute grows with the tokens that
go through the GEMMs (its prompt tokens not shared with a sibling, once, plus every output
token); memory traffic with decode steps and what each step reads (the weights' share of a
request in a decoding batch, plus the KV of its context). Their ratio is the subtree's compute
density. Children are sorted by density, highest first (Algorithm 1, layer-wise), so a DFS of
the sorted tree lists compute-heavy requests on the left and memory-heavy ones on the right
while keeping every subtree contiguous. The dual scanner (§3.4) then walks that list from both
ends at once, splitting memory between the densest request left (left end) and the least dense
(right end) so that the blend has the whole batch's density (M_L + M_R = M, M_L ρ_L + M_R ρ_R =
M ρ_root), the side behind its share going next. Each side is a DFS of its half, so prefix
sharing stays near the DFS optimum; a batch of one density stays a plain DFS. A request's
density counts its prefixes' tokens split evenly among the requests sharing them.

    root ─ [sys prompt A] ─┬─ q1 (out 16)      DFS, sorted:    q1 q2 | q3 q4
                           └─ q2 (out 16)      dual scanner:   q1 q4 q2 q3
         ─ [sys prompt B] ─┬─ q3 (out 900)
                           └─ q4 (out 900)

Simplified from the paper: no node splitting (Algorithm 2: moving an outlier leaf to where its
density belongs at the price of recomputing its prefix); output lengths are `max_tokens` or a
default, not sampled from the tree; the scanner interleaves single requests rather than sizing
two memory partitions, since the engines' own schedulers decide batch sizes; the tree is built
from the sorted prompts and their common-prefix lengths, not token by token. No torch.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

# A decoding request's share of the weights read per step, in KV-token equivalents: 16 GB of
# weights over a batch of 256 against 128 KB of KV per token (Llama-3.1-8B, bf16) is ~500.
WEIGHT_TOKENS = 512


@dataclass(frozen=True)
class Cost:
    compute: float  # tokens through the GEMMs
    memory: float  # token-equivalents read in decode steps

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.compute + other.compute, self.memory + other.memory)

    @property
    def density(self) -> float:
        return self.compute / self.memory if self.memory else float("inf")


def request_memory(prompt_len: int, output_len: int) -> float:
    """Reads over a request's decode steps: each step its weights' share and its context."""
    return output_len * (WEIGHT_TOKENS + prompt_len + output_len / 2)


@dataclass
class _Node:
    depth: int  # tokens from the root to here
    items: list[int] = field(default_factory=list)  # requests whose prompt ends here
    children: list[_Node] = field(default_factory=list)
    cost: Cost = Cost(0, 0)  # of everything below `depth`, set by _annotate()
    count: int = 0  # requests in the subtree, set by _annotate()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of `a` and `b`: whole chunks compared as slices (in C),
    then token by token inside the first chunk that differs."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i:i + 32] == b[i:i + 32]:
        i += 32
    while i < n and a[i] == b[i]:
        i += 1
    return min(i, n)


def _sort_key(prompt: Sequence[int]) -> bytes | tuple:
    """A key that sorts as the token ids do: big-endian 32-bit words compare as bytes (one
    memcmp). Tuples of ints sort the same but compare element by element, and one `sorted`
    call holds the GIL throughout: over 10,000 prompts sharing long prefixes that stalled the
    router's event loop 0.4 s while a batch was ordered in a worker thread. Ids outside 32
    bits (a line the API will refuse) fall back to the tuple; such prompts sort after all
    others, among themselves by their ids."""
    try:
        words = array("I", prompt)
    except (OverflowError, TypeError):
        return (1, tuple(prompt))
    if sys.byteorder == "little":
        words.byteswap()
    return (0, words.tobytes())


def build_tree(prompts: Sequence[Sequence[int]]) -> _Node:
    """The compressed prefix tree of `prompts` from their sorted order: each prompt's common
    prefix with the one sorted before it says at which depth it branches off."""
    root = _Node(0)
    stack, previous = [root], None
    for i in sorted(range(len(prompts)), key=lambda i: (_sort_key(prompts[i]), i)):
        prompt = prompts[i]
        shared = 0 if previous is None else _common(previous, prompt)
        last = None
        while stack[-1].depth > shared:
            last = stack.pop()
        if stack[-1].depth < shared:  # branch inside the edge to `last`
            branch = _Node(shared, children=[last])
            stack[-1].children[-1] = branch
            stack.append(branch)
        if len(prompt) == shared:
            stack[-1].items.append(i)
        else:
            leaf = _Node(len(prompt), items=[i])
            stack[-1].children.append(leaf)
            stack.append(leaf)
        previous = prompt
    return root


def _preorder(root: _Node) -> list[_Node]:
    """Every node, parents before children (iterative: a long chain of turns is a deep tree)."""
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    return nodes


def _annotate(nodes: list[_Node], prompt_lens: Sequence[int], output_lens: Sequence[int]
              ) -> None:
    """Each node's `cost` and `count`, children first."""
    for node in reversed(nodes):
        cost = Cost(0, 0)
        for i in node.items:
            cost += Cost(output_lens[i], request_memory(prompt_lens[i], output_lens[i]))
        for child in node.children:
            cost += Cost(child.depth - node.depth, 0) + child.cost
        node.cost = cost
        node.count = len(node.items) + sum(child.count for child in node.children)


def _sorted_leaves(root: _Node, prompt_lens: Sequence[int], output_lens: Sequence[int]
                   ) -> list[int]:
    """DFS of the tree with every node's requests and subtrees sorted by density, highest
    first (ties keep the prompts' sorted order)."""
    out: list[int] = []
    stack: list[_Node | int] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, int):
            out.append(node)
            continue
        units: list[tuple[float, int, _Node | int]] = []
        for k, i in enumerate(node.items):
            density = Cost(output_lens[i], request_memory(prompt_lens[i],
                                                          output_lens[i])).density
            units.append((density, k, i))
        for k, child in enumerate(node.children, start=len(node.items)):
            density = (Cost(child.depth - node.depth, 0) + child.cost).density
            units.append((density, k, child))
        units.sort(key=lambda u: (-u[0], u[1]))
        stack.extend(unit for _, _, unit in reversed(units))
    return out


def _shared_compute(root: _Node, output_lens: Sequence[int]) -> dict[int, float]:
    """Each request's compute with every prefix's tokens split evenly among the requests
    under it: what the request costs in a DFS order, whichever of its siblings runs first."""
    out: dict[int, float] = {}
    stack = [(root, 0.0)]
    while stack:
        node, inherited = stack.pop()
        for i in node.items:
            out[i] = inherited + output_lens[i]
        for child in node.children:
            stack.append((child, inherited + (child.depth - node.depth) / child.count))
    return out


@dataclass(frozen=True)
class Ordering:
    order: list[int]  # indices into the prompts, in dispatch order
    dfs: list[int]  # the sorted tree's DFS order (the prefix-sharing optimum)
    shareable_tokens: int  # prompt tokens a DFS order serves from cache (the optimum)


def blend_order(prompts: Sequence[Sequence[int]], output_lens: Sequence[int]) -> Ordering:
    """BlendServe's order of `prompts` (token ids) given their expected output lengths."""
    if len(prompts) != len(output_lens):
        raise ValueError(f"{len(prompts)} prompts but {len(output_lens)} output lengths")
    prompt_lens = [len(p) for p in prompts]
    root = build_tree(prompts)
    _annotate(_preorder(root), prompt_lens, output_lens)
    total = root.cost
    dfs = _sorted_leaves(root, prompt_lens, output_lens)
    compute = _shared_compute(root, output_lens)
    memory = [request_memory(p, o) for p, o in zip(prompt_lens, output_lens)]
    density = [compute[i] / memory[i] if memory[i] else float("inf")
               for i in range(len(prompts))]
    # The dual scanner: the left end is the densest request left, the right end the least
    # dense. Memory is split between them so that the blend has the whole batch's density
    # (§3.4: M_L + M_R = M, M_L ρ_L + M_R ρ_R = M ρ_root); the side behind its share goes next.
    order, left, right = [], 0, len(dfs) - 1
    memory_left = memory_right = 0.0
    while left <= right:
        high, low = density[dfs[left]], density[dfs[right]]
        share = 1.0 if high <= low else min(1.0, max(0.0, (total.density - low) / (high - low)))
        if memory_left <= share * (memory_left + memory_right):
            order.append(dfs[left])
            memory_left += memory[dfs[left]]
            left += 1
        else:
            order.append(dfs[right])
            memory_right += memory[dfs[right]]
            right -= 1
    shared_before = [0] + [_common(prompts[a], prompts[b]) for a, b in zip(dfs, dfs[1:])]
    return Ordering(order, dfs, sum(shared_before))


def alternate(dfs: Sequence[int]) -> list[int]:
    """The sorted DFS `dfs` taken one request from each end in turn (densest, least dense, next
    densest, ...): the dual scanner counting requests instead of splitting memory by the
    paper's shares. Each end is still a DFS of its half, so prefix sharing stays as the
    blend's. In a model of one engine's steps (bench/scripts/blend_model.py) it blended
    better than the shares wherever the file held compute-heavy lines: a batch of
    documents (long prompts, short answers) among conversations finished 1.10-1.16x sooner
    than the DFS, against 1.03-1.07x for the shares (docs/benchmarks.md). Not measured on a
    GPU yet."""
    out, left, right = [], 0, len(dfs) - 1
    while left <= right:
        out.append(dfs[left])
        left += 1
        if left <= right:
            out.append(dfs[right])
            right -= 1
    return out


def shared_tokens(prompts: Sequence[Sequence[int]], order: Sequence[int], window: int) -> int:
    """Prompt tokens served from cache when `order` runs on one engine whose cache holds the
    prompts of `window` requests, least recently used out first (a hit uses its entry again).
    A deliberately small cache, about what is in flight: any order shares everything in a
    cache that holds the whole batch."""
    recent: list[int] = []  # least recently used first
    saved = 0
    for i in order:
        best = max(recent, key=lambda j: _common(prompts[j], prompts[i]), default=None)
        if best is not None and _common(prompts[best], prompts[i]):
            saved += _common(prompts[best], prompts[i])
            recent.remove(best)
            recent.append(best)
        recent = [*recent, i][-window:]
    return saved


def sharing_ratio(prompts: Sequence[Sequence[int]], ordering: Ordering,
                  order: Sequence[int] | None = None, window: int = 4) -> float:
    """The prefix sharing of `order` (default: `ordering.order`) against the DFS optimum (1.0
    when nothing can be shared), with a cache of `window` prompts (see `shared_tokens`)."""
    if ordering.shareable_tokens == 0:
        return 1.0
    order = ordering.order if order is None else order
    return shared_tokens(prompts, order, window) / ordering.shareable_tokens
