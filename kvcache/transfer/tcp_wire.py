"""The tcp transfer's wire format (kvcache/transfer/tcp.py): the handshake's messages and the
frames that follow it.

    handshake   sender ← u32 length, msgpack({"nonce": r})
                sender → u32 length, msgpack({"nonce": s, "proof": P("sender", s, r),
                                              "layout": layout dict})
                sender ← u32 length, msgpack({"error": None | message,
                                              "proof": P("receiver", r, s)})
    WRITE       header │ dst slots: int64[n] │ K rows, V rows: dtype[2, n, kv_heads, head_dim]
    SEAL        header │ digest: n bytes    the tokens the window's KV is of (no answer)
    FLUSH       header                      → answered with u32 length, msgpack({"error": ...})
                                              once every earlier frame of the connection is applied
    RENEW       header                      the sender still holds the window's job (no answer)

    header = <u8 op, 3 pad, u32 window index, i64 window tag, i32 layer, u32 n>   (24 bytes)

Everything is little-endian. The header is a multiple of 8 bytes, so one buffer holds a whole
frame and the slots and rows in it are aligned views: the sender gathers rows straight into its
send buffer and the receiver reads a frame with `recv_into`, both without extra copies.
"""

from __future__ import annotations

import socket
import struct

import msgpack
import torch

HEADER = struct.Struct("<B3xIqiI")  # op, window index, window tag, layer, number of slots
LENGTH = struct.Struct("<I")  # prefix of a msgpack message
MAX_MESSAGE = 1 << 20
MAX_HELLO = 4096  # what the listener reads from a connection before it is authenticated
MAX_SEAL = 64  # bytes a SEAL frame may carry
WRITE, FLUSH, RENEW, SEAL = 1, 2, 3, 4


class Buffer:
    """A growable byte buffer that is both a torch tensor (for views) and a memoryview (for
    socket I/O). Grows to the largest frame seen and is reused after that."""

    def __init__(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self.view = memoryview(self.bytes.numpy())

    def reserve(self, nbytes: int) -> None:
        if self.bytes.numel() < nbytes:
            self.bytes = torch.empty(nbytes, dtype=torch.uint8)
            self.view = memoryview(self.bytes.numpy())


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n


def send_message(sock: socket.socket, obj: object) -> None:
    data = msgpack.packb(obj)
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> dict:
    """One length-prefixed msgpack map of at most `limit` bytes. Raises ConnectionError for
    anything else, e.g. when the other side is not a KV transfer endpoint."""
    length = bytearray(LENGTH.size)
    recv_exactly(sock, memoryview(length))
    (n,) = LENGTH.unpack(length)
    if n > limit:
        raise ConnectionError(f"message of {n} bytes exceeds the limit of {limit}")
    data = bytearray(n)
    recv_exactly(sock, memoryview(data))
    return unpack_message(data)


def unpack_message(data: bytes | bytearray) -> dict:
    """A message's msgpack map. Raises ConnectionError if it is not one."""
    try:
        message = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as e:
        raise ConnectionError(f"malformed message: {e}") from None
    if not isinstance(message, dict):
        raise ConnectionError(f"malformed message: expected a map, got {message!r}")
    return message
