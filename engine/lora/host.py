"""Host memory for adapters packed for the slots (engine/lora/layers.py): one slab per
registered adapter, cut into pieces of equal size that the adapter's tensors are laid out in.

From pinned memory a slot write is a set of asynchronous copies, so the step loop never waits
for one. Pinning is slow, though: on an H100 host 256 cold pinned allocations for one rank-16
adapter of Llama-3.1-8B's shape (84 MB) took 55 ms, a single 84-MB buffer 45 ms, and while
the driver pins, the step loop's launches wait (the single buffer held a decode step for
82 ms; docs/benchmarks.md, 2026-11-27 night). So slabs are pinned before they are needed:
one spare at start-up, the next by the loader thread once a load has taken the spare (piece by
piece, pausing between pieces: pinned back to back, the 23 pieces of a spare held one decode
step for 62 ms on an H100, 2026-11-28), and an unloaded adapter's slab is kept for the next
load.
"""

from __future__ import annotations

import threading
import time

import torch

_ALIGN = 64  # bytes: every tensor starts on a cache line


class Layout:
    """Where each packed tensor sits in a slab: `place(nbytes)` in the order they are packed
    gives (piece, offset); pieces are `piece_bytes` long (a power of two, as torch's pinned
    allocator rounds to, and at least the largest tensor)."""

    PIECE_BYTES = 4 << 20  # pinned a piece at a time: the driver is held ~9 ms for each (H100)

    def __init__(self, sizes: list[int], piece_bytes: int = PIECE_BYTES):
        largest = max(sizes, default=0)
        self.piece_bytes = max(piece_bytes, 1 << (largest - 1).bit_length() if largest else 0)
        self.places: list[tuple[int, int]] = []
        piece, offset = 0, 0
        for nbytes in sizes:
            if offset + nbytes > self.piece_bytes:
                piece, offset = piece + 1, 0
            self.places.append((piece, offset))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.pieces = piece + 1 if sizes else 0


class Slabs:
    """Slabs of `layout` (lists of uint8 tensors), pinned if `pin`, kept for reuse.

    `take` returns a free slab (allocating one if none is free); `give` returns one whose
    last asynchronous copy is `done` (an event, or None); `reserve` allocates until `spare`
    slabs are free, pausing `pause_s` after each pinned piece (a background thread's: the
    driver, and the GIL, go back to the step loop between pieces). Any thread may call
    them."""

    PAUSE_S = 0.004  # after each piece `reserve` pins: about a decode step's launches

    def __init__(self, layout: Layout, pin: bool, keep: int = 2):
        self.layout, self.pin, self.keep = layout, pin, keep
        self._free: list[tuple[list[torch.Tensor], torch.cuda.Event | None]] = []
        self._lock = threading.Lock()
        self.allocated = 0  # slabs allocated so far

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> list[torch.Tensor]:
        with self._lock:
            slab, done = self._free.pop() if self._free else (None, None)
        if slab is None:
            return self._allocate()
        if done is not None:  # a slot write from it may still be copying
            done.synchronize()
        return slab

    def give(self, slab: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append((slab, done))

    def reserve(self, spare: int = 1, pause_s: float = PAUSE_S) -> None:
        while True:
            with self._lock:
                if len(self._free) >= spare:
                    return
            slab = self._allocate(pause_s)
            with self._lock:
                self._free.append((slab, None))

    def _allocate(self, pause_s: float = 0.0) -> list[torch.Tensor]:
        slab = []
        for _ in range(self.layout.pieces):
            slab.append(torch.empty(self.layout.piece_bytes, dtype=torch.uint8,
                                    pin_memory=self.pin))
            if pause_s and self.pin:
                time.sleep(pause_s)
        with self._lock:
            self.allocated += 1
        return slab
