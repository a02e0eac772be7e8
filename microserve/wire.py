"""Length-prefixed msgpack frames over a byte stream (engine core <-> its frontend).

    frame = 4-byte big-endian length | msgpack body
"""

from __future__ import annotations

import struct

import msgpack

_HEADER = struct.Struct(">I")


def encode(msg) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes as they arrive; get whole messages out."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        out, pos = [], 0
        while len(self._buf) - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf, pos)
            if len(self._buf) - pos - _HEADER.size < n:
                break
            start = pos + _HEADER.size
            out.append(msgpack.unpackb(self._buf[start : start + n], raw=False))
            pos = start + n
        del self._buf[:pos]
        return out
