"""The OpenAI server's ASGI middleware: a bound on request bodies, and requests counted by
endpoint and status (microserve/openai/app.py installs both)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from microserve.errors import OpenAIError
from microserve.metrics import Counter

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/version")


class CountRequests:
    """ASGI middleware: counts responses by endpoint and status (500 if none was sent)."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.counter.inc(endpoint=endpoint, status=str(status))


MAX_BODY_BYTES = 32 << 20  # a 128k-token prompt is about 1 MB of JSON; anything far past it is not


class LimitBody:
    """ASGI middleware: a request body larger than `max_bytes` gets a 413 instead of being read
    into memory (checked on Content-Length first, then as the body streams in)."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES,
                 larger: dict[str, int] | None = None):
        """`larger`: paths whose bodies may be this large instead (uploads)."""
        self.app, self.default_bytes = app, max_bytes
        self.larger = larger or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.larger.get(scope["path"], self.default_bytes)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            error = self._too_large(length.decode(errors="replace"), max_bytes)
            return await error.response()(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > max_bytes:  # raised where the handler reads: answered as a 413
                raise self._too_large(f"more than {max_bytes}", max_bytes)
            return message

        await self.app(scope, counting_receive, send)

    @staticmethod
    def _too_large(length: str, max_bytes: int) -> OpenAIError:
        return OpenAIError(413, f"The request body ({length} bytes) is larger than the "
                           f"{max_bytes} bytes this server accepts", code="body_too_large")
