"""KV transfer to and from tensor-parallel engines: each rank's pool holds its share of the KV
heads, and a copy moves each head from a rank of the sender that holds it to every rank of
the receiver that holds it, so engines of any two tensor-parallel sizes exchange KV.

    sender TP 2 (heads 0-3 | 4-7)          receiver TP 1 (heads 0-7)      a gather
    sender TP 1 (heads 0-7)                receiver TP 2 (heads 0-3 | 4-7) a split
    sender TP 2                            receiver TP 2                  rank to rank

How: a tensor-parallel engine's rank 0 process does all its engine's transfer work. Each
worker rank exports its pool when it allocates it (`export_pool`: a memfd on CPU, CUDA IPC on
GPUs) and rank 0 maps it (`open_pool`), so rank 0's KV sender reads every rank's pool, and a
receiver's descriptor lists its other ranks' exports (`rank_fields`), so a sender writes every
rank's pool. Windows, seals and leases stay rank 0's (shm.py, cuda_ipc.py): the slots are the
same on every rank, one page table serves them all. The copy itself is the page-copy kernel
(or torch indexing on CPU) over a head range of each row, per `head_plan` run.

A tensor-parallel sender hands its KV over after the whole step (`PagedKVCache.
send_after_step`): the step's last all-reduce on rank 0's stream is past every rank's KV
writes, where rank 0's own layer being written says nothing of the other ranks'.

On GPUs the copies run on the sender's rank 0 GPU, which reads its other ranks' pools and
writes the receiver's across NVLink: a TP 2 sender's rank 1 share crosses two links.

`tcp` (any two hosts) works otherwise: its frames always carry every KV head of the model in
order (heads.py `whole_layout`), whatever either side's split. A tensor-parallel sender gathers each
frame's rows from its ranks' pools, and a tensor-parallel receiver's connection thread splits
them into its ranks' pools (`TransferBackend.add_ranks` hands it them, mapped in rank 0's
process), so neither side needs the other's split. nvshmem is refused for such engines.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import replace

import torch

from kvcache.transfer.base import KVLayout, TransferError, copyable
from kvcache.transfer.heads import HeadRun, head_plan, heads_view  # noqa: F401 (HeadRun: tests)
from kvcache.transfer.cuda_ipc import CudaIpcPeer, ipc_export
from kvcache.transfer.page_copy import copy_rows
from kvcache.transfer.shm import MEMFD_NAME, ShmPeer

SPLIT_KINDS = ("shm", "cuda_ipc")


# ---- one rank's pool, exported by its process and mapped by rank 0's (and by senders) -------

def export_pool(shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, dict]:
    """A zeroed pool other processes of this host can map, and what they need to (plain data):
    a memfd on CPU (mapped through /proc/PID/fd, as shm maps a receiver's pool), a CUDA IPC
    export on a GPU. The memfd stays open for the life of the process."""
    if device.type == "cuda":
        kv = torch.zeros(shape, dtype=dtype, device=device)
        return kv, {**ipc_export(kv), "pid": os.getpid()}
    nbytes = math.prod(shape) * dtype.itemsize
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)  # out of memory fails here, not as a SIGBUS later
    mapping = mmap.mmap(fd, nbytes)  # never unmapped: the engine uses the pool until it exits
    kv = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)
    return kv, {"pid": os.getpid(), "fd": fd, "inode": os.fstat(fd).st_ino, "nbytes": nbytes}


class MappedPool:
    """Another process's pool (an `export_pool` export) mapped here; `kv` until `close`.
    On a GPU it is mapped into `device`'s context (peer access), where this process's copies
    run."""

    def __init__(self, export: dict, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device):
        self._mapping: mmap.mmap | None = None
        self._fd = -1
        if "ipc_handle" in export:
            if device.type != "cuda":
                raise TransferError("a GPU pool of a tensor-parallel engine can only be "
                                    "written from a GPU; use engines on GPUs on both sides")
            self.kv = CudaIpcPeer._import(export, device.index, shape, dtype)
            return
        self._fd, self._mapping = ShmPeer._map(export)
        self.kv = torch.frombuffer(self._mapping, dtype=dtype,
                                   count=math.prod(shape)).view(shape)

    def close(self) -> None:
        self.kv = None
        if self._mapping is not None:
            self._mapping.close()
            os.close(self._fd)
            self._mapping, self._fd = None, -1


def rank_fields(layout: KVLayout, exports: list[dict]) -> dict:
    """The descriptor fields a tensor-parallel receiver adds (`TransferBackend.add_ranks`):
    its split and its ranks 1..N-1's pool exports (rank 0's pool is the backend's own)."""
    return {"tp_size": layout.tensor_parallel_size, "tp_kv_heads": layout.model_kv_heads,
            "tp_ranks": json.dumps(exports)}


def remote_layout(descriptor: dict, layout: KVLayout) -> KVLayout:
    """The receiver's layout: this engine's, with the receiver's split (its descriptor's)."""
    heads = descriptor.get("tp_kv_heads", layout.model_kv_heads)
    if heads != layout.model_kv_heads:
        raise TransferError(f"the receiver's model has {heads} KV heads, this engine's "
                            f"{layout.model_kv_heads}")
    split = replace(layout, tensor_parallel_size=descriptor.get("tp_size", 1),
                    total_kv_heads=heads)
    return replace(split, num_kv_heads=len(split.rank_heads(0)))


def open_split_peer(descriptor: dict, local_ranks: list[torch.Tensor], layout: KVLayout):
    """A peer for a receiver whose heads are split otherwise than this engine's (`layout`,
    whose ranks' pools are `local_ranks`, rank 0's first). Raises TransferError for a kind
    that cannot carry it."""
    kind = descriptor["kind"]
    if kind not in SPLIT_KINDS:
        raise TransferError(f"KV transfer between tensor-parallel engines goes by shm, "
                            f"cuda_ipc (one host) or tcp, not {kind}")
    remote = remote_layout(descriptor, layout)
    if kind == "shm":
        return SplitShmPeer(descriptor, local_ranks, layout, remote)
    return SplitCudaIpcPeer(descriptor, local_ranks, layout, remote)


class _SplitCopies:
    """What the split peers add to shm's and cuda_ipc's: every rank's pool on both sides, and
    the plan of which heads go where."""

    def __init__(self, descriptor: dict, local_ranks: list[torch.Tensor], layout: KVLayout,
                 remote: KVLayout):
        super().__init__(descriptor, local_ranks[0], layout, remote)
        try:
            self._open_ranks(descriptor, local_ranks, layout, remote)
        except BaseException:
            super().close()
            raise

    def close(self) -> None:
        if self._remote is not None:
            self._drain()  # no copy may still be landing in a pool about to be unmapped
        self._close_ranks()
        super().close()

    def _open_ranks(self, descriptor: dict, local_ranks: list[torch.Tensor],
                    layout: KVLayout, remote: KVLayout) -> None:
        self._locals = [copyable(kv) for kv in local_ranks]
        self._plan = head_plan(layout, remote)
        exports = json.loads(descriptor.get("tp_ranks", "[]"))
        if len(exports) != remote.tensor_parallel_size - 1:
            raise TransferError(f"the receiver's descriptor lists {len(exports)} other ranks' "
                                f"pools for tensor-parallel size {remote.tensor_parallel_size}")
        shape = remote.pool_shape(descriptor["num_pages"])
        dtype = getattr(torch, layout.dtype)
        self._mapped: list[MappedPool] = []
        try:
            for export in exports:
                self._mapped.append(MappedPool(export, shape, dtype, local_ranks[0].device))
        except BaseException:
            self._close_ranks()
            raise
        self._remotes = [self._remote] + [copyable(m.kv) for m in self._mapped]

    def _close_ranks(self) -> None:
        self._remotes = []  # the views first: a mapping with tensors over it cannot close
        for mapped in getattr(self, "_mapped", ()):
            mapped.close()
        self._mapped = []


class SplitShmPeer(_SplitCopies, ShmPeer):
    """shm between CPU engines split differently: torch indexing, head range by head range."""

    def _copy_layer(self, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        for run in self._plan:
            src = heads_view(self._locals[run.src_rank][layer], run.src_heads)
            rows = src.index_select(1, src_slots.to(src.device)).cpu()
            heads_view(self._remotes[run.dst_rank][layer], run.dst_heads).index_copy_(
                1, dst_slots, rows)


class SplitCudaIpcPeer(_SplitCopies, CudaIpcPeer):
    """cuda_ipc between GPU engines split differently: one page-copy kernel per head run, on
    the sender's rank 0 GPU."""

    # The grid stays cuda_ipc's (132 programs): 16, 32 and 64 left more of the GPU and NVLink
    # to the sender's all-reduces but made a 3,000-token remote_send slower, not faster
    # (1.15-1.17x / 1.12-1.15x a local prefill vs 1.12-1.13x, 4x H200, 2026-11-27).

    def _copy(self, first: int, end: int, src_slots: torch.Tensor,
              dst_slots: torch.Tensor) -> None:
        for run in self._plan:
            copy_rows(self._locals[run.src_rank][first:end], self._remotes[run.dst_rank][first:end],
                      src_slots, dst_slots, self.num_programs, self.rows_at_once,
                      run.src_heads, run.dst_heads)

