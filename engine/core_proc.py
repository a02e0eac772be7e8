"""The engine-core process: the step loop, fed by messages from the frontend process.

Why a separate process: the step loop must never wait on HTTP parsing, JSON, tokenization or
detokenization (vLLM once spent 62% of an H100 decode step outside the GPU). The frontend
(engine/core_client.py, an asyncio process) does all of that and talks to this loop over one
Unix socket of length-prefixed msgpack frames (microserve/wire.py):

    frontend -> core: add, abort, call (stats, check_integrity), shutdown
    core -> frontend: ready | error (once), outputs (one frame per step, all requests), reply

Between steps the loop drains whatever messages have arrived without blocking; when it has no
work it blocks on the socket. When the frontend goes away (EOF), the core exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import socket
import sys
import traceback

from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.backend import RequestRejected
from microserve.types import SamplingParams
from microserve.wire import FrameDecoder, encode

log = logging.getLogger("microserve.core")


class CoreLoop:
    def __init__(self, core: EngineCore, sock: socket.socket):
        self.core = core
        self.sock = sock
        self.decoder = FrameDecoder()
        self.running = True

    def send(self, msg) -> None:
        self.sock.sendall(encode(msg))

    def run(self) -> None:
        was_busy = False
        while self.running:
            busy = self.core.has_work()
            if was_busy and not busy:
                self.core.check_integrity()  # cheap, and catches leaks right where they start
            was_busy = busy
            self._receive(block=not busy)
            if self.running and self.core.has_work():
                outputs = self.core.step()
                if outputs:
                    self.send({"type": "outputs", "items": [o.to_wire() for o in outputs]})

    def _receive(self, block: bool) -> None:
        ready, _, _ = select.select([self.sock], [], [], None if block else 0)
        if not ready:
            return
        data = self.sock.recv(1 << 20)
        if not data:  # the frontend is gone: nobody to serve
            self.running = False
            return
        for msg in self.decoder.feed(data):
            self._handle(msg)

    def _handle(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "add":
            try:
                params = SamplingParams.from_dict(msg["params"])
                self.core.add_request(msg["request_id"], msg["prompt"], params)
            except RequestRejected as e:
                self.send({"type": "rejected", "request_id": msg["request_id"],
                           "message": str(e), "param": e.param})  # fmt: skip
        elif kind == "abort":
            out = self.core.abort_request(msg["request_id"])
            if out is not None:
                self.send({"type": "outputs", "items": [out.to_wire()]})
        elif kind == "call":
            self._call(msg)
        elif kind == "shutdown":
            self.running = False
        else:
            log.error("unknown message type %r", kind)

    def _call(self, msg: dict) -> None:
        reply = {"type": "reply", "id": msg["id"], "result": None, "error": None}
        try:
            if msg["method"] == "stats":
                reply["result"] = self.core.stats()
            elif msg["method"] == "check_integrity":
                self.core.check_integrity()
                reply["result"] = True
            else:
                reply["error"] = f"unknown method {msg['method']!r}"
        except AssertionError as e:
            reply["error"] = f"integrity check failed: {e}"
        self.send(reply)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="microserve engine core (started by the frontend)")
    ap.add_argument("--fd", type=int, required=True, help="connected Unix socket to the frontend")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MICROSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s core: %(message)s",
    )
    sock = socket.socket(fileno=args.fd)
    try:
        core = EngineCore(EngineConfig(**json.loads(args.config)))
    except Exception as e:  # report why start-up failed, then exit non-zero
        traceback.print_exc()
        sock.sendall(encode({"type": "error", "message": f"{type(e).__name__}: {e}"}))
        return 1
    sock.sendall(encode({"type": "ready", "info": core.info.to_dict()}))
    CoreLoop(core, sock).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
