"""The tcp KV listener's bounds (kvcache/transfer/tcp_listener.py): a total handshake deadline,
caps on connections awaiting their hello (in all and per address), and no thread for a
connection that has not proved the key, while the deployment's own senders still get in."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from test_transfer import DST, KEY, LAYOUT, RECV_PAGES, SRC, _hung_up, sender_pool

from kvcache.transfer import tcp_wire
from kvcache.transfer.tcp import TcpBackend, TcpPeer
from kvcache.transfer.tcp_listener import MAX_PENDING, MAX_PENDING_PER_ADDRESS

DEADLINE_S = 1.0


@pytest.fixture
def backend():
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY, handshake_timeout_s=DEADLINE_S)
    yield backend
    backend.close()


def dial(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def test_a_hello_sent_a_byte_at_a_time_is_cut_at_the_total_deadline(backend):
    """Each byte comes well within the deadline (as one every 8 s did within the old per-read
    10 s); the connection is still closed DEADLINE_S after it was accepted."""
    sock = dial(backend.port)
    start = time.monotonic()
    assert "nonce" in tcp_wire.recv_message(sock)
    sock.settimeout(0.25)
    closed_at = None
    for byte in tcp_wire.LENGTH.pack(200) + bytes(200):  # a hello that never ends in time
        try:
            sock.send(bytes([byte]))
            if sock.recv(1) == b"":
                closed_at = time.monotonic() - start
                break
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            closed_at = time.monotonic() - start
            break
    assert closed_at is not None and DEADLINE_S - 0.05 <= closed_at < DEADLINE_S + 0.5, closed_at
    sock.close()


def threads_named(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def evicted(sock: socket.socket) -> str:
    """The reason a connection closed to make room was given (after its challenge)."""
    message = tcp_wire.recv_message(sock)
    if "nonce" in message:  # not read yet
        message = tcp_wire.recv_message(sock)
    assert _hung_up(sock)
    return message["error"]


def test_waiting_hellos_take_no_thread_and_the_oldest_makes_room_past_a_cap(backend):
    before = threading.active_count()
    # One address: past MAX_PENDING_PER_ADDRESS its oldest connection is told why and closed.
    held = [dial(backend.port) for _ in range(MAX_PENDING_PER_ADDRESS + 1)]
    assert evicted(held.pop(0)) == (
        f"too many connections awaiting their handshake (at most {MAX_PENDING_PER_ADDRESS} "
        "from 127.0.0.1): this one, the oldest, was closed to make room; try again")
    # Other addresses fill the listener up to MAX_PENDING, and one more closes the oldest.
    for i in range(MAX_PENDING - MAX_PENDING_PER_ADDRESS + 1):
        held.append(dial(backend.port, f"127.0.1.{i // MAX_PENDING_PER_ADDRESS + 1}"))
    assert evicted(held.pop(0)) == (
        f"too many connections awaiting their handshake (at most {MAX_PENDING}): this one, the "
        "oldest, was closed to make room; try again")
    assert all("nonce" in tcp_wire.recv_message(s) for s in held)
    assert threading.active_count() == before  # 128 waiting hellos, no thread for any
    # Full, and still the deployment's sender gets in (the oldest waiting connection makes
    # room) and writes.
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    w = backend.open_window()
    peer.write(w, 0, SRC, DST)
    peer.flush(w)
    assert torch.count_nonzero(backend.kv) > 0
    assert len(threads_named("kv-tcp-conn")) == 1  # the authenticated sender's own
    peer.close()
    assert evicted(held.pop(0)).startswith("too many connections awaiting their handshake")
    # At the deadline every one still waiting is closed.
    time.sleep(DEADLINE_S + 0.3)
    assert sum(_hung_up(s) for s in held) == len(held) == MAX_PENDING - 1
    time.sleep(0.1)  # the sender's connection thread ends
    assert threading.active_count() == before
    for s in held:
        s.close()


def test_a_sender_gets_in_while_slow_hellos_wait(backend):
    """Waiting hellos below the caps delay nobody: the handshake of the deployment's sender
    runs beside them on the listener's thread."""
    held = [dial(backend.port, f"127.0.2.{i % 8 + 1}") for i in range(100)]
    for s in held:
        s.sendall(tcp_wire.LENGTH.pack(100) + b"x")  # a hello begun and never finished
    start = time.monotonic()
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    assert time.monotonic() - start < 0.5
    w = backend.open_window()
    peer.write(w, 1, SRC, DST)
    peer.flush(w)
    peer.close()
    for s in held:
        s.close()


def test_a_hello_announcing_more_than_the_limit_is_not_read(backend):
    sock = dial(backend.port)
    tcp_wire.recv_message(sock)
    sock.sendall(tcp_wire.LENGTH.pack(tcp_wire.MAX_HELLO + 1))
    assert _hung_up(sock)
    sock.close()
