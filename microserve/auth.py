"""Bearer-token checks as ASGI middleware (engine and router). No torch.

    app.add_middleware(RequireBearer, guards=[("/admin/", admin_token), ("/", api_key)],
                       open_paths=("/health", "/metrics"))

A request whose path starts with a guarded prefix (the first that matches) needs
`Authorization: Bearer <that token>`; otherwise it gets OpenAI's 401 error JSON. A prefix whose
token is None is closed: every request under it gets a 403. Paths in `open_paths` and paths no
prefix matches pass. Tokens are compared in constant time.

An engine proves to a router that it holds the deployment's engine key without the key
travelling (`engine_proof`): the router sends a fresh random challenge to the engine's open
liveness route, the engine answers HMAC-SHA256 of it under a key derived from the engine key
(its own label: the proof signs nothing else), and the router sends its bearer key only to an
engine whose proof verifies (`proves_key`; router/engines.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from microserve.errors import OpenAIError

OPEN_PATHS = ("/health", "/metrics")
_IDENTITY_LABEL = b"microserve engine identity v1"
MAX_CHALLENGE_CHARS = 128
_CLOSED = object()  # the key of a prefix no token opens


class RequireBearer:
    def __init__(self, app: ASGIApp, guards: Sequence[tuple[str, str | None]],
                 open_paths: Sequence[str] = OPEN_PATHS):
        for prefix, token in guards:
            if token == "":
                raise ValueError(f"the token guarding {prefix!r} must not be empty")
        self.app = app
        self._guards = [(prefix, token.encode() if token is not None else _CLOSED)
                        for prefix, token in guards]
        self._open = tuple(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        key = next((k for prefix, k in self._guards if scope["path"].startswith(prefix)), None)
        if key is None:
            return await self.app(scope, receive, send)
        if key is _CLOSED:
            message = ("This API is closed: no token is configured for it (start the router "
                       "with --admin-token or MICROSERVE_ADMIN_TOKEN)")
            return await OpenAIError(403, message, code="closed").response()(scope, receive, send)
        token = bearer_token(scope)
        if token is not None and hmac.compare_digest(token, key):
            return await self.app(scope, receive, send)
        message = ("Missing API key: send 'Authorization: Bearer <key>'" if token is None
                   else "Incorrect API key provided")
        response = OpenAIError(401, message, code="invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def engine_proof(engine_key: str, challenge: str) -> str:
    """An engine's answer to a router's `challenge`: proof that it holds `engine_key` (hex)."""
    key = hmac.new(engine_key.encode(), _IDENTITY_LABEL, hashlib.sha256).digest()
    return hmac.new(key, challenge.encode(), hashlib.sha256).hexdigest()


def proves_key(engine_key: str, challenge: str, proof: str | None) -> bool:
    """Whether `proof` is the answer to `challenge` of an engine holding `engine_key`."""
    return proof is not None and hmac.compare_digest(proof.encode(),
                                                     engine_proof(engine_key, challenge).encode())
