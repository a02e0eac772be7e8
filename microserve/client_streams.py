"""Responses that notice their client going away: the OpenAI frontend's and the microserving
API's (engine/frontend/microserving_api.py) long calls and streams.

    try:
        result = await unless_disconnected(request.receive, work)   # work cancelled if it goes
    except ClientDisconnected:
        ...                                                        # abort what work started
    return EventStream(events)   # a streamed body whose generator is closed when it goes

Closing or cancelling the work is what runs its cleanup, which aborts the request in the
backend: nothing is left running for a client that is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was complete."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    uvicorn never cancels a handler whose client went away; it only answers the next
    `receive()` (the body has been read by now) with http.disconnect. So we wait for that
    alongside the work.

    Raises:
        ClientDisconnected: the client went away; `work` was cancelled and finished its cleanup.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait((work_task,))  # its cleanup sends the backend abort
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class EventStream(StreamingResponse):
    """A streamed response (SSE unless told otherwise) that stops, and closes its event
    generator, when the client goes away.

    Closing the generator deterministically (not at garbage collection) is what runs the
    generation's cleanup, which aborts the request in the backend.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        try:
            await unless_disconnected(receive, self._send_events(send))
        except ClientDisconnected:
            pass
        finally:
            await self.body_iterator.aclose()

    async def _send_events(self, send: Send) -> None:
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
