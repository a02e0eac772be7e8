"""The tcp transfer's listener: one thread accepts connections and runs every handshake.

A connection that has not proved it holds the deployment's transfer key costs the receiver a
socket and at most a 4 KiB hello, never a thread: the listener thread accepts, sends each
connection its challenge and reads hellos as their bytes come (non-blocking, one selector).
Only a sender that proved the key and whose KV layout matches is handed to `on_ready`, which
gives it a thread of its own for its frames (TcpBackend: blocking reads, one frame a read).

Bounds, so that whoever can reach the port cannot hold the engine's threads or sockets, nor
keep the deployment's own senders out:

    deadline   a hello must be complete `timeout_s` (10 s) after its connection was accepted,
               however its bytes trickle in; then the connection is closed
    pending    at most `max_pending` (128) connections await their hello, and at most
               `max_per_address` (16) from one address; a connection past either cap makes
               room: the oldest one waiting (from its address, or of all) is told why
               ({"error": ...}) and closed
    size       a hello longer than MAX_HELLO is not read: the connection is closed

Making room by closing the oldest, not by refusing the newest, is what lets a sender in while
slow connections flood the listener: its handshake takes a millisecond, so to push it out a
flood would have to open `max_pending` connections within that millisecond; refusing instead
would keep it out for as long as the flood holds the caps.

The handshake itself (tcp_wire.py), all of it on the listener's thread:

    listener ── {"nonce": r} ──────────────────────────────────────────▶ sender
             ◀─ {"nonce": s, "proof": P("sender", s, r), "layout": ...} ──
             ── {"error": None | why, "proof": P("receiver", r, s)} ────▶  frames follow
                                                                            on a thread of their own
"""

from __future__ import annotations

import hmac
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from kvcache.transfer.base import KVLayout
from kvcache.transfer.tcp_wire import LENGTH, MAX_HELLO, unpack_message
from kvcache.transfer import auth

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING = 128
MAX_PENDING_PER_ADDRESS = 16
_LOG_EVERY_S = 10.0  # refusals and expiries are summed up in one warning this often at most
_ACCEPT_BURST = 64  # connections accepted in one go
_ACCEPT_RETRY_S = 1.0  # after accept() failed (out of descriptors, say), try again this late


@dataclass
class _Pending:
    """A connection awaiting its hello; written by the listener thread only."""

    sock: socket.socket
    address: str  # the sender's host, for the per-address cap
    sender: str  # host:port, for logs
    challenge: bytes
    deadline: float  # time.monotonic() by which the hello must be complete
    hello: bytearray = field(default_factory=bytearray)  # length prefix, then the message

    def missing(self) -> int:
        """Bytes still to read: the length prefix first, then exactly the message it
        announces (never beyond: frames follow only after the answer)."""
        if len(self.hello) < LENGTH.size:
            return LENGTH.size - len(self.hello)
        return LENGTH.size + LENGTH.unpack_from(self.hello)[0] - len(self.hello)


class HandshakeListener:
    """Listens on (host, port) (0: a free port, `.port` says which) and hands each connection
    whose sender proved `key` and sent `layout` to `on_ready(sock, sender)`, on the listener
    thread, as a blocking socket that has read nothing past the handshake."""

    def __init__(self, host: str, port: int, key: bytes, layout: KVLayout,
                 on_ready: Callable[[socket.socket, str], None], *,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S, max_pending: int = MAX_PENDING,
                 max_per_address: int = MAX_PENDING_PER_ADDRESS):
        self._key, self._layout, self._on_ready = key, layout, on_ready
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self.max_per_address = max_per_address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        # Accept order is deadline order, so the first entry is always the next to expire,
        # and the oldest to close when a cap is reached.
        self._pending: dict[socket.socket, _Pending] = {}
        self._by_address: dict[str, dict[socket.socket, None]] = {}  # host -> its, in order
        self._evicted = self._expired = 0  # since the last warning that counted them
        self._last_warning = 0.0
        self._accept_again_at: float | None = None  # set while accepting is paused
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kv-tcp-listen-{self.port}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close every connection still in its handshake, join the thread."""
        self._closing = True
        self._wake_w.send(b"\0")
        self._thread.join()
        for p in self._pending.values():
            p.sock.close()
        self._pending.clear()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _run(self) -> None:
        while not self._closing:
            events = self._selector.select(self._wait_s(time.monotonic()))
            for key, _ in events:
                if key.fileobj is self._listener:
                    self._accept()
                elif key.data is not None:
                    self._read(key.data)
            now = time.monotonic()
            self._expire(now)
            if self._accept_again_at is not None and now >= self._accept_again_at:
                self._accept_again_at = None
                self._selector.register(self._listener, selectors.EVENT_READ)
            self._warn(now)

    def _wait_s(self, now: float) -> float | None:
        """How long the selector may sleep: until the next deadline, accept retry or warning."""
        first = next(iter(self._pending.values()), None)  # the first expires first
        times = [first.deadline] if first is not None else []
        if self._accept_again_at is not None:
            times.append(self._accept_again_at)
        if self._evicted or self._expired:
            times.append(self._last_warning + _LOG_EVERY_S)
        return max(0.0, min(times) - now) if times else None

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):  # then reads get their turn; the rest next round
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: a listener that stays readable
                log.warning("kv transfer listener on port %d: accept failed (%s); retrying in "
                            "%g s", self.port, e, _ACCEPT_RETRY_S)
                self._selector.unregister(self._listener)
                self._accept_again_at = time.monotonic() + _ACCEPT_RETRY_S
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            address = addr[0]
            waiting = self._by_address.get(address, {})
            if len(waiting) >= self.max_per_address:
                self._evict(self._pending[next(iter(waiting))],
                            f"at most {self.max_per_address} from {address}")
            elif len(self._pending) >= self.max_pending:
                self._evict(next(iter(self._pending.values())), f"at most {self.max_pending}")
            challenge = auth.nonce()
            if self._send(sock, {"nonce": challenge}):
                p = _Pending(sock, address, f"{address}:{addr[1]}", challenge,
                             time.monotonic() + self.timeout_s)
                self._pending[sock] = p
                self._by_address.setdefault(address, {})[sock] = None
                self._selector.register(sock, selectors.EVENT_READ, p)

    def _evict(self, p: _Pending, cap: str) -> None:
        """Close the oldest waiting connection to make room for a new one."""
        self._forget(p)
        self._send(p.sock, {"error": f"too many connections awaiting their handshake ({cap}): "
                                     "this one, the oldest, was closed to make room; try again"})
        p.sock.close()
        self._evicted += 1

    @staticmethod
    def _send(sock: socket.socket, message: dict) -> bool:
        """Send a small message without blocking; False (and the socket closed) if it did
        not all fit in the socket's buffer, which only a peer that reads nothing causes."""
        data = msgpack.packb(message)
        data = LENGTH.pack(len(data)) + data
        try:
            sent = sock.send(data)
        except OSError:
            sent = 0
        if sent != len(data):
            sock.close()
            return False
        return True

    def _read(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(p.missing())
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._drop(p, f"ended: {e}")
        if not chunk:
            return self._drop(p, "closed by the sender during the handshake")
        p.hello += chunk
        if len(p.hello) == LENGTH.size and p.missing() > MAX_HELLO:
            return self._drop(p, f"announced a hello of {p.missing()} bytes (at most "
                                 f"{MAX_HELLO}); closed")
        if len(p.hello) >= LENGTH.size and p.missing() == 0:
            self._forget(p)
            self._answer(p)

    def _answer(self, p: _Pending) -> None:
        """Check a complete hello: hand the connection on, or say why not and hang up."""
        try:
            hello = unpack_message(p.hello[LENGTH.size:])
        except ConnectionError as e:
            log.debug("kv transfer connection from %s: %s", p.sender, e)
            p.sock.close()
            return
        theirs, their_proof = hello.get("nonce"), hello.get("proof")
        if not (isinstance(theirs, bytes) and isinstance(their_proof, bytes) and
                hmac.compare_digest(their_proof,
                                    auth.proof(self._key, b"sender", theirs, p.challenge))):
            log.warning("refused kv transfer connection from %s: it did not prove it holds "
                        "the deployment's transfer key", p.sender)
            self._send(p.sock, {"error": "not authenticated: the sender does not hold this "
                                         "deployment's engine key"})
            p.sock.close()
            return
        try:
            error = self._layout.mismatch(KVLayout.from_dict(hello.get("layout")))
        except (KeyError, TypeError, AttributeError):
            error = "malformed handshake: expected a KV layout"
        proof = auth.proof(self._key, b"receiver", p.challenge, theirs)
        if not self._send(p.sock, {"error": error, "proof": proof}):
            return
        if error is not None:
            log.warning("refused kv transfer connection from %s: %s", p.sender, error)
            p.sock.close()
            return
        p.sock.setblocking(True)
        try:
            self._on_ready(p.sock, p.sender)
        except Exception:  # the listener thread must outlive it
            log.exception("kv transfer connection from %s could not be served", p.sender)
            p.sock.close()

    def _expire(self, now: float) -> None:
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._forget(p)
            p.sock.close()
            self._expired += 1

    def _drop(self, p: _Pending, why: str) -> None:
        log.debug("kv transfer connection from %s %s", p.sender, why)
        self._forget(p)
        p.sock.close()

    def _forget(self, p: _Pending) -> None:
        self._selector.unregister(p.sock)
        del self._pending[p.sock]
        waiting = self._by_address[p.address]
        del waiting[p.sock]
        if not waiting:
            del self._by_address[p.address]

    def _warn(self, now: float) -> None:
        if not (self._evicted or self._expired) or now - self._last_warning < _LOG_EVERY_S:
            return
        log.warning("kv transfer listener on port %d: closed %d connections to make room (at "
                    "most %d await their handshake, %d from one address) and %d that sent no "
                    "hello within %g s", self.port, self._evicted, self.max_pending,
                    self.max_per_address, self._expired, self.timeout_s)
        self._evicted = self._expired = 0
        self._last_warning = now
