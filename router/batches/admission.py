"""Router-side admission of batch lines beside live traffic.

A batch may keep `per_engine` lines in flight on each engine, and every live completion
request in flight takes one of those slots away: under live load the engines' queues hold about
what they would hold without the batch, and the batch fills whatever the live traffic leaves.
One batch line always may run, so a batch finishes under any load. This is the stopgap until
engines schedule by request priority (the scheduling issue): then batch lines go to the engines
at the lowest priority, and live requests preempt them there.

`LiveRequests` (ASGI middleware) counts the live requests: the completion POSTs that do not
carry the runner's header with this process's secret.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

LIVE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
POLL_S = 0.5  # how often a waiting dispatcher looks again (cancel, expiry) without a wakeup


class Admission:
    HEADER = "x-microserve-batch-line"

    def __init__(self, per_engine: int, engines: Callable[[], int]):
        if per_engine < 1:
            raise ValueError(f"batch_lines_per_engine {per_engine} must be at least 1")
        self.per_engine, self._engines = per_engine, engines
        self.secret = secrets.token_hex(16)
        self.live = 0  # written by LiveRequests
        self._changed = asyncio.Event()

    def cap(self) -> int:
        return max(1, self.per_engine * max(1, self._engines()) - self.live)

    def may_start(self, running: int) -> bool:
        return running < self.cap()

    def poke(self) -> None:
        self._changed.set()

    async def changed(self) -> None:
        """Wait until something pokes (a line ended, live traffic changed) or POLL_S passes.
        A caller checks `may_start` and calls this in one turn of the event loop, so a poke
        after the check is not lost. (Waiting on every running line's task instead cost a
        callback on each of them per wait: with 256 lines in flight, a quarter of the
        dispatcher's time.)"""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), POLL_S)
        except TimeoutError:
            pass


class LiveRequests:
    def __init__(self, app: ASGIApp, admission: Admission):
        self.app, self.admission = app, admission
        self._secret = admission.secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] not in LIVE_PATHS
                or (Admission.HEADER.encode(), self._secret) in scope["headers"]):
            return await self.app(scope, receive, send)
        self.admission.live += 1
        self.admission.poke()
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.live -= 1
            self.admission.poke()
