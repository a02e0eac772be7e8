"""Ending the token stream of an engine the pool marked down (router/engine_handle.py uses it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from microserve.backend import BackendUnavailable
from microserve.messages import GenerateChunk

if TYPE_CHECKING:
    from router.engine_handle import EngineHandle


class StreamWatch:
    """Gives up an engine's token stream when the pool marks the engine down.

    A stream from an engine cut off from the network (no FIN, no RST) would wait for its next
    chunk for as long as TCP keeps the connection (hours); the pool's liveness probe notices
    within its liveness timeout. One waiter task per stream, nothing per chunk: when the engine goes
    down while the stream awaits its next chunk, the awaiting task is cancelled there and the
    stream raises BackendUnavailable (the way asyncio.timeout turns its cancel into a
    TimeoutError); when it goes down between chunks, the next read raises it. An engine taken
    out of the pool (its event is set too) is not down: its streams go on."""

    def __init__(self, engine: EngineHandle, down: asyncio.Event | None):
        """`engine`'s stream, watched through `down` (the pool's down_event for it)."""
        self._engine = engine
        self._reader: asyncio.Task | None = None  # the task awaiting a chunk, while it does
        self._engine_down = False  # set by the waiter
        self._cancelled = False  # set by the waiter when it cancelled the reader
        # down is None when the engine already left the pool: nothing to watch.
        self._waiter = (asyncio.ensure_future(self._cancel_reader_when_down(down))
                        if down is not None else None)

    async def _cancel_reader_when_down(self, down: asyncio.Event) -> None:
        await down.wait()
        if self._engine.up:  # removed from the pool, not down
            return
        self._engine_down = True
        if self._reader is not None:
            self._cancelled = True
            self._reader.cancel()

    async def chunks(self, stream: AsyncIterator[GenerateChunk], why: str
                     ) -> AsyncIterator[GenerateChunk]:
        while True:
            if self._engine_down:
                raise BackendUnavailable(why)
            self._reader = asyncio.current_task()
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # Ours alone (no other cancel pending, e.g. the client's): the engine is down.
                if self._cancelled and self._reader.uncancel() == 0:
                    raise BackendUnavailable(why) from None
                raise
            finally:
                self._reader = None
            yield chunk

    async def aclose(self) -> None:
        """Stop watching (when the stream ends, however it ends)."""
        if self._waiter is not None:
            self._waiter.cancel()
            await asyncio.gather(self._waiter, return_exceptions=True)
