"""Length-prefixed msgpack frames over a byte stream: the engine core <-> its frontend, and
start_generate's msgpack stream.

    frame = 4-byte big-endian length | msgpack body

Bodies are encoded by msgspec, so a frame may hold the typed messages of microserve/messages/
(dataclasses and structs) as well as plain data; a decoder given a type decodes each frame into
it (checking it as it goes), and into plain data without one.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

_HEADER = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    body = _encoder.encode(msg)
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes as they arrive; get whole messages out, as `type` (default: plain data)."""

    def __init__(self, type: Any = Any):
        self._buf = bytearray()
        self._decoder = msgspec.msgpack.Decoder(type)

    def feed(self, data: bytes) -> list:
        self._buf += data
        out, pos = [], 0
        while len(self._buf) - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf, pos)
            if len(self._buf) - pos - _HEADER.size < n:
                break
            start = pos + _HEADER.size
            out.append(self._decoder.decode(self._buf[start : start + n]))
            pos = start + n
        del self._buf[:pos]
        return out
