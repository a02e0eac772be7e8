"""The transfer interface: one-sided writes of KV into another engine's pool (docs/microserving.md,
"KV transfer").

A receiver exports its pool and hands out write *windows*; a sender opens the receiver as a
peer from its descriptor and writes layer slices into it while its own forward pass continues:

    receiver (engine D)                          sender (engine P)
    ───────────────────                          ─────────────────
    backend = make_backend(kind, layout, ...)
    backend.descriptor()  ──── kv_addr ────────▶ peer = open_peer(descriptor, local_kv, layout)
    w = backend.open_window(slots) ─ kv_addr ──▶ peer.write(w, layer, src_slots, dst_slots)
                                                 ... one call per layer, on the transfer stream
                                                 peer.seal(w, digest): what the KV is of
                                                 peer.flush(w): every byte is in D's pool
    backend.renewed_at(w)  ◀── renew ─────────── peer.renew(w): every RENEW_INTERVAL_S while
                                                 the sender holds the job (queued or computing)
    backend.close_window(w) -> digest   (adopted, aborted or lease expired: later writes are
                                         refused; the seal tells what was written)

Renewals are what a receiver's lease means (engine/kv_exchange.py): a reservation lives as long
as its sender keeps renewing it, and expires `lease_s` after the last sign of life, so a sender
that queues the job for minutes keeps it, and one that died loses it within `lease_s`.

Slots are flat: slot = page * page_size + offset, so `kv[layer, kv_index].view(-1, heads, dim)`
is indexed by slot. A window is the receiver's promise that the slots it reserved for one
request stay reserved while the window is open; `close_window` returns only when no write into
the window is in progress, so pages freed after it can be reused safely.

Writes stay inside their window: the sender's KVSender refuses a destination outside the slots
the receiver signed for the window (engine/kv_sender.py checks the signature), and a receiver
that applies writes itself (tcp) also refuses any slot outside those it opened the window with.
A sender seals the window at the end with the digest of the tokens its KV was computed for
(kvcache/transfer/auth.kv_digest); `close_window` hands the seal back, and the receiver
adopts the KV only if it is the digest it reserved the window for.

Backends: `shm` (kvcache/transfer/shm.py: same host, the sender maps the receiver's pool and
writes it; no receiver work on the data path) and `tcp` (kvcache/transfer/tcp.py: any two hosts;
the receiver's listener thread writes what arrives). GPU backends (`cuda_ipc`, `nvshmem`) fit the
same shape: the descriptor is an IPC handle or a PE number, `write` launches one copy kernel per
layer on a transfer stream, `flush` waits for it and fences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from microserve.messages import KVLayout  # the plain description, shared with the router
from kvcache.transfer.auth import new_window_tag

# How often a sender renews the windows of the jobs it holds. A receiver's lease should be a
# few of these at least (the default is seconds).
RENEW_INTERVAL_S = 0.25


def copyable(kv: torch.Tensor) -> torch.Tensor:
    """`kv` as a tensor torch can index and copy rows of on every device: a float8 pool's
    bytes as uint8 (the same shape, one byte an element; torch has no CPU `index_copy_` for
    float8), any other pool as it is. Transfers move bytes, never values."""
    return kv.view(torch.uint8) if kv.dtype == torch.float8_e4m3fn else kv


def slot_tensor(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The flat slots of run-length `ranges` [(first slot, count), ...] as an int64 CPU tensor,
    built without a Python int per slot (a 5,000-token send names 5,000 slots). In numpy:
    torch's CPU `repeat_interleave` took ~1.4 ms a call inside the engine on the H100's host
    (py-spy, 2026-11-24; why was not isolated), where numpy's `repeat` takes microseconds."""
    if not ranges:
        return torch.empty(0, dtype=torch.long)
    runs = np.asarray(ranges, dtype=np.int64)
    starts, counts = runs[:, 0], runs[:, 1]
    index_of_first = np.cumsum(counts) - counts  # where each run starts in the output
    slots = np.repeat(starts - index_of_first, counts) + np.arange(int(counts.sum()))
    return torch.from_numpy(slots)


def window_slots(slots: torch.Tensor) -> np.ndarray:
    """A window's slots as `slots_outside` takes them: sorted int64, on the host."""
    return np.sort(slots.cpu().numpy().astype(np.int64))


def slots_outside(slots: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The entries of `slots` not in `allowed` (`window_slots`): none for a write inside its
    window. A binary search per slot, once per step's send (~20 us for 2,048 slots)."""
    if not len(allowed):
        return slots
    at = np.minimum(np.searchsorted(allowed, slots), len(allowed) - 1)
    return slots[allowed[at] != slots]


class TransferError(Exception):
    """A write or flush could not complete: the receiver is gone, the connection broke, or the
    receiver closed the window (the request was aborted or its lease expired there)."""


@dataclass(frozen=True)
class Window:
    """A receiver-side write window: `index` names its entry in the receiver's window table,
    `tag` is the window's secret: random (auth.new_window_tag), so it also tells this window
    from earlier ones at the same index, and only whoever got the prep_recv answer can write."""

    index: int
    tag: int


class WindowIds:
    """Hands out window indices (lowest free first) with fresh random tags, for a receiver's
    table of `num_windows` entries. Not thread-safe: the backend's lock guards it."""

    def __init__(self, num_windows: int):
        self.num_windows = num_windows
        self._free = list(range(num_windows - 1, -1, -1))  # stack; pop() gives the lowest index

    def take(self) -> Window | None:
        """A fresh window, or None when every index is in use."""
        if not self._free:
            return None
        return Window(self._free.pop(), new_window_tag())

    def release(self, index: int) -> None:
        self._free.append(index)

    def clear(self) -> None:
        """Hand out nothing more (the backend is closed)."""
        self._free.clear()

    def check(self, window: Window) -> None:
        if not 0 <= window.index < self.num_windows:
            raise ValueError(
                f"window index {window.index} out of range for {self.num_windows} windows"
            )


class TransferBackend(ABC):
    """The receiving side of one engine: its KV pool and the windows writes may land in.

    Owns the pool tensor (`kv`, shape `layout.pool_shape(num_pages)`), because some backends
    must allocate it themselves (shared memory, the NVSHMEM symmetric heap).
    """

    kind: ClassVar[str]
    kv: torch.Tensor

    @abstractmethod
    def descriptor(self) -> dict:
        """Plain data (msgpack/JSON-safe) a peer needs to open this pool. Has "kind"."""

    @abstractmethod
    def open_window(self, slots: torch.Tensor | None = None) -> Window | None:
        """A fresh window, or None when the window table is full (the caller answers 503).
        `slots` (int64, CPU): the flat slots reserved for it; a backend that applies writes
        itself refuses any other. None: any slot of the pool (backend tests; the engine
        always names them)."""

    @abstractmethod
    def close_window(self, window: Window) -> bytes | None:
        """Refuse later writes into `window`. Returns once no write into it is in progress,
        so the caller may then free or reuse the window's pages. Closing twice is a no-op.

        Returns the seal a sender left with `Peer.seal` (the digest of the tokens the written
        KV is of), or None if none did, or the window was closed already."""

    def renewed_at(self, window: Window) -> float | None:
        """When a sender last renewed `window` (`time.monotonic()` of this host), or None if it
        has not since the window opened (or the window is closed). Cheap: the receiver asks it
        only when a lease is due."""
        return None

    def add_ranks(self, fields: dict, pools: list[torch.Tensor]) -> None:
        """Give the backend a tensor-parallel engine's other ranks (kvcache/transfer/tp_peer.py):
        `fields` for the descriptor, where senders write every rank's pool themselves (shm,
        cuda_ipc), and every rank's pool mapped in this process, rank 0's first, where the
        receiver writes them (tcp). nvshmem cannot carry them."""
        raise TransferError(f"--kv-transfer {self.kind} cannot reach a tensor-parallel "
                            "engine's other ranks; use shm, cuda_ipc or tcp")

    def close(self) -> None:
        """Stop listeners and release the pool's export. The tensor stays valid."""


class Peer(ABC):
    """The sending side's handle on one receiver. Methods run on the sender's transfer thread
    (or stream), never concurrently with each other."""

    @abstractmethod
    def write(
        self, window: Window, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
        ready: "torch.cuda.Event | None" = None,
    ) -> None:
        """Copy K and V of `layer` at the local flat slots `src_slots` into the receiver's flat
        slots `dst_slots` (int64 tensors of equal length). May return before the bytes arrive.
        `ready` (GPU pools): the source KV is written once this event fires; a peer that copies
        on the default stream may ignore it (its work queues behind the writes anyway).
        Raises TransferError if the receiver is gone or `window` was closed."""

    # Whether the sender should hand this peer a step's KV once, after the step's last layer
    # (`write_layers` over all layers), instead of layer by layer: right for a peer whose
    # write only queues GPU work, whose per-call host cost would exceed the copy's GPU time.
    whole_steps = False

    def write_layers(
        self, window: Window, layers: range, src_slots: torch.Tensor, dst_slots: torch.Tensor,
        ready: "torch.cuda.Event | None" = None,
    ) -> None:
        """`write` for each of `layers` (a peer may do them at once)."""
        for layer in layers:
            self.write(window, layer, src_slots, dst_slots, ready)

    @abstractmethod
    def seal(self, window: Window, digest: bytes) -> None:
        """Leave `digest` (auth.kv_digest of the tokens the KV was computed for) in
        `window`, behind every write into it so far: the receiver's `close_window` returns it.
        Called once, after the job's last write and before its flush; the flush returns only
        once the receiver has it. Raises TransferError as `write` does."""

    @abstractmethod
    def flush(self, window: Window) -> None:
        """Return once every write into `window` so far is in the receiver's pool and visible
        to it, and the window is still open; raise TransferError otherwise."""

    def renew(self, window: Window) -> None:
        """Tell the receiver this sender still holds the job that writes `window`, so its lease
        is renewed (see `TransferBackend.renewed_at`). Runs on the sender's renewal thread,
        possibly while a write into the same peer runs on the transfer thread: implementations
        must allow that. Raises TransferError if the receiver is gone or closed the window (the
        sender then stops working for it). The default does nothing: the receiver then keeps
        the reservation `lease_s` from its grant."""

    def alive(self) -> bool:
        """False once the receiver is known to be gone, so every later call would fail. Cheap
        (no round trip) and safe to call from any thread, also while a write runs: the sender
        uses it to drop cached peers, which would otherwise keep a dead receiver's connection
        or memory."""
        return True

    def close(self) -> None:
        """Release the connection or mapping."""


class NoTransferBackend(TransferBackend):
    """An engine that cannot receive KV (started with `--kv-transfer none`): a plain pool."""

    kind = "none"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str):
        dtype = getattr(torch, layout.dtype)
        self.kv = torch.zeros(layout.pool_shape(num_pages), dtype=dtype, device=device)

    def descriptor(self) -> dict:
        return {"kind": self.kind}

    def open_window(self, slots: torch.Tensor | None = None) -> Window | None:
        raise TransferError("this engine was started with --kv-transfer none and cannot receive KV")

    def close_window(self, window: Window) -> bytes | None:
        return None
