"""NVSHMEM transfer for the GPU engines of one deployment: every member's KV pool lives in the
NVSHMEM symmetric heap, and a sender of the group writes a receiver's pool through a peer view.

    engine P (PE 0)                                 engine D (PE 1)
    ┌──────────────────────────────┐                ┌──────────────────────────────┐
    │ symmetric heap: KV pool      │                │ symmetric heap: KV pool      │
    │ view = get_peer_tensor(pool, │── Triton copy ─▶ (the same bytes, mapped in P) │
    │        1)                    │  (stores)      │                              │
    └──────────────────────────────┘                └──────────────────────────────┘
    window table: D's memfd, mapped by P (locks, renewals: as for cuda_ipc and shm)

The group is fixed when it starts: `microserve up` hands every engine whose args say
`--kv-transfer nvshmem` its rank, the group's size and a rendezvous directory
(kvcache/transfer/nvshmem_group.py, which also says how the members meet), and they initialize and
allocate identical pools together, at start-up. An engine that is started alone, added later
or restarted cannot join: it fails with an error that says so, and should use `cuda_ipc` or
`tcp`. Only members write members' pools: a sender in no group, or in another group, is
refused with the receiver's group and PE in the message (a receiver's descriptor names both).

Writes go through `get_peer_tensor` (`nvshmem_ptr`: the peer's pool mapped into this process;
`nvshmem.core.put` refuses slices of a tensor, and a page copy is all slices), with the
`cuda_ipc` peer's write path: one Triton page-copy kernel per forward step on a transfer
stream (`CudaIpcPeer.whole_steps`, `write_layers`), the window's entry locked from the launch
until the copy has finished. Completion is the copy kernel's: its writes are plain stores, not
NVSHMEM operations, so `nvshmem_quiet` (which completes this PE's puts) has nothing to wait
for; the transfer stream's synchronize at the step's end and at flush is what makes every byte
visible to the receiver before `remote_send` answers, as for `cuda_ipc`.

What NVSHMEM gives that CUDA IPC does not: one mechanism from two PEs on one GPU to GPUs over
NVLink (and, later, over InfiniBand between hosts), with the copy kernel writing across GPUs
directly. What it costs: the fixed group, and a start-up where each member waits for the others.

Process rules: NVSHMEM initializes once per process, so a process holds one member (`_member`).
It is never finalized: `nvshmem_finalize` waits for every PE, so an engine that stops alone
would hang in it; the driver frees the heap when the process exits. The collective calls
(init, allocation) cannot be interrupted: if the group does not form within the rendezvous
timeout, a watchdog ends the process with an error (a member that died leaves the others
waiting for ever otherwise).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvcache.transfer.base import KVLayout, TransferError
from kvcache.transfer.cuda_ipc import CudaIpcPeer
from kvcache.transfer.shm import DEFAULT_NUM_WINDOWS, ShmBackend
from kvcache.transfer.nvshmem_group import (
    FORM_TIMEOUT_S,
    GroupError,
    GroupSpec,
    Rendezvous,
    group_id,
    nvshmem_env,
)

log = logging.getLogger(__name__)

GROUP_TIMEOUT_EXIT = 3  # the watchdog's exit status


@dataclass(frozen=True)
class Member:
    """This process's place in its NVSHMEM group."""

    group: str  # group_id() of the group's unique id
    pe: int
    npes: int
    pool: torch.Tensor  # this PE's KV pool in the symmetric heap, as allocated


_member: Member | None = None  # set once, by join()


def member() -> Member | None:
    """This process's place in an NVSHMEM group, or None if it joined none."""
    return _member


def _nvshmem():
    """nvshmem.core, imported on first use (CPU machines and most engines do without it)."""
    try:
        import nvshmem.core
    except ImportError as e:
        raise ValueError(f"--kv-transfer nvshmem needs nvshmem4py ({e}): pip install "
                         f"nvshmem4py-cu13 (nvshmem4py-cu12 for CUDA 12), or use --kv-transfer "
                         f"cuda_ipc") from None
    return nvshmem.core


@contextmanager
def _watchdog(what: str, timeout_s: float) -> Iterator[None]:
    """End the process if the block has not finished within `timeout_s`: it runs collective
    NVSHMEM calls that wait for every PE, and cannot be interrupted."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(timeout_s):
            print(f"microserve: {what} did not finish within {timeout_s:g} s: a member of the "
                  f"NVSHMEM group did not join (it failed to start, or exited); exiting",
                  file=sys.stderr, flush=True)
            os._exit(GROUP_TIMEOUT_EXIT)

    threading.Thread(target=watch, name="nvshmem-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def join(spec: GroupSpec, device: torch.device, layout: KVLayout, num_pages: int,
         timeout_s: float = FORM_TIMEOUT_S) -> Member:
    """Take this process's place `spec` in its NVSHMEM group and allocate its KV pool in the
    symmetric heap, with the others.

    Args:
        spec: rank, size and rendezvous directory, from `microserve up`.
        device: this engine's GPU; it becomes the PE's device.
        layout, num_pages: the pool this engine would allocate; the group allocates the fewest
            pages any member offers.
        timeout_s: how long to wait for the other members, at each stage.

    Returns:
        The member, with its pool zeroed.

    Raises:
        GroupError: this rank joined before (a restart), rank 0 never published the group's
            unique id, the members' KV pages differ in size, or NVSHMEM failed to initialize.
        ValueError: nvshmem4py is missing, the environment's NVSHMEM heap is too small, or this
            process is a member already.
    """
    global _member
    if _member is not None:
        raise ValueError(f"this process is PE {_member.pe} of NVSHMEM group {_member.group} "
                         f"already: NVSHMEM takes one engine per process")
    nvshmem = _nvshmem()
    from cuda.core import Device  # a dependency of nvshmem4py

    rendezvous = Rendezvous(spec)
    rendezvous.check_first_join()
    dtype = getattr(torch, layout.dtype)
    page_bytes = math.prod(layout.pool_shape(1)) * dtype.itemsize
    os.environ.update(nvshmem_env(dict(os.environ), num_pages * page_bytes))  # before any uid
    if os.environ["NVSHMEM_DISABLE_NVLS"] != "1":
        log.warning("NVSHMEM_DISABLE_NVLS=%s: NVLink multicast can take shared GPUs down",
                    os.environ["NVSHMEM_DISABLE_NVLS"])
    rendezvous.offer_pool(num_pages, page_bytes)
    cuda = Device(device.index if device.index is not None else torch.cuda.current_device())
    cuda.set_current()
    if spec.rank == 0:
        uid = nvshmem.get_unique_id()  # starts the bootstrap's root thread in this process
        raw = uid._data.tobytes()
        rendezvous.publish_uid(raw)
    else:
        raw = rendezvous.wait_uid(timeout_s)
        uid = nvshmem.get_unique_id(empty=True)
        if len(raw) != uid._data.itemsize:
            raise GroupError(f"the NVSHMEM unique id in {spec.rendezvous} has {len(raw)} bytes, "
                             f"not {uid._data.itemsize}: made by another NVSHMEM version?")
        ctypes.memmove(uid.ptr, raw, len(raw))
    log.info("joining NVSHMEM group %s as PE %d of %d", group_id(raw), spec.rank, spec.size)
    with _watchdog(f"PE {spec.rank}'s NVSHMEM init and pool allocation", timeout_s):
        try:
            nvshmem.init(device=cuda, uid=uid, rank=spec.rank, nranks=spec.size,
                         initializer_method="uid")
        except Exception as e:
            raise GroupError(f"NVSHMEM init as PE {spec.rank} of {spec.size} failed: "
                             f"{type(e).__name__}: {e}") from None
        rendezvous.mark_joined()
        pages = rendezvous.agreed_pages()  # the same on every member, so allocate together
        pool = nvshmem.tensor(layout.pool_shape(pages), dtype=dtype, except_on_del=False)
    pool.zero_()
    torch.cuda.synchronize(device)
    if pages < num_pages:
        log.info("KV pool: %d pages, the fewest a member of the NVSHMEM group offered (this "
                 "engine had room for %d)", pages, num_pages)
    _member = Member(group_id(raw), spec.rank, spec.size, pool)
    return _member


class NvshmemBackend(ShmBackend):
    """A receiver's pool in the NVSHMEM symmetric heap of its group. Its page count may be
    below `num_pages`: the group allocates the fewest any member offered (`kv.shape[2]`)."""

    kind = "nvshmem"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str,
                 num_windows: int = DEFAULT_NUM_WINDOWS, *, key: bytes, group: GroupSpec,
                 timeout_s: float = FORM_TIMEOUT_S):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"--kv-transfer nvshmem needs the KV pool on a CUDA device, not "
                             f"{device}; use shm or tcp")
        joined = join(group, device, layout, num_pages, timeout_s)
        self.kv = joined.pool
        super().__init__(layout, self.kv.shape[2], num_windows, key=key, extra={
            "group": joined.group, "pe": joined.pe, "npes": joined.npes})


class NvshmemPeer(CudaIpcPeer):
    """A receiver of this engine's NVSHMEM group, written through the peer view of its pool."""

    kind = "nvshmem"

    def __init__(self, descriptor: dict, local_kv: torch.Tensor, layout: KVLayout):
        check_same_group(descriptor, _member)  # before anything of the receiver is opened
        assert local_kv.data_ptr() == _member.pool.data_ptr(), (
            "an NVSHMEM sender must send from its pool in the symmetric heap")
        super().__init__(descriptor, local_kv, layout)

    def _open_pool(self, descriptor: dict, shape: tuple[int, ...],
                   dtype: torch.dtype) -> torch.Tensor:
        pe = descriptor["pe"]
        try:
            remote = _nvshmem().get_peer_tensor(_member.pool, pe)
        except Exception as e:  # nvshmem_ptr is NULL for a PE beyond loads and stores
            raise TransferError(f"PE {pe} of NVSHMEM group {descriptor['group']} is not "
                                f"reachable by loads and stores from this GPU ({e}): NVSHMEM "
                                f"puts between hosts are not implemented; use tcp") from None
        if tuple(remote.shape) != shape or remote.dtype != dtype:
            raise TransferError(f"PE {pe}'s pool reads {tuple(remote.shape)} {remote.dtype} "
                                f"through NVSHMEM but its descriptor says {shape} {dtype}")
        return remote


def check_same_group(descriptor: dict, sender: Member | None) -> None:
    """Raise TransferError unless `sender` (this engine's membership) is in the group of the
    receiver that `descriptor` names."""
    group, pe, npes = descriptor["group"], descriptor["pe"], descriptor["npes"]
    receiver = f"PE {pe} of NVSHMEM group {group}"
    if sender is None:
        raise TransferError(
            f"the receiver is {receiver} and this engine is in no NVSHMEM group: only engines "
            f"started together with --kv-transfer nvshmem (by one `microserve up`) write each "
            f"other's pools; to receive from other engines the receiver needs --kv-transfer "
            f"cuda_ipc or tcp")
    if group != sender.group or npes != sender.npes:
        raise TransferError(
            f"the receiver is {receiver} and this engine is PE {sender.pe} of group "
            f"{sender.group}: a sender in another NVSHMEM group cannot write its pool; between "
            f"groups use --kv-transfer cuda_ipc or tcp")
    if not 0 <= pe < npes:
        raise TransferError(f"the receiver's descriptor names PE {pe} of a group of {npes}")
