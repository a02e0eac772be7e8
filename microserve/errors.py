"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

400 invalid_request_error  a bad field (also malformed JSON, which FastAPI would answer with 422),
                           or a request the backend refused (RequestRejected)
404 invalid_request_error  unknown model (code model_not_found, as OpenAI answers) or route
503 server_error           the backend cannot take the request now (BackendUnavailable); with
                           a Retry-After header when the backend says when to come back
4xx/5xx                    a microserving call's own status and message (MicroservingError), so
                           an engine's refusal reaches a router's client unchanged
500 server_error           anything else; details go to the log, not to the client (a
                           BackendError's message is shown: it says what failed). The server
                           closes the connection after it (microserve/http_server.py)
499 (no body)              the client went away while sending its body (or was cut off at the
                           body deadline): counted as 499 in the metrics, nginx's "client
                           closed request", and logged in one line, not as a 500
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from microserve.backend import BackendError, BackendUnavailable, MicroservingError, RequestRejected

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before its answer


class OpenAIError(Exception):
    """An error a handler raises to answer with OpenAI's error JSON."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message, self.type, self.param, self.code = message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = None if self.retry_after is None else {"Retry-After": str(self.retry_after)}
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist", param="model",
                       code="model_not_found")


def backend_unavailable(exc: BaseException) -> OpenAIError:
    return OpenAIError(503, f"Service unavailable: {exc}", type="server_error",
                       code="service_unavailable", retry_after=getattr(exc, "retry_after", None))


def internal_error(exc: BaseException) -> OpenAIError:
    return OpenAIError(500, f"Internal server error ({type(exc).__name__})", type="server_error")


def as_openai_error(exc: BaseException) -> OpenAIError:
    """The error a client gets for `exc`, wherever it was raised (handler or mid-stream)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, MicroservingError):
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return OpenAIError(exc.status, str(exc), type=kind, param=exc.param, code=exc.code,
                           retry_after=exc.retry_after)
    if isinstance(exc, BackendUnavailable):
        return backend_unavailable(exc)
    if isinstance(exc, RequestRejected):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, BackendError):
        return OpenAIError(500, f"Internal server error: {exc}", type="server_error")
    return internal_error(exc)


def _param_path(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _shown(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


def from_validation_errors(errors: Sequence[dict]) -> OpenAIError:
    """The first of pydantic's errors as a 400 naming the field and the value received."""
    error = errors[0]
    kind, loc = error.get("type"), tuple(error.get("loc", ()))
    if kind == "json_invalid":
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        detail = error.get("ctx", {}).get("error", "not JSON")
        return invalid_request(f"Malformed JSON body{where}: {detail}")
    param = _param_path(loc)
    if kind == "missing":
        return invalid_request(f"Missing required field '{param}'" if param
                               else "The request body is missing", param)
    reason = error.get("msg", "invalid value").removeprefix("Value error, ")
    if kind == "unexpected_keyword_argument":  # a dataclass's word for it (microserve.messages)
        reason = "Extra inputs are not permitted"
    if param is None:
        return invalid_request(f"Invalid request body: {reason}")
    return invalid_request(
        f"Invalid value for '{param}': {reason} (got {_shown(error.get('input'))})", param)


async def _known_error(request: Request, exc: Exception) -> JSONResponse:
    return as_openai_error(exc).response()


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation_errors(exc.errors()).response()


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # Starlette's own 404 (unknown route) and 405 (wrong method), in OpenAI's shape.
    return OpenAIError(exc.status_code, str(exc.detail)).response()


async def _client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    # Nobody reads this answer (uvicorn drops it): its status is for the request metrics.
    log.info("%s %s: the client went away while sending its body", request.method,
             request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # No logging here: Starlette re-raises after sending this, and the server logs the traceback.
    return internal_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    """Make every error `app` returns an OpenAI error JSON."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    for known in (OpenAIError, MicroservingError, BackendUnavailable, RequestRejected,
                  BackendError):
        app.add_exception_handler(known, _known_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _unexpected_error)
