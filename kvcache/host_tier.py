"""The host KV tier's bookkeeping: which host pages hold which sequence's swapped-out KV, and
whether to swap a preempted sequence out at all or recompute it. Plain Python (no torch): the
pinned buffer and the copies are a later transfer backend's; this is what they are checked
against.

A swapped sequence's life on the host (issue 40, item 2, groundwork):

    reserve ──▶ COPYING_OUT ──copied_out──▶ HELD ──start_in──▶ COPYING_IN ──copied_in──▶ (gone)
       │             │                        │                     │
       └─────────────┴──── release (abort, expiry, or the copy failed): pages freed ──────┘

Host pages come from a PagePool of their own (ids and refcounts, a deterministic LIFO), so a
page is held by exactly one swapped sequence, or by the prefix cache (its second level,
kvcache/prefix_host.py); `check_integrity` proves free + held == total. Swapped sequences come
first: a swap-out short of pages drops cached prefix pages to make room (`reclaim`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvcache.integrity import IntegrityError
from kvcache.page_pool import PagePool


class HostState(enum.Enum):
    COPYING_OUT = "copying_out"  # GPU -> host copy in flight: the GPU pages are still held
    HELD = "held"  # on the host only; the sequence waits to run
    COPYING_IN = "copying_in"  # host -> GPU copy in flight (prefetch or on admission)


@dataclass
class Swapped:
    """One sequence's KV on the host (written by HostTier only)."""

    pages: list[int]  # host page ids, in the order of the sequence's GPU page table
    num_tokens: int  # KV positions they hold
    state: HostState = HostState.COPYING_OUT


class HostTier:
    """Host pages by sequence. Running out of host pages is an expected result (`reserve`
    answers None: the caller recomputes instead); a move out of order is a ValueError."""

    def __init__(self, num_pages: int, page_size: int):
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self._swapped: dict[str, Swapped] = {}
        # set by the prefix cache sharing the pool (KVCacheManager.attach_host's caller):
        # drops at least n of its host pages, least recently used first; returns how many
        self.reclaim: Callable[[int], int] | None = None

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def state(self, seq_id: str) -> HostState | None:
        entry = self._swapped.get(seq_id)
        return None if entry is None else entry.state

    def pages(self, seq_id: str) -> list[int]:
        return list(self._swapped[seq_id].pages)

    def num_tokens(self, seq_id: str) -> int:
        return self._swapped[seq_id].num_tokens

    def seq_ids(self) -> set[str]:
        return set(self._swapped)

    def reserve(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Host pages for `num_tokens` of KV of `seq_id`, which starts COPYING_OUT. None,
        taking nothing, if too few are free."""
        if seq_id in self._swapped:
            raise ValueError(f"sequence {seq_id!r} already has host pages")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        need = -(-num_tokens // self.page_size)
        if need > self.pool.num_free and self.reclaim is not None:
            self.reclaim(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:
            return None
        self._swapped[seq_id] = Swapped(pages, num_tokens)
        return list(pages)

    def copied_out(self, seq_id: str) -> None:
        """The copy to the host landed: the GPU pages may be freed."""
        self._move(seq_id, HostState.COPYING_OUT, HostState.HELD)

    def start_in(self, seq_id: str) -> list[int]:
        """A copy back to the GPU begins (prefetch, or admission). Returns the host pages."""
        return self._move(seq_id, HostState.HELD, HostState.COPYING_IN).pages

    def copied_in(self, seq_id: str) -> int:
        """The copy back landed: the host pages are freed. Returns the tokens restored."""
        entry = self._expect(seq_id, HostState.COPYING_IN)
        self.release(seq_id)
        return entry.num_tokens

    def release(self, seq_id: str) -> int:
        """Free a sequence's host pages, in any state (abort, expiry, a failed copy; the
        caller first waits out a copy in flight). Returns how many; 0 if it held none."""
        entry = self._swapped.pop(seq_id, None)
        if entry is None:
            return 0
        self.pool.release(entry.pages)
        return len(entry.pages)

    def _expect(self, seq_id: str, expected: HostState) -> Swapped:
        entry = self._swapped.get(seq_id)
        if entry is None or entry.state is not expected:
            now = "not on the host" if entry is None else entry.state.value
            raise ValueError(f"sequence {seq_id!r} is {now}, not {expected.value}")
        return entry

    def _move(self, seq_id: str, expected: HostState, to: HostState) -> Swapped:
        entry = self._expect(seq_id, expected)
        entry.state = to
        return entry

    def check_integrity(self, cached_pages: Iterable[int] = ()) -> None:
        """Every host page is free, or held once by exactly one swapped sequence or by the
        prefix cache (`cached_pages`, its host pages), and each sequence holds as many pages
        as its tokens need."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_pages
        for p in cached_pages:
            holders[p] += 1
        for seq_id, entry in self._swapped.items():
            if len(entry.pages) != -(-entry.num_tokens // self.page_size):
                raise IntegrityError(f"{seq_id}: {len(entry.pages)} host pages for "
                                     f"{entry.num_tokens} tokens")
            for p in entry.pages:
                holders[p] += 1
        for p, n in enumerate(holders):
            if self.pool.refcount(p) != n:
                raise IntegrityError(f"host page {p}: refcount {self.pool.refcount(p)} != {n}")


def swap_or_recompute(num_tokens: int, recompute_tokens: int, bytes_per_token: int,
                      copy_bytes_per_s: float, prefill_s, copy_out_overlapped: bool = True
                      ) -> str:
    """Whether a preempted sequence's KV should go to the host ("swap") or be dropped and
    recomputed later ("recompute"), by which costs its next admission less time.

    Args:
        num_tokens: KV positions it holds (what a swap copies each way).
        recompute_tokens: what recomputing would compute: its tokens less the whole pages the
            prefix cache would still hold for it.
        bytes_per_token: KV bytes of one position across layers (2 x layers x kv heads x
            head_dim x element size).
        copy_bytes_per_s: the measured host <-> device copy rate, one way.
        prefill_s: predicted seconds of a step computing n tokens (PrefillProfile.predict).
        copy_out_overlapped: the copy out runs beside compute (its own stream, proactive), so
            only the copy back is on the sequence's path; else both are.

    Ties go to recompute (it holds no host memory).
    """
    if recompute_tokens <= 0:
        return "recompute"  # all of it is cached: nothing to save
    copies = 1 if copy_out_overlapped else 2
    swap_s = copies * num_tokens * bytes_per_token / copy_bytes_per_s
    return "swap" if swap_s < prefill_s(recompute_tokens) else "recompute"
