"""KV transfer between engines: pick a backend by name, open a peer from its descriptor.

    make_backend(kind, layout, num_pages, device, key=...)   the receiving side
    open_peer(descriptor, local_kv, layout, key)             the sending side of one receiver
    auth           the deployment key: signed descriptors and windows (no torch)
    nvshmem_group  an engine's place in its NVSHMEM group (no torch)

Importing this package costs nothing: the names above load their modules on first use
(`make_backend` and `open_peer` live in kvcache/transfer/backends.py, the interface in base.py,
both with torch), so the router and the engines' frontends, which have no torch, import `auth`
and `nvshmem_group` from here.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "BACKEND_KINDS": "backends", "make_backend": "backends", "open_peer": "backends",
    "KVLayout": "base", "NoTransferBackend": "base", "Peer": "base",
    "TransferBackend": "base", "TransferError": "base", "Window": "base",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"kvcache.transfer.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvcache.transfer' has no attribute {name!r}")
