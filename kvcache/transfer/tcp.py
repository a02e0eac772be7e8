"""TCP transfer between any two hosts: the receiver's connection threads write what arrives.

A sender holds one connection per receiver. After a handshake in which each side proves it
holds the deployment's transfer key (kvcache/transfer/auth.py) and the KV layouts are
compared, it streams frames (WRITE, SEAL, FLUSH, RENEW: the wire format is tcp_wire.py); the
receiver applies them in order, one thread per authenticated connection.

Writes are one-way: a write into a window the receiver already closed is dropped there and the
sender learns it at the next flush. A WRITE or RENEW into an open window renews its lease; the
sender's renewal thread sends RENEW between the transfer thread's frames.

The receiver applies writes itself, so it keeps each window within its reservation: a WRITE
naming any slot outside the slots the window was opened with is dropped whole and reported at
the flush. A SEAL is kept only if every write into the window was applied; `close_window`
returns it.

The listener (tcp_listener.py) runs every handshake on one thread: a connection that has not
proved it holds the key gets no thread and no more than a 4 KiB hello read, must complete it
within 10 s of its accept, and waits among at most 128 (16 per address; past that the oldest
is closed to make room); a failed proof is answered with an error and a hang-up.

A frame's rows carry every KV head of the model in order, whatever either side's tensor-
parallel split: a tensor-parallel sender gathers them from its ranks' pools, a tensor-parallel
receiver splits them into its ranks' (kvcache/transfer/heads.py, `whole_layout`).
"""

from __future__ import annotations

import atexit
import hmac
import logging
import select
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvcache.transfer import auth
from kvcache.transfer.auth import sign
from kvcache.transfer.base import (
    KVLayout,
    Peer,
    TransferBackend,
    TransferError,
    Window,
    WindowIds,
    copyable,
    slots_outside,
    window_slots,
)
from kvcache.transfer.tcp_listener import HANDSHAKE_TIMEOUT_S, HandshakeListener
from kvcache.transfer.heads import HeadRun, head_plan, heads_view, whole_layout
from kvcache.transfer.tcp_wire import (
    FLUSH,
    HEADER,
    MAX_HELLO,
    MAX_SEAL,
    RENEW,
    SEAL,
    WRITE,
    Buffer,
    recv_exactly,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)

DEFAULT_NUM_WINDOWS = 4096
DEFAULT_TIMEOUT_S = 60.0


class TcpBackend(TransferBackend):
    """A pool on `device` fed by a TCP listener on (host, port); port 0 picks a free port.

    The descriptor advertises `advertise_host`, else `host`, else (bound to every interface)
    this machine's hostname. `open_window` and `close_window` may be called from any thread.
    """

    kind = "tcp"

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        num_windows: int = DEFAULT_NUM_WINDOWS,
        *,
        key: bytes,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ):
        if num_pages < 1 or num_windows < 1:
            raise ValueError(
                f"num_pages ({num_pages}) and num_windows ({num_windows}) must be >= 1"
            )
        self.layout = layout
        dtype = getattr(torch, layout.dtype)
        self.kv = torch.zeros(layout.pool_shape(num_pages), dtype=dtype, device=device)
        self.num_windows = num_windows
        self._num_slots = num_pages * layout.page_size
        heads = layout.model_kv_heads  # a frame's rows hold every head (a layer: [K/V, slot, ...])
        self._rows = (2, -1, heads, layout.head_dim)
        self._rows_dtype = copyable(self.kv).dtype  # what a frame's rows are copied as
        self._row_bytes = heads * layout.head_dim * self.kv.element_size()
        # a tensor-parallel engine's ranks' pools (add_ranks), rank 0's (self.kv) first, and
        # which of a frame's heads go to which: None for an engine of one rank
        self._ranks: list[torch.Tensor] | None = None
        self._plan: list[HeadRun] = []
        # Received rows are copied on a stream of their own, so waiting for a copy does not
        # wait for the engine's queued work.
        self._stream = torch.cuda.Stream(self.kv.device) if self.kv.is_cuda else None

        # Guards the window table; a connection thread holds it while it copies into the pool,
        # so close_window returns only when no write into the window is in progress.
        self._lock = threading.Lock()
        self._windows: dict[int, int] = {}  # index -> tag of each open window
        self._renewed: dict[int, float] = {}  # index -> time.monotonic() of its last renewal
        self._slots: dict[int, np.ndarray] = {}  # index -> window_slots() of it; absent: any
        self._seals: dict[int, bytes] = {}  # index -> the digest its sender sealed it with
        self._ids = WindowIds(num_windows)

        self._conns_lock = threading.Lock()  # guards _conns and _closing
        self._conns: dict[socket.socket, threading.Thread] = {}  # live connection -> its thread
        self._closing = False
        self._listener = HandshakeListener(host, port, key, layout, self._start_frames,
                                           timeout_s=handshake_timeout_s)
        self.port = self._listener.port
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        self._descriptor = sign({
            "kind": self.kind,
            "host": advertise_host,
            "port": self.port,
            "num_pages": num_pages,
        }, key)

        _open_backends.add(self)

    def descriptor(self) -> dict:
        return dict(self._descriptor)

    def add_ranks(self, fields: dict, pools: list[torch.Tensor]) -> None:
        """A tensor-parallel engine's ranks' pools (rank 0's first, mapped in this process):
        the connection threads split each frame's heads into them. Senders need nothing of
        it (a frame holds every head), so the descriptor stays as it is."""
        self._ranks = [copyable(kv) for kv in pools]
        self._plan = head_plan(whole_layout(self.layout), self.layout)

    def open_window(self, slots: torch.Tensor | None = None) -> Window | None:
        allowed = None if slots is None else window_slots(slots)
        with self._lock:
            window = self._ids.take()
            if window is not None:
                self._windows[window.index] = window.tag
                if allowed is not None:
                    self._slots[window.index] = allowed
        return window

    def close_window(self, window: Window) -> bytes | None:
        self._ids.check(window)
        with self._lock:
            if self._windows.get(window.index) != window.tag:
                return None
            del self._windows[window.index]
            self._renewed.pop(window.index, None)
            self._slots.pop(window.index, None)
            self._ids.release(window.index)
            return self._seals.pop(window.index, None)

    def renewed_at(self, window: Window) -> float | None:
        self._ids.check(window)
        with self._lock:
            if self._windows.get(window.index) != window.tag:
                return None
            return self._renewed.get(window.index)

    def close(self) -> None:
        """Stop accepting, drop every connection and join the listener's threads."""
        with self._conns_lock:
            if self._closing:
                return
            self._closing = True
            conns = dict(self._conns)
        _open_backends.discard(self)
        self._listener.close()
        for conn, thread in conns.items():
            try:  # shutdown (not close) wakes a thread blocked in recv() on Linux
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the peer already hung up
            thread.join()

    # ---- connection threads ------------------------------------------------------------------

    def _start_frames(self, conn: socket.socket, sender: str) -> None:
        """The listener's `on_ready`: a sender that passed the handshake gets its own thread."""
        thread = threading.Thread(target=self._serve, args=(conn, sender),
                                  name=f"kv-tcp-conn-{sender}", daemon=True)
        with self._conns_lock:
            if self._closing:
                conn.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _serve(self, conn: socket.socket, sender: str) -> None:
        """One authenticated connection: apply frames in order until the sender hangs up."""
        try:
            self._apply_frames(conn, sender)
        except OSError as e:
            log.debug("kv transfer connection from %s ended: %s", sender, e)
        except Exception:
            log.exception("kv transfer connection from %s failed", sender)
        finally:
            with self._conns_lock:
                del self._conns[conn]
            conn.close()

    def _apply_frames(self, conn: socket.socket, sender: str) -> None:
        header = bytearray(HEADER.size)
        buf = Buffer()
        errors: dict[tuple[int, int], str] = {}  # (index, tag) -> first failed write's message
        while True:
            recv_exactly(conn, memoryview(header))
            op, index, tag, layer, n = HEADER.unpack(header)
            if op == WRITE and n > self._num_slots:
                log.warning("kv transfer connection from %s sent a write of %d slots into a "
                            "pool of %d; closing it", sender, n, self._num_slots)
                return
            if op == WRITE:
                slots_end = 8 * n
                frame_end = slots_end + 2 * n * self._row_bytes
                buf.reserve(frame_end)
                recv_exactly(conn, buf.view[:frame_end])
                slots = buf.bytes[:slots_end].view(torch.int64)
                rows = buf.bytes[slots_end:frame_end].view(self._rows_dtype).view(self._rows)
                error = self._write(index, tag, layer, slots, rows)
                if error is not None:
                    errors.setdefault((index, tag), error)
            elif op == RENEW:
                with self._lock:
                    if self._windows.get(index) == tag:
                        self._renewed[index] = time.monotonic()
            elif op == SEAL:
                if n > MAX_SEAL:
                    log.warning("kv transfer connection from %s sent a seal of %d bytes; "
                                "closing it", sender, n)
                    return
                digest = bytearray(n)
                recv_exactly(conn, memoryview(digest))
                with self._lock:  # a window with a failed write is never sealed
                    if self._windows.get(index) == tag and (index, tag) not in errors:
                        self._seals[index] = bytes(digest)
            elif op == FLUSH:
                error = errors.pop((index, tag), None)
                with self._lock:
                    if self._windows.get(index) != tag:
                        error = f"window {index} (tag {tag}) is closed: the request was aborted "
                        error += "here, its lease expired or the engine stopped"
                send_message(conn, {"error": error})
            else:
                log.warning(
                    "kv transfer connection from %s sent unknown frame op %d; closing it",
                    sender,
                    op,
                )
                return

    def _write(
        self, index: int, tag: int, layer: int, slots: torch.Tensor, rows: torch.Tensor
    ) -> str | None:
        """Copy one WRITE frame into the pool if its window is open. Returns an error message
        for a frame that names a layer or slot out of range (the sender's bug)."""
        if not 0 <= layer < self.layout.num_layers:
            return f"layer {layer} out of range for {self.layout.num_layers} layers"
        if len(slots):
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self._num_slots:
                return f"slots {lo}..{hi} out of range for {self._num_slots} slots"
        with self._lock:
            if self._windows.get(index) != tag:
                return None  # closed: dropped; the next flush of this window reports it
            allowed = self._slots.get(index)
            if allowed is not None and len(outside := slots_outside(slots.numpy(), allowed)):
                return (f"slots {outside[:4].tolist()} are outside the {len(allowed)} slots "
                        f"reserved for window {index}; the write was dropped")
            self._renewed[index] = time.monotonic()
            if self._stream is None:
                self._copy_in(layer, slots, rows)
            else:
                with torch.cuda.stream(self._stream):
                    self._copy_in(layer, slots.to(self.kv.device), rows.to(self.kv.device))
                self._stream.synchronize()  # done, not just queued, when the lock is released
        return None

    def _copy_in(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """A frame's rows (every head) into the pool, or split into the ranks' pools."""
        if self._ranks is None:
            copyable(self.kv[layer]).view(self._rows).index_copy_(1, slots, rows)
            return
        for run in self._plan:
            heads_view(self._ranks[run.dst_rank][layer], run.dst_heads).index_copy_(
                1, slots, rows[:, :, run.src_heads.start:run.src_heads.stop])


# A daemon thread still inside torch ops while the interpreter finalizes aborts the process
# ("terminate called without an active exception"), so backends left open are closed, their
# threads joined, at exit.
_open_backends: weakref.WeakSet[TcpBackend] = weakref.WeakSet()


@atexit.register
def _close_open_backends() -> None:
    for backend in list(_open_backends):
        backend.close()


class TcpPeer(Peer):
    """One connection to a receiver's listener.

    `local_kv` may live on a GPU: rows are gathered there on the calling thread's current
    stream, so the engine must have written them on that stream (the default one) or synced.
    A tensor-parallel sender's frames gather each head from the first of `local_ranks` (its
    ranks' pools, rank 0's first) that holds it.

    Every socket operation times out after `timeout_s`. The first I/O error breaks the peer for
    good (a frame may be half sent): every later call raises the same TransferError.
    """

    def __init__(
        self,
        descriptor: dict,
        local_kv: torch.Tensor,
        layout: KVLayout,
        key: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        local_ranks: list[torch.Tensor] | None = None,
    ):
        self._address = f"{descriptor['host']}:{descriptor['port']}"
        self._local = copyable(local_kv)
        heads = layout.model_kv_heads  # a frame's rows hold every head (a layer: [K/V, slot, ...])
        self._rows = (2, -1, heads, layout.head_dim)
        self._row_bytes = heads * layout.head_dim * local_kv.element_size()
        split = local_ranks is not None and len(local_ranks) > 1
        self._ranks = [copyable(kv) for kv in local_ranks] if split else None
        self._plan = head_plan(layout, whole_layout(layout)) if split else []
        self._buf = Buffer()
        self._broken: str | None = None
        self._sending = threading.Lock()  # one frame at a time: the transfer or renewal thread
        try:
            self._sock = socket.create_connection(
                (descriptor["host"], descriptor["port"]), timeout=timeout_s
            )
        except OSError as e:
            raise TransferError(f"cannot connect to receiver {self._address}: {e}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._io():
            challenge = recv_message(self._sock, MAX_HELLO).get("nonce")
            if not isinstance(challenge, bytes):
                raise OSError("not a KV transfer listener (no challenge)")
            mine = auth.nonce()
            send_message(self._sock, {"nonce": mine, "layout": layout.to_dict(),
                                      "proof": auth.proof(key, b"sender", mine, challenge)})
            answer = recv_message(self._sock, MAX_HELLO)
        error = answer.get("error")
        if error is not None:
            self.close()
            raise TransferError(f"receiver {self._address} refused the connection: {error}")
        their_proof = answer.get("proof")
        if not (isinstance(their_proof, bytes) and hmac.compare_digest(
                their_proof, auth.proof(key, b"receiver", challenge, mine))):
            self.close()
            raise TransferError(f"receiver {self._address} did not prove it holds this "
                                "deployment's transfer key")

    @contextmanager
    def _io(self) -> Iterator[None]:
        """Turn an I/O error into a TransferError and break the peer."""
        if self._broken is not None:
            raise TransferError(self._broken)
        try:
            yield
        except OSError as e:  # includes timeouts and the other side hanging up
            self._broken = f"connection to receiver {self._address} lost: {e}"
            self._sock.close()
            raise TransferError(self._broken) from None

    def write(
        self, window: Window, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
        ready: "torch.cuda.Event | None" = None,
    ) -> None:
        """Send one WRITE frame. Returns once the kernel has the bytes, not the receiver."""
        n = len(src_slots)
        slots_end = HEADER.size + 8 * n
        frame_end = slots_end + 2 * n * self._row_bytes
        self._buf.reserve(frame_end)
        frame = self._buf.bytes
        HEADER.pack_into(self._buf.view, 0, WRITE, window.index, window.tag, layer, n)
        frame[HEADER.size : slots_end].view(torch.int64).copy_(dst_slots)
        rows = frame[slots_end:frame_end].view(self._local.dtype).view(self._rows)
        if self._ranks is not None:
            for run in self._plan:
                src = heads_view(self._ranks[run.src_rank][layer], run.src_heads)
                rows[:, :, run.dst_heads.start:run.dst_heads.stop] = src.index_select(
                    1, src_slots.to(src.device)).cpu()
        elif self._local.is_cpu:
            torch.index_select(self._local[layer].view(self._rows), 1, src_slots, out=rows)
        else:
            local = self._local[layer].view(self._rows)
            rows.copy_(local.index_select(1, src_slots.to(local.device)))
        with self._sending, self._io():
            self._sock.sendall(self._buf.view[:frame_end])

    def seal(self, window: Window, digest: bytes) -> None:
        """Send SEAL behind the writes: the receiver keeps it if they were all applied."""
        with self._sending, self._io():
            self._sock.sendall(HEADER.pack(SEAL, window.index, window.tag, 0, len(digest))
                               + digest)

    def flush(self, window: Window) -> None:
        with self._sending, self._io():
            self._sock.sendall(HEADER.pack(FLUSH, window.index, window.tag, 0, 0))
        with self._io():
            error = recv_message(self._sock)["error"]
        if error is not None:
            raise TransferError(f"receiver {self._address}: {error}")

    def renew(self, window: Window) -> None:
        """Send RENEW between the transfer thread's frames; skipped if none ends within a
        second (a connection that busy is sending; the next renewal tries again)."""
        if not self._sending.acquire(timeout=1.0):
            return
        try:
            with self._io():
                self._sock.sendall(HEADER.pack(RENEW, window.index, window.tag, 0, 0))
        finally:
            self._sending.release()

    def alive(self) -> bool:
        if self._broken is not None:
            return False
        # The receiver's kernel closes the connection when it exits (FIN, or RST if bytes were
        # unread): poll sees that without reading, so a flush reply in flight stays unread.
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP)
        return not poller.poll(0)

    def close(self) -> None:
        self._sock.close()
