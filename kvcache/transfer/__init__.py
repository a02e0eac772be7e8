"""KV transfer between engines: pick a backend by name, open a peer from its descriptor.

The backends import lazily, so importing this package costs only the interface.
"""

from __future__ import annotations

import torch

from kvcache.transfer.base import (
    KVLayout,
    NoTransferBackend,
    Peer,
    TransferBackend,
    TransferError,
    Window,
)

BACKEND_KINDS = ("shm", "tcp", "none")

__all__ = [
    "BACKEND_KINDS",
    "KVLayout",
    "NoTransferBackend",
    "Peer",
    "TransferBackend",
    "TransferError",
    "Window",
    "make_backend",
    "open_peer",
]


def make_backend(
    kind: str,
    layout: KVLayout,
    num_pages: int,
    device: torch.device | str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
) -> TransferBackend:
    """The receiving side of `--kv-transfer kind`, owning a zeroed pool of `num_pages` pages on
    `device`. `host`, `port` and `advertise_host` configure the tcp listener (port 0: any free
    port). Raises ValueError for an unknown kind or shm with a pool outside CPU memory."""
    if kind == "shm":
        if torch.device(device).type != "cpu":
            raise ValueError(
                f"--kv-transfer shm needs the KV pool in CPU memory, not on {device}; use tcp"
            )
        from kvcache.transfer.shm import ShmBackend

        return ShmBackend(layout, num_pages)
    if kind == "tcp":
        from kvcache.transfer.tcp import TcpBackend

        return TcpBackend(layout, num_pages, device, host, port, advertise_host)
    if kind == "none":
        return NoTransferBackend(layout, num_pages, device)
    raise ValueError(f"unknown --kv-transfer {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")


def open_peer(descriptor: dict, local_kv: torch.Tensor, layout: KVLayout) -> Peer:
    """Open the receiver `descriptor` names for writing from `local_kv` (this engine's pool).
    The caller has checked that both engines share `layout`. Raises TransferError if the
    receiver cannot take KV or cannot be reached."""
    kind = descriptor.get("kind")
    if kind == "shm":
        from kvcache.transfer.shm import ShmPeer

        return ShmPeer(descriptor, local_kv, layout)
    if kind == "tcp":
        from kvcache.transfer.tcp import TcpPeer

        return TcpPeer(descriptor, local_kv, layout)
    if kind == "none":
        raise TransferError("the receiving engine was started with --kv-transfer none")
    raise TransferError(f"unknown transfer kind {kind!r} in the receiver's descriptor")
