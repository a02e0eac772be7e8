"""CUDA IPC transfer for GPU engines on one host: the sender writes the receiver's GPU pool.

The receiver's pool is one CUDA allocation, exported once at start-up through PyTorch's CUDA
IPC sharing (`UntypedStorage._share_cuda_`: a `cudaIpcGetMemHandle` of the allocation plus the
pool's offset in it, which PyTorch's caching allocator makes necessary). A sender that starts at
any later time opens it (`_new_shared_cuda`, about 1.5 ms for a 4 GiB pool on an H100) and
copies layer slices straight into it, on the GPU. It works between two engines sharing one GPU
and between GPUs of one host that both processes can see (`--device cuda:N`, not disjoint
`CUDA_VISIBLE_DEVICES`) and that can address each other's memory (NVLink, or PCIe with P2P).

Across GPUs the receiver's pool is opened in the *sender's* device context, with peer access
enabled (`cudaIpcMemLazyEnablePeerAccess`): the page-copy kernel then runs on the sender's GPU
and transfer stream and stores across NVLink, as the nvshmem peer does; the receiver's GPU runs
nothing for it. (The first cross-GPU version launched torch `index_select` / `.to()` /
`index_copy_` from P's process on D's GPU and synchronized there: while D decoded, 27 sends of
3,000 tokens finished in 4 s against 275 with nvshmem, 2xH100, 2026-11-26.)

Windows work as for shm (kvcache/transfer/shm.py, whose machinery this reuses): the window
table lives in a small memfd the sender maps; the sender holds a shared lock on its window's
entry from before its copy is queued until it has finished on the GPU (the transfer thread
waits for each step's copy, and at flush), so `close_window` (an exclusive lock) returns only
when no write into the window can still land, at most a step's copy later. The sender hands
this peer a step's KV once, all layers in one kernel after the step's last layer
(`whole_steps`): it runs while the next step computes.

Why PyTorch's legacy IPC and not a `cuMemCreate` allocation exported as a file descriptor: it
needs no extra channel (a descriptor passed over a Unix socket), no driver bindings beyond
PyTorch, and was measured working between independent processes on the lent GPUs. Its limit:
the exporter's memory is undefined once it exits, so a sender checks the receiver's pidfd
whenever it takes a window's lock (each step's first write, as shm does for every write) and a
dead receiver fails the send rather than being written.
A pool that must outlive its engine, or join an NVSHMEM group later, needs the fd export.
"""

from __future__ import annotations

import os

import torch

from kvcache.transfer.base import KVLayout, TransferError, Window
from kvcache.transfer.page_copy import copy_rows
from kvcache.transfer.shm import DEFAULT_NUM_WINDOWS, ShmBackend, ShmPeer


def _can_access_peer(device: int, peer: int) -> bool:
    return torch.cuda.can_device_access_peer(device, peer)


def _hex(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


def ipc_export(kv: torch.Tensor) -> dict:
    """What a same-host process needs to map the GPU tensor `kv` (plain data)."""
    (dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = kv.untyped_storage()._share_cuda_()
    return {
        "cuda_device": int(dev), "ipc_handle": _hex(handle),
        "storage_bytes": int(size_bytes), "storage_offset_bytes": int(offset_bytes),
        "ref_counter": _hex(ref_handle), "ref_counter_offset": int(ref_offset),
        "event_handle": _hex(event_handle), "event_sync": bool(event_sync),
        "tensor_offset": int(kv.storage_offset()),
    }


def _copy_programs(text: str) -> int:
    """MICROSERVE_KV_COPY_PROGRAMS's value: a grid of 1 to 4,096 programs, or an error that
    names it at import (the engine's start), not at its first send."""
    try:
        programs = int(text)
    except ValueError:
        programs = 0
    if not 1 <= programs <= 4096:
        raise ValueError(f"MICROSERVE_KV_COPY_PROGRAMS={text!r}: a whole number of copy "
                         "kernel programs from 1 to 4096 (default 132)")
    return programs


class CudaIpcBackend(ShmBackend):
    """A receiver's pool on `device`, exported to same-host senders by CUDA IPC."""

    kind = "cuda_ipc"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str,
                 num_windows: int = DEFAULT_NUM_WINDOWS, *, key: bytes):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"--kv-transfer cuda_ipc needs the KV pool on a CUDA device, not "
                             f"{device}; use shm or tcp")
        dtype = getattr(torch, layout.dtype)
        self.kv = torch.zeros(layout.pool_shape(num_pages), dtype=dtype, device=device)
        export = ipc_export(self.kv)
        super().__init__(layout, num_pages, num_windows, key=key, extra=export)


class CudaIpcPeer(ShmPeer):
    """A same-host receiver's GPU pool, opened through CUDA IPC, and its window table."""

    kind = "cuda_ipc"
    whole_steps = True
    # The copy kernel's grid and rows per program at once. `bench.kv_copy --beside-forward`
    # (H100, 2026-11-24, three runs): beside the sender's own 512- and 2,048-token prefill
    # steps, 132 x 8 moved a step's KV at 480-513 / 879-1,036 GB/s, 132 x 4 at 460-520 /
    # 798-899, neither slowing the pass outside the +-1% noise; alone 0.9-1.9 TB/s vs 0.8-1.3.
    # MICROSERVE_KV_COPY_PROGRAMS (a diagnosis, `bench.transfer --modes tpot`): another grid,
    # to see how a receiver's decode steps follow the rate the copies land at.
    num_programs = _copy_programs(os.environ.get("MICROSERVE_KV_COPY_PROGRAMS", "132"))
    rows_at_once = 8
    _stream: torch.cuda.Stream | None = None
    _held: Window | None = None  # the window whose entry this peer holds locked, copies queued

    def _open_pool(self, descriptor: dict, shape: tuple[int, ...],
                   dtype: torch.dtype) -> torch.Tensor:
        if not self._local.is_cuda:
            raise TransferError("cuda_ipc needs the sender's KV pool on a GPU too; the "
                                "receiver would take tcp")
        here, there = self._local.device.index, descriptor["cuda_device"]
        if here == there:
            return self._import(descriptor, here, shape, dtype)
        # Another GPU of this host: map its pool into this GPU's context (the handle is
        # opened with peer access enabled, cudaIpcMemLazyEnablePeerAccess), so the copy
        # kernel runs here, on the sender's stream, and stores across NVLink as the nvshmem
        # peer does. Nothing runs on the receiver's GPU and no context is made there.
        try:
            return self._import(descriptor, here, shape, dtype)
        except TransferError as e:
            if not _can_access_peer(here, there):
                raise TransferError(f"cuda_ipc: GPU {here} cannot address GPU {there}'s memory "
                                    f"(no peer access between them); use --kv-transfer tcp "
                                    f"between these engines") from None
            raise e

    @staticmethod
    def _import(descriptor: dict, device: int, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
        """The receiver's pool mapped into `device`'s context."""
        unhex = bytes.fromhex
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                device, unhex(descriptor["ipc_handle"]),
                descriptor["storage_bytes"], descriptor["storage_offset_bytes"],
                unhex(descriptor["ref_counter"]), descriptor["ref_counter_offset"],
                unhex(descriptor["event_handle"]) if descriptor["event_handle"] else None,
                descriptor["event_sync"])
        except RuntimeError as e:
            raise TransferError(f"cannot open the GPU KV pool of receiver pid "
                                f"{descriptor['pid']} (GPU {descriptor['cuda_device']}) by CUDA "
                                f"IPC from GPU {device}: {e}") from None
        pool = torch.empty(0, dtype=dtype, device=storage.device)
        pool.set_(storage, descriptor["tensor_offset"], shape)
        return pool

    def write(self, window: Window, layer: int, src_slots: torch.Tensor,
              dst_slots: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        self.write_layers(window, range(layer, layer + 1), src_slots, dst_slots, ready)

    def write_layers(self, window: Window, layers: range, src_slots: torch.Tensor,
                     dst_slots: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
        """Queue the copy of `layers` as one kernel on this engine's GPU (the receiver's pool is
        mapped here, whichever GPU holds it) on a transfer stream of this peer's that waits only for `ready` (the KV written), so
        the sender's next work computes meanwhile. The window's entry stays locked while
        copies are queued; once the last layer is queued (a step's end) this waits for them
        and lets go, so the receiver can close the window between steps."""
        device = self._local.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if self._held != window:
            self._drain()
            self._lock_window(window)
            self._held = window
        first, end = layers.start, layers.stop
        try:
            # This runs on the sender's transfer thread, whose current device is not the
            # engine's.
            with torch.cuda.device(device), torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                else:  # a direct caller: whatever the default stream wrote before
                    self._stream.wait_stream(torch.cuda.default_stream(device))
                self._copy(first, end, src_slots.to(device), dst_slots.to(device))
        except BaseException:
            self._drain()
            raise
        if end == self._remote.shape[0]:
            self._drain()

    def _copy(self, first: int, end: int, src_slots: torch.Tensor,
              dst_slots: torch.Tensor) -> None:
        """Queue the copy of layers [first, end) on the current stream."""
        copy_rows(self._local[first:end], self._remote[first:end], src_slots, dst_slots,
                  self.num_programs, self.rows_at_once)

    def flush(self, window: Window) -> None:
        """Wait for the queued copies, then check the receiver is alive and the window open."""
        self._drain()
        super().flush(window)

    def close(self) -> None:
        if self._remote is not None:
            self._drain()
        super().close()

    def _drain(self) -> None:
        """Wait for the queued copies, then unlock the held window's entry."""
        if self._held is None:
            return
        held, self._held = self._held, None
        try:
            self._stream.synchronize()
        finally:
            self._unlock_window(held)
