"""The transfer backends by name: `make_backend` (the receiving side) and `open_peer` (the
sending side). The backends import lazily, so loading this costs only the interface."""

from __future__ import annotations

import torch

from kvcache.transfer.auth import TransferAuthError, verify
from kvcache.transfer.base import KVLayout, NoTransferBackend, Peer, TransferBackend, TransferError

BACKEND_KINDS = ("shm", "tcp", "cuda_ipc", "nvshmem", "none")


def make_backend(
    kind: str,
    layout: KVLayout,
    num_pages: int,
    device: torch.device | str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    key: bytes | None = None,
    nvshmem_group: str | None = None,
) -> TransferBackend:
    """The receiving side of `--kv-transfer kind`, owning a zeroed pool of `num_pages` pages on
    `device` (nvshmem: at most that many, see NvshmemBackend). `host`, `port` and
    `advertise_host` configure the tcp listener (port 0: any free port). `key` is the
    deployment's transfer key (kvcache.transfer.auth): the backends sign their descriptor
    with it and tcp admits only senders that hold it. `nvshmem_group` is this engine's place in
    its NVSHMEM group (kvcache.transfer.nvshmem_group, `RANK/SIZE@DIR`). Raises ValueError for an
    unknown kind, a pool on the wrong device, no key, or nvshmem without a group."""
    if kind in ("shm", "tcp", "cuda_ipc", "nvshmem") and key is None:
        raise ValueError(f"--kv-transfer {kind} needs an engine key (--api-key, shared by the "
                         "deployment's engines; microserve up makes one): without it anyone "
                         "could write into this engine's KV pool")
    if kind == "shm":
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"--kv-transfer shm needs the KV pool in CPU memory, not on {device}; use tcp"
            )
        from kvcache.transfer.shm import ShmBackend

        return ShmBackend(layout, num_pages, key=key)
    if kind == "tcp":
        from kvcache.transfer.tcp import TcpBackend

        return TcpBackend(layout, num_pages, device, host, port, advertise_host, key=key)
    if kind == "cuda_ipc":
        from kvcache.transfer.cuda_ipc import CudaIpcBackend

        return CudaIpcBackend(layout, num_pages, device, key=key)
    if kind == "nvshmem":
        from kvcache.transfer.nvshmem_group import check_member

        group = check_member(str(device), nvshmem_group)  # before nvshmem4py is imported
        from kvcache.transfer.nvshmem import NvshmemBackend

        return NvshmemBackend(layout, num_pages, device, key=key, group=group)
    if kind == "none":
        return NoTransferBackend(layout, num_pages, device)
    raise ValueError(f"unknown --kv-transfer {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")


def open_peer(descriptor: dict, local_kv: torch.Tensor, layout: KVLayout,
              key: bytes | None, local_ranks: list[torch.Tensor] | None = None) -> Peer:
    """Open the receiver `descriptor` names for writing from `local_kv` (this engine's pool;
    a tensor-parallel engine's ranks' pools are `local_ranks`, rank 0's first). The caller has
    checked that the layouts agree (KVLayout.mismatch). Nothing is opened, mapped or dialed
    unless the descriptor is signed with `key` (auth.verify). Raises TransferError if
    the descriptor is not signed, or the receiver cannot take KV or cannot be reached."""
    if descriptor.get("kind") == "none":
        raise TransferError("the receiving engine was started with --kv-transfer none")
    try:
        descriptor = verify(descriptor, key)
    except TransferAuthError as e:
        raise TransferError(str(e)) from None
    kind = descriptor.get("kind")
    if kind == "tcp":  # the frames carry every head: each side gathers or splits its own ranks
        from kvcache.transfer.tcp import TcpPeer

        return TcpPeer(descriptor, local_kv, layout, key, local_ranks=local_ranks)
    if descriptor.get("tp_size", 1) > 1 or len(local_ranks or ()) > 1:
        from kvcache.transfer.tp_peer import open_split_peer

        return open_split_peer(descriptor, local_ranks or [local_kv], layout)
    if kind == "shm":
        from kvcache.transfer.shm import ShmPeer

        return ShmPeer(descriptor, local_kv, layout)
    if kind == "cuda_ipc":
        from kvcache.transfer.cuda_ipc import CudaIpcPeer

        return CudaIpcPeer(descriptor, local_kv, layout)
    if kind == "nvshmem":
        from kvcache.transfer.nvshmem import NvshmemPeer

        return NvshmemPeer(descriptor, local_kv, layout)
    raise TransferError(f"unknown transfer kind {kind!r} in the receiver's descriptor")
