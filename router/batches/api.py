"""OpenAI's Files and Batches API on the router (docs/batches.md).

    POST   /v1/files                 multipart: file, purpose=batch         -> file object
    GET    /v1/files                 ?purpose=                              -> list
    GET    /v1/files/{id}            file object;  /content: its bytes
    DELETE /v1/files/{id}            {"id", "object": "file", "deleted": true}
    POST   /v1/batches               {input_file_id, endpoint, completion_window, metadata?}
    GET    /v1/batches               ?after=&limit=  newest first, with has_more
    GET    /v1/batches/{id}          the batch, its request_counts counted from its lines
    POST   /v1/batches/{id}/cancel   -> cancelling (then cancelled)

Everything belongs to the API key that made it: with --api-key set, a file or batch is found
only with the key it was made with (the owner is a hash of the key, never the key). Without a
data directory every route answers 501 saying how to turn the API on. No torch.
"""

from __future__ import annotations

import hashlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from microserve.errors import OpenAIError, from_validation_errors, invalid_request
from router.batches.lines import ENDPOINTS
from router.batches.runner import BatchRunner
from router.batches.store import Store, new_id

MAX_FILE_BYTES = 200 * 1000 * 1000  # OpenAI's limit on a batch input file
MAX_LINES = 50_000  # OpenAI's limit on requests in one batch
UPLOAD_BODY_BYTES = MAX_FILE_BYTES + (1 << 20)  # the multipart body: the file and its framing
COMPLETION_WINDOWS = {"24h": 24 * 3600}
PURPOSES = ("batch",)  # what may be uploaded; outputs are "batch_output"


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


class BatchAPI:
    def __init__(self, store: Store, runner: BatchRunner, api_key: str | None):
        self.store, self.runner = store, runner
        self.owner = hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""

    # -- files ----------------------------------------------------------------------------------

    async def create_file(self, raw: Request) -> JSONResponse:
        try:
            form = await raw.form(max_files=1, max_fields=4)
        except Exception as e:  # not multipart, or malformed
            raise invalid_request(f"Upload the file as multipart/form-data with fields 'file' "
                                  f"and 'purpose' ({e})") from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in PURPOSES:
                raise invalid_request(f"'purpose' must be one of {list(PURPOSES)}, got "
                                      f"{purpose!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise invalid_request("Missing required field 'file' (a file part)", "file")
            data = await upload.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise OpenAIError(413, f"The file is larger than the {MAX_FILE_BYTES} bytes a "
                                  "batch input file may have", param="file",
                                  code="file_too_large")
            lines = sum(1 for line in data.splitlines() if line.strip())
            if lines > MAX_LINES:
                raise invalid_request(f"The file has {lines} lines; a batch input file may "
                                      f"have at most {MAX_LINES}", "file")
            if lines == 0:
                raise invalid_request("The file has no lines", "file")
            made = self.store.add_file(self.owner, upload.filename or "upload.jsonl", purpose,
                                       data)
        finally:
            await form.close()  # the spooled upload's temporary file
        return JSONResponse(made)

    async def list_files(self, purpose: str | None = None) -> JSONResponse:
        return JSONResponse({"object": "list", "data": self.store.files(self.owner, purpose),
                             "has_more": False})

    async def get_file(self, file_id: str) -> JSONResponse:
        return JSONResponse(self._file(file_id))

    async def file_content(self, file_id: str) -> Response:
        self._file(file_id)
        data = self.store.file_path(file_id).read_bytes()
        return Response(data, media_type="application/jsonl")

    async def delete_file(self, file_id: str) -> JSONResponse:
        if not self.store.delete_file(self.owner, file_id):
            raise _no_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    def _file(self, file_id: str) -> dict:
        found = self.store.file(self.owner, file_id)
        if found is None:
            raise _no_file(file_id)
        return found

    # -- batches --------------------------------------------------------------------------------

    async def create_batch(self, raw: Request) -> JSONResponse:
        try:
            body = CreateBatch.model_validate_json(await raw.body())
        except ValidationError as e:
            raise from_validation_errors(e.errors()) from None
        if body.endpoint not in ENDPOINTS:
            raise invalid_request(f"'endpoint' must be one of {list(ENDPOINTS)}, got "
                                  f"{body.endpoint!r}", "endpoint")
        window = COMPLETION_WINDOWS.get(body.completion_window)
        if window is None:
            raise invalid_request(f"'completion_window' must be one of "
                                  f"{list(COMPLETION_WINDOWS)}, got {body.completion_window!r}",
                                  "completion_window")
        source = self.store.file(self.owner, body.input_file_id)
        if source is None:
            raise _no_file(body.input_file_id, "input_file_id")
        if source["purpose"] != "batch":
            raise invalid_request(f"File {body.input_file_id} has purpose "
                                  f"{source['purpose']!r}, not 'batch'", "input_file_id")
        lines = self.store.line_count(body.input_file_id)
        if lines > MAX_LINES:  # checked at upload too; kept for files made before a limit change
            raise invalid_request(f"The input file has {lines} lines; a batch may have at most "
                                  f"{MAX_LINES}", "input_file_id")
        now = int(time.time())
        batch = {
            "id": new_id("batch"), "object": "batch", "endpoint": body.endpoint, "errors": None,
            "input_file_id": body.input_file_id, "completion_window": body.completion_window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None, "expires_at": now + window,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None, "metadata": body.metadata,
            "request_counts": {"total": lines, "completed": 0, "failed": 0}}
        self.store.add_batch(self.owner, batch)
        self.runner.wake()
        return JSONResponse(batch)

    async def get_batch(self, batch_id: str) -> JSONResponse:
        return JSONResponse(self._batch(batch_id))

    async def list_batches(self, after: str | None = None, limit: int = 20) -> JSONResponse:
        if not 1 <= limit <= 100:
            raise invalid_request(f"'limit' must be in [1, 100], got {limit}", "limit")
        found, more = self.store.batches(self.owner, after, limit)
        data = [self._counted(b) for b in found]
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    async def cancel_batch(self, batch_id: str) -> JSONResponse:
        batch = self._batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self.store.update_batch(batch)
            self.runner.cancel(batch_id)
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise OpenAIError(409, f"Batch {batch_id} is {batch['status']}: only a validating "
                              "or in_progress batch can be cancelled", param="batch_id")
        return JSONResponse(batch)

    def _batch(self, batch_id: str) -> dict:
        batch = self.store.batch(self.owner, batch_id)
        if batch is None:
            raise OpenAIError(404, f"No batch found with id '{batch_id}'", param="batch_id",
                              code="not_found")
        return self._counted(batch)

    def _counted(self, batch: dict) -> dict:
        """The batch with request_counts as its lines stand now (done, failed, total)."""
        if self.store.has_lines(batch["id"]):
            counts = self.store.counts(batch["id"])
            batch["request_counts"] = {"total": sum(counts.values()),
                                       "completed": counts["done"], "failed": counts["failed"]}
        return batch


def _no_file(file_id: str, param: str = "file_id") -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param=param, code="not_found")


async def _disabled(raw: Request) -> None:
    raise OpenAIError(501, "The Files and Batches API is off on this router: start it with "
                      "--data-dir DIR (or set data_dir in the deployment file's [router] "
                      "table; `microserve up` keeps one by default)", code="batches_disabled")


ROUTES = [("/v1/files", "create_file", "POST"), ("/v1/files", "list_files", "GET"),
          ("/v1/files/{file_id}", "get_file", "GET"),
          ("/v1/files/{file_id}/content", "file_content", "GET"),
          ("/v1/files/{file_id}", "delete_file", "DELETE"),
          ("/v1/batches", "create_batch", "POST"), ("/v1/batches", "list_batches", "GET"),
          ("/v1/batches/{batch_id}", "get_batch", "GET"),
          ("/v1/batches/{batch_id}/cancel", "cancel_batch", "POST")]


def add_batch_routes(app: FastAPI, api: BatchAPI | None) -> None:
    """The routes over `api`, or, with None (no data directory), a 501 on each."""
    for path, name, method in ROUTES:
        app.add_api_route(path, getattr(api, name) if api else _disabled, methods=[method])
