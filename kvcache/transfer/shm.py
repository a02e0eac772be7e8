"""Shared-memory transfer for CPU engines on one host: the sender writes the receiver's pool.

The receiver's pool lives in a memfd. A sender opens it through `/proc/<pid>/fd/<fd>`, maps it,
and copies layer slices straight into it: the receiver does no work on the data path.

    memfd (one per receiving engine)
    ┌───────────────────┬──────────────────────────┬────────────────────┬────────────────────┐
    │ window table:     │ renewals: int64[N]       │ seals: 32 bytes[N] │ KV pool:           │
    │ int64[N], entry i │ entry i = CLOCK_MONOTONIC│ the sender's digest│ layout.pool_shape( │
    │ = open tag, 0 free│ ns of the last renewal   │ of its tokens, or 0│ num_pages)         │
    └───────────────────┴──────────────────────────┴────────────────────┴────────────────────┘
    0                   8N                         16N                  kv_offset (48N rounded
                                                                        up to a page)

A sender renews the windows of the jobs it holds by writing the time into their renewal entries
(both engines run on one host, so CLOCK_MONOTONIC is one clock). It first checks the window's
tag, without a lock: a window closed and reopened between that check and the write gets one
renewal it was not owed, and the sender's next renewal sees the new tag and fails its job.

A sender seals its window once every write is in (`seal`): it writes the digest of the tokens
its KV was computed for into the window's seal entry, under the window's lock; `close_window`
reads it back under the exclusive lock, and the exchange adopts the KV only if it is the digest
the window was reserved for. Which slots a sender writes is the sender's to keep within the
window (KVSender checks every destination against the slots the receiver signed): the receiver
does no work on the data path, so it cannot check them itself.

Windows are guarded by open-file-description locks (`F_OFD_SETLKW`) on each entry's 8 bytes:
a sender holds a shared lock on the entry while it checks the tag and copies; the receiver
takes an exclusive lock to open or close a window, so `close_window` waits for a copy in
progress. OFD locks (unlike `lockf`, whose locks belong to the process) also exclude each other
when both engines live in one process, and closing some other descriptor of the file does not
drop them. A process that dies releases its locks with its descriptors.

A sender maps the receiver's whole pool, and a 4 KB page of that mapping costs a page fault the
first time the sender writes it (2-4 us each on this project's VM: a first copy of 1,000
tokens, 46 MB, took ~195 ms where the same copy into touched pages took ~16 ms). So a peer
prefaults its mapping on a background thread when it opens (`madvise(MADV_POPULATE_WRITE)`,
Linux 5.14+, a few MB at a time with the GIL released): the faults are paid once per peer, off
the transfer's path.

The memfd is freed by the kernel when the last process unmaps it, so nothing leaks even when an
engine is killed; a sender that still maps a dead receiver's pool writes into memory nobody
reads, and finds out at its next write or flush (the receiver's pidfd polls readable).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import math
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvcache.transfer.auth import DIGEST_BYTES, sign
from kvcache.transfer.base import (
    KVLayout,
    Peer,
    TransferBackend,
    TransferError,
    Window,
    WindowIds,
    copyable,
)

log = logging.getLogger(__name__)

DEFAULT_NUM_WINDOWS = 4096
MEMFD_NAME = "microserve-kv"
_MADV_POPULATE_WRITE = 23  # linux/mman.h, 5.14+
_POPULATE_STEP = 4 << 20

_ENTRY = struct.Struct("<q")  # one window table entry: the open window's tag, 0 when free
# struct flock on Linux (x86-64, aarch64): l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = struct.Struct("@hhqqi4x")


def _lock(fd: int, lock_type: int, start: int, length: int) -> None:
    """Take (blocking) or release an OFD lock on bytes [start, start + length) of `fd`.
    `lock_type` is fcntl.F_RDLCK (shared), F_WRLCK (exclusive) or F_UNLCK."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(lock_type, os.SEEK_SET, start, length, 0))


@contextmanager
def _entry_locked(fd: int, index: int, lock_type: int) -> Iterator[None]:
    _lock(fd, lock_type, index * _ENTRY.size, _ENTRY.size)
    try:
        yield
    finally:
        _lock(fd, fcntl.F_UNLCK, index * _ENTRY.size, _ENTRY.size)


def _process_exited(pidfd: int) -> bool:
    # A pidfd polls readable once its process has exited; unlike kill(pid, 0) this also catches
    # a zombie, and a recycled pid cannot pass for it. A fresh poll object per call, because
    # alive() may run on two threads at once.
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class _Prefault:
    """Prefaults a shared mapping on a daemon thread, `_POPULATE_STEP` bytes per madvise call
    (ctypes releases the GIL around it). `stop()` returns once no call runs, so the mapping may
    then be unmapped. Kernels without MADV_POPULATE_WRITE end it at the first call."""

    def __init__(self, mapping: mmap.mmap, name: str):
        view = ctypes.c_char.from_buffer(mapping)
        self._addr, self._size = ctypes.addressof(view), len(mapping)
        del view  # an exported buffer would keep the mmap from closing
        self._stop = threading.Event()
        self.done = 0  # bytes populated so far
        self.supported = True  # False once the kernel refused MADV_POPULATE_WRITE
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for offset in range(0, self._size, _POPULATE_STEP):
            if self._stop.is_set():
                return
            length = min(_POPULATE_STEP, self._size - offset)
            if madvise(self._addr + offset, length, _MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                self.supported = err not in (errno.EINVAL, errno.ENOSYS)  # before 5.14
                if self.supported:
                    log.warning("prefaulting the shm KV pool stopped: %s", os.strerror(err))
                return
            self.done = offset + length

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _seal_offset(num_windows: int, index: int) -> int:
    """Where window `index`'s seal lives in the memfd (after the tags and the renewals)."""
    return 2 * num_windows * _ENTRY.size + index * DIGEST_BYTES


def _check_window_index(window: Window, num_windows: int) -> None:
    if not 0 <= window.index < num_windows:
        raise ValueError(f"window index {window.index} out of range for {num_windows} windows")


class ShmBackend(TransferBackend):
    """A CPU pool in shared memory that same-host peers write directly.

    `open_window` and `close_window` may be called from any thread of the receiving process.
    """

    kind = "shm"

    def __init__(self, layout: KVLayout, num_pages: int, num_windows: int = DEFAULT_NUM_WINDOWS,
                 *, key: bytes, extra: dict | None = None):
        """`extra`: a subclass whose pool lives elsewhere (cuda_ipc) sets `self.kv` before
        calling this, which then puts only the window table in the memfd, and adds `extra`
        to the descriptor it signs."""
        if num_pages < 1 or num_windows < 1:
            raise ValueError(
                f"num_pages ({num_pages}) and num_windows ({num_windows}) must be >= 1"
            )
        dtype = getattr(torch, layout.dtype)
        shape = layout.pool_shape(num_pages)
        count = math.prod(shape)
        table_bytes = num_windows * (2 * _ENTRY.size + DIGEST_BYTES)
        kv_offset = -(-table_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        pool_in_file = extra is None
        nbytes = kv_offset + (count * dtype.itemsize if pool_in_file else 0)

        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            # Commit the memory now, as torch.zeros would: running out fails here, at startup,
            # not as a SIGBUS in the middle of a transfer.
            os.posix_fallocate(fd, 0, nbytes)
            # A sealed size means no process can shrink the file under a peer's mapping.
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            self._mmap = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        # Never unmapped: torch.frombuffer does not pin the mapping, and the engine uses `kv`
        # until it exits. The file starts zero-filled, so the table is empty and the pool zeros.
        if pool_in_file:
            flat = torch.frombuffer(self._mmap, dtype=dtype, count=count, offset=kv_offset)
            self.kv = flat.view(shape)

        self.num_windows = num_windows
        self._key = key
        self._descriptor = sign({
            "kind": self.kind,
            "pid": os.getpid(),
            "fd": fd,
            "inode": os.fstat(fd).st_ino,
            "boot_id": _boot_id(),
            "hostname": socket.gethostname(),
            "nbytes": nbytes,
            "kv_offset": kv_offset,
            "num_pages": num_pages,
            "num_windows": num_windows,
            **(extra or {}),
        }, key)
        # OFD locks taken through one descriptor do not exclude each other, so threads of this
        # process serialize table updates on this lock; it is held across the entry lock.
        self._lock = threading.Lock()
        self._fd = fd  # -1 once closed
        self._ids = WindowIds(num_windows)

    def descriptor(self) -> dict:
        return dict(self._descriptor)

    def add_ranks(self, fields: dict, pools: list[torch.Tensor]) -> None:
        """Add a tensor-parallel engine's other ranks' pools (kvcache/transfer/tp_peer.py) to
        the descriptor, signed with the rest (senders map and write them; `pools` is not
        needed here). Called once, before any peer saw it."""
        body = {k: v for k, v in self._descriptor.items() if k != "mac"}
        self._descriptor = sign({**body, **fields}, self._key)

    def open_window(self, slots: torch.Tensor | None = None) -> Window | None:
        """A fresh window; None when all `num_windows` are open or the backend is closed.
        `slots` are not kept: senders write the pool directly (see the module docstring)."""
        with self._lock:
            window = self._ids.take()
            if window is None:
                return None
            with _entry_locked(self._fd, window.index, fcntl.F_WRLCK):
                _ENTRY.pack_into(self._mmap, self._renewal_offset(window.index), 0)
                seal = _seal_offset(self.num_windows, window.index)
                self._mmap[seal : seal + DIGEST_BYTES] = bytes(DIGEST_BYTES)
                _ENTRY.pack_into(self._mmap, window.index * _ENTRY.size, window.tag)
        return window

    def _renewal_offset(self, index: int) -> int:
        return (self.num_windows + index) * _ENTRY.size

    def renewed_at(self, window: Window) -> float | None:
        self._ids.check(window)
        with self._lock:
            if self._fd < 0 or _ENTRY.unpack_from(self._mmap, window.index * _ENTRY.size)[0] != (
                    window.tag):
                return None
            ns = _ENTRY.unpack_from(self._mmap, self._renewal_offset(window.index))[0]
        return ns / 1e9 if ns > 0 else None

    def close_window(self, window: Window) -> bytes | None:
        self._ids.check(window)
        offset = window.index * _ENTRY.size
        seal = _seal_offset(self.num_windows, window.index)
        with self._lock:
            if self._fd < 0:
                return None  # close() closed every window
            # The exclusive lock waits for a sender's copy into this window to finish.
            with _entry_locked(self._fd, window.index, fcntl.F_WRLCK):
                if _ENTRY.unpack_from(self._mmap, offset)[0] != window.tag:
                    return None  # closed before
                digest = bytes(self._mmap[seal : seal + DIGEST_BYTES])
                _ENTRY.pack_into(self._mmap, offset, 0)
            self._ids.release(window.index)
        return None if digest == bytes(DIGEST_BYTES) else digest

    def close(self) -> None:
        """Close every window (waiting for copies in progress) and the memfd, so no peer writes
        or opens the pool after this. `kv` stays valid; later `open_window` calls return None."""
        with self._lock:
            if self._fd < 0:
                return
            table_bytes = self.num_windows * _ENTRY.size
            _lock(self._fd, fcntl.F_WRLCK, 0, table_bytes)
            self._mmap[:table_bytes] = bytes(table_bytes)
            _lock(self._fd, fcntl.F_UNLCK, 0, table_bytes)
            os.close(self._fd)
            self._fd = -1
            self._ids.clear()


class ShmPeer(Peer):
    """A mapping of a same-host receiver's pool.

    `local_kv` (this engine's pool, `layout.pool_shape(local_pages)`) may live on a GPU: rows
    are gathered there on the calling thread's current stream, so the engine must have written
    them on that stream (the default one) or synced.
    """

    kind = "shm"

    def __init__(self, descriptor: dict, local_kv: torch.Tensor, layout: KVLayout,
                 remote_layout: KVLayout | None = None):
        """`remote_layout`: the receiver's, where its heads are split otherwise than this
        engine's (tensor parallelism, kvcache/transfer/tp_peer.py); None: `layout`."""
        pid = descriptor["pid"]
        if descriptor["boot_id"] != _boot_id():
            raise TransferError(
                f"shm needs both engines on one host: the receiver runs on "
                f"{descriptor['hostname']!r}, this engine on {socket.gethostname()!r} "
                f"(different boot ids); use --kv-transfer tcp"
            )
        dtype = getattr(torch, layout.dtype)
        expected = layout.pool_shape(local_kv.shape[2])
        assert local_kv.shape == expected and local_kv.dtype == dtype, (
            f"local pool {tuple(local_kv.shape)} {local_kv.dtype} does not match {layout}"
        )
        shape = (remote_layout or layout).pool_shape(descriptor["num_pages"])
        count = math.prod(shape)
        in_file = count * dtype.itemsize if descriptor["kind"] == "shm" else 0
        if descriptor["kv_offset"] + in_file > descriptor["nbytes"]:
            raise TransferError(
                f"shm descriptor of pid {pid} is inconsistent: {descriptor['num_pages']} pages "
                f"of {layout} do not fit in {descriptor['nbytes']} bytes"
            )

        # Taken before the pool is opened: it names the process that owned the pool's pid then.
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise TransferError(f"shm receiver pid {pid} is not running") from None
        try:
            self._fd, self._mmap = self._map(descriptor)
        except BaseException:
            os.close(self._pidfd)
            raise

        self._pid = pid
        self._num_windows = descriptor["num_windows"]
        self._rows = (2, -1, layout.num_kv_heads, layout.head_dim)  # a layer as [K/V, slot, ...]
        self._local = copyable(local_kv)
        try:
            self._remote: torch.Tensor | None = copyable(self._open_pool(descriptor, shape, dtype))
        except BaseException:
            self._mmap.close()
            os.close(self._fd)
            os.close(self._pidfd)
            raise
        self._prefault = _Prefault(self._mmap, f"kv-shm-prefault-{pid}")

    def _open_pool(self, descriptor: dict, shape: tuple[int, ...],
                   dtype: torch.dtype) -> torch.Tensor:
        """The receiver's pool: here, the rest of the mapped memfd."""
        return torch.frombuffer(self._mmap, dtype=dtype, count=math.prod(shape),
                                offset=descriptor["kv_offset"]).view(shape)

    @staticmethod
    def _map(descriptor: dict) -> tuple[int, mmap.mmap]:
        pid, fd = descriptor["pid"], descriptor["fd"]
        path = f"/proc/{pid}/fd/{fd}"
        try:
            own_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise TransferError(
                f"cannot open the KV pool of shm receiver pid {pid} ({path}): {e.strerror}; it "
                f"exited, or runs as another user or in another container: use --kv-transfer tcp"
            ) from None
        try:
            # The descriptor is signed, so pid, fd and inode are an engine's; this also refuses
            # anything but one of our pools should the pid and fd have been reused since.
            target = os.readlink(f"/proc/self/fd/{own_fd}")
            if not target.startswith(f"/memfd:{MEMFD_NAME} "):
                raise TransferError(f"{path} is not a microserve KV pool")
            st = os.fstat(own_fd)
            if st.st_ino != descriptor["inode"] or st.st_size != descriptor["nbytes"]:
                raise TransferError(
                    f"{path} is not the KV pool of shm receiver pid {pid} (inode {st.st_ino}, "
                    f"{st.st_size} bytes; expected inode {descriptor['inode']}, "
                    f"{descriptor['nbytes']} bytes): the receiver closed its pool, or exited "
                    f"and its pid was reused"
                )
            return own_fd, mmap.mmap(own_fd, descriptor["nbytes"])
        except BaseException:
            os.close(own_fd)
            raise

    @contextmanager
    def _window_open(self, window: Window) -> Iterator[None]:
        """Hold a shared lock on the window's entry: the receiver cannot close the window until
        the block ends. Raises TransferError if the receiver exited or closed the window."""
        self._lock_window(window)
        try:
            yield
        finally:
            self._unlock_window(window)

    def _lock_window(self, window: Window) -> None:
        """Take the shared lock on the window's entry if the window is still open (else raise
        TransferError, holding nothing). `_unlock_window` lets go."""
        if self._remote is None:
            raise TransferError(f"the {self.kind} peer for receiver pid {self._pid} is closed")
        _check_window_index(window, self._num_windows)
        if _process_exited(self._pidfd):
            raise TransferError(f"{self.kind} receiver pid {self._pid} exited")
        offset = window.index * _ENTRY.size
        _lock(self._fd, fcntl.F_RDLCK, offset, _ENTRY.size)
        if _ENTRY.unpack_from(self._mmap, offset)[0] != window.tag:
            _lock(self._fd, fcntl.F_UNLCK, offset, _ENTRY.size)
            raise self._closed(window)

    def _closed(self, window: Window) -> TransferError:
        return TransferError(
            f"receiver pid {self._pid} closed window {window.index} (tag {window.tag}): "
            f"the request was aborted there, its lease expired or the engine stopped"
        )

    def _unlock_window(self, window: Window) -> None:
        _lock(self._fd, fcntl.F_UNLCK, window.index * _ENTRY.size, _ENTRY.size)

    def renew(self, window: Window) -> None:
        """Write the time into the window's renewal entry (no lock: see the module docstring)."""
        if self._remote is None:
            raise TransferError(f"the {self.kind} peer for receiver pid {self._pid} is closed")
        _check_window_index(window, self._num_windows)
        if _process_exited(self._pidfd):
            raise TransferError(f"{self.kind} receiver pid {self._pid} exited")
        if _ENTRY.unpack_from(self._mmap, window.index * _ENTRY.size)[0] != window.tag:
            raise self._closed(window)
        offset = (self._num_windows + window.index) * _ENTRY.size
        _ENTRY.pack_into(self._mmap, offset, time.monotonic_ns())

    def seal(self, window: Window, digest: bytes) -> None:
        """Write `digest` into the window's seal entry, once the writes queued so far landed."""
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a seal is {DIGEST_BYTES} bytes, not {len(digest)}")
        self._drain()
        offset = _seal_offset(self._num_windows, window.index)
        with self._window_open(window):
            self._mmap[offset : offset + DIGEST_BYTES] = digest

    def _drain(self) -> None:
        """Wait for the writes queued so far: none here, copies are synchronous (a GPU peer
        queues its copies and waits for them here)."""

    def write(
        self, window: Window, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
        ready: "torch.cuda.Event | None" = None,
    ) -> None:
        """Copy synchronously: the bytes are in the receiver's pool when this returns."""
        with self._window_open(window):
            self._copy_layer(layer, src_slots, dst_slots)

    def _copy_layer(self, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        local = self._local[layer].view(self._rows)
        rows = local.index_select(1, src_slots.to(local.device)).cpu()
        self._remote[layer].view(self._rows).index_copy_(1, dst_slots, rows)

    def flush(self, window: Window) -> None:
        """Writes are synchronous: only check the receiver is alive and the window open."""
        with self._window_open(window):
            pass

    def alive(self) -> bool:
        return self._remote is not None and not _process_exited(self._pidfd)

    def close(self) -> None:
        if self._remote is None:
            return
        self._remote = None  # drop the view first: the mapping must not be used once unmapped
        self._prefault.stop()
        self._mmap.close()
        os.close(self._fd)
        os.close(self._pidfd)
