"""The batch runner: one background task that takes batches in the order they were created,
validates and orders each one's lines, runs them through the router's own app, and writes the
output and error files.

    validating ──> in_progress ──> finalizing ──> completed
         │              │ cancel ──> cancelling ──> cancelled     (what finished is kept)
         │              └ past expires_at ──────> expired       (the rest: batch_expired)
         └ the input file is gone ──> failed

A line runs as an in-process HTTP request to the router's ASGI app (`httpx.ASGITransport`):
the same middleware, validation, strategy and engines a client's request takes, without a
socket. Its result is committed to the store before it counts; a router restarted mid-batch
picks up the `pending` rows where it left them (router/batches/store.py).

Batch lines are filler: at most `batch_lines_per_engine` per engine run at once, and every live
completion request in flight takes one of those slots (`Admission`), so the engines' queues stay about as short as
they would be without the batch. When engines get request priorities (the scheduling issue),
batch lines will go to them at the lowest priority instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from collections.abc import Callable

import httpx

from microserve.bounds import BACKGROUND_PRIORITY
from microserve.metrics import Registry
from microserve.openai.responses_api import ResponsesRequest, chat_request
from microserve.tokenizer import Tokenizer
from router.batches.admission import Admission
from router.batches.lines import expected_output_tokens, iter_lines, output_line
from router.batches.order import alternate, blend_order, sharing_ratio
from router.batches.store import LineRow, Store

log = logging.getLogger("microserve.batches")

RETRIES = 4  # a 5xx (an engine restarting, overloaded) is tried again this often, with backoff
RETRY_BACKOFF_S = 0.5  # before the first retry; doubling


# Batch lines are filler: at BACKGROUND_PRIORITY an engine gives them only what live requests
# leave of each step (--background-max-seqs/-tokens, under any policy); on engines run with
# `--scheduling-policy priority` a live request (priority 0 unless it says otherwise; lower runs
# first) is also admitted before them and may preempt them.
BATCH_PRIORITY = BACKGROUND_PRIORITY


def at_batch_priority(request: dict) -> dict:
    """A line's body as sent: at BATCH_PRIORITY unless the line chose a priority itself."""
    return request if "priority" in request else {**request, "priority": BATCH_PRIORITY}


class BatchRunner:
    def __init__(self, store: Store, app: Callable, tokenizer: Tokenizer, registry: Registry,
                 admission: Admission, api_key: str | None, order: str = "blend"):
        """`app`: returns the router's ASGI app (built once, on first use); `order`: blend,
        alternate, dfs or file (router/settings.py's batch_order)."""
        self.store, self._app, self.tokenizer, self.order = store, app, tokenizer, order
        self.admission, self.api_key = admission, api_key
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None  # set by start()
        self._cancelled: set[str] = set()  # batch ids to stop dispatching; written by cancel()
        self._lines = registry.gauge("microserve_batch_lines",
                                     "Lines of the batches this router ran since it started, "
                                     "by state as persisted (pending, completed, failed).",
                                     ["batch", "state"])
        self._in_flight = registry.gauge("microserve_batch_lines_running",
                                         "Batch lines running now.")
        self.retry_backoff_s = RETRY_BACKOFF_S

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def wake(self) -> None:
        self._wakeup.set()

    def cancel(self, batch_id: str) -> None:
        """Stop dispatching `batch_id`'s lines now (those running are aborted and stay
        pending); the batch then finalizes as cancelled."""
        self._cancelled.add(batch_id)
        self.admission.poke()
        self.wake()

    async def _loop(self) -> None:
        while True:
            self._wakeup.clear()
            for batch in self.store.unfinished_batches():
                try:
                    await self._run(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one batch's bug must not stop the others
                    log.exception("batch %s failed", batch["id"])
                    self._set(self.store.batch(None, batch["id"]), "failed", errors={
                        "object": "list", "data": [{"code": "internal_error", "line": None,
                                                    "param": None,
                                                    "message": "the router failed running it"}]})
            await self._wakeup.wait()

    # -- one batch ------------------------------------------------------------------------------

    async def _run(self, batch: dict) -> None:
        batch_id = batch["id"]
        if batch["status"] == "cancelling":  # cancelled before a restart
            self._cancelled.add(batch_id)
        if not self.store.has_lines(batch_id):
            if batch_id in self._cancelled:
                await self._finalize(batch, "cancelled")
                return
            if not await self._validate(batch):
                return
        self._show(batch_id)
        if batch["status"] == "in_progress":
            await self._dispatch(batch)
        if batch_id in self._cancelled:
            if batch["status"] != "cancelling":
                self._set(batch, "cancelling")
            await self._finalize(batch, "cancelled")
        elif time.time() >= batch["expires_at"]:
            await self._finalize(batch, "expired")
        else:
            self._set(batch, "finalizing")
            await self._finalize(batch, "completed")
        self._cancelled.discard(batch_id)

    async def _validate(self, batch: dict) -> bool:
        path = self.store.file_path(batch["input_file_id"])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._set(batch, "failed", errors={"object": "list", "data": [{
                "code": "file_not_found", "line": None, "param": "input_file_id",
                "message": f"input file {batch['input_file_id']} was deleted"}]})
            return False
        rows, batch["ordering"] = await asyncio.to_thread(self._read, data, batch["endpoint"])
        batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
        await asyncio.to_thread(self.store.add_lines, batch, rows)
        return True

    def _read(self, data: bytes, endpoint: str) -> tuple[list[tuple], dict]:
        """The file's rows for `Store.add_lines`, each good line placed in the runner's order,
        and what the ordering found (in a worker thread: tokenizing 50,000 prompts takes
        seconds). What stays alive while a large file is read is small and holds no Python
        lists of token ids: the prompts are arrays, each body the bytes the file wrote. A
        garbage collection that walked 10,000 bodies' and prompts' lists of ints held the GIL
        (and the router's event loop, live requests' first tokens with it) 0.1-0.2 s."""
        rows, good, prompts, outputs = [], [], [], []
        for line in iter_lines(data, endpoint):
            if line.body is None:
                result = output_line(line.custom_id, None, None, line.error)
                rows.append((line.idx, -1, line.custom_id, "failed", None, result))
                continue
            good.append((line.idx, line.custom_id, line.raw_body.decode()))
            prompts.append(self._prompt_ids(endpoint, line.body))
            outputs.append(expected_output_tokens(line.body, endpoint))
        ordering = blend_order(prompts, outputs)
        order = {"blend": ordering.order, "alternate": alternate(ordering.dfs),
                 "dfs": ordering.dfs, "file": range(len(good))}[self.order]
        for position, k in enumerate(order):
            idx, custom_id, body = good[k]
            rows.append((idx, position, custom_id, "pending", body, None))
        rows.sort(key=lambda row: row[0])
        return rows, {"order": self.order, "lines": len(good),
                      "dfs_shareable_tokens": ordering.shareable_tokens,
                      "prefix_sharing_vs_dfs": round(sharing_ratio(prompts, ordering, order), 4)}

    def _prompt_ids(self, endpoint: str, body: dict) -> array:
        """The line's prompt as the ordering sees it (32-bit token ids); a prompt the API will
        refuse orders as empty (its line fails when it runs, with the API's own error)."""
        try:
            if endpoint in ("/v1/chat/completions", "/v1/responses"):
                messages = body["messages"] if endpoint == "/v1/chat/completions" else [
                    m.template_dict() for m in
                    chat_request(ResponsesRequest.model_validate(body)).messages]
                text = self.tokenizer.apply_chat_template(messages)
                return array("I", self.tokenizer.encode(text, add_special_tokens=False))
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return array("I", self.tokenizer.encode(prompt))
            return array("I", prompt)
        except Exception:  # any malformed body: the API says what is wrong when it runs
            return array("I")

    async def _dispatch(self, batch: dict) -> None:
        """Run the pending lines in order, as many at once as admission allows; return when all
        finished, or once none is left running after a cancel or the batch's expiry."""
        running: set[asyncio.Task] = set()

        def ended(task: asyncio.Task) -> None:
            running.discard(task)
            self.admission.poke()

        # An exception inside the app is its 500 answer, as a client would get: the line's
        # error, not an exception out of the line's task (which would leave it pending).
        transport = httpx.ASGITransport(app=self._app(), raise_app_exceptions=False)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers[Admission.HEADER] = self.admission.secret
        async with httpx.AsyncClient(transport=transport, base_url="http://router",
                                     headers=headers, timeout=None) as client:
            try:
                for row in await asyncio.to_thread(self.store.pending, batch["id"]):
                    while not self.admission.may_start(len(running)):
                        await self.admission.changed()
                    if self._stop(batch):
                        break
                    task = asyncio.create_task(self._line(client, batch, row))
                    running.add(task)
                    task.add_done_callback(ended)
                    # one line at a time into the loop: a batch's first hundreds of lines,
                    # started at once, would queue every live request behind their router work
                    await asyncio.sleep(0)
                await self._drain(batch, running)
            finally:
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)

    async def _drain(self, batch: dict, running: set[asyncio.Task]) -> None:
        while running:
            if self._stop(batch):
                return  # the finally above cancels what runs; its rows stay pending
            await self.admission.changed()

    def _stop(self, batch: dict) -> bool:
        return batch["id"] in self._cancelled or time.time() >= batch["expires_at"]

    async def _line(self, client: httpx.AsyncClient, batch: dict, row: LineRow) -> None:
        request = at_batch_priority(json.loads(row.request))
        self._in_flight.inc()
        try:
            for attempt in range(RETRIES + 1):
                answer = await client.post(batch["endpoint"], json=request)
                if answer.status_code < 500 or attempt == RETRIES:
                    break
                await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
        finally:
            self._in_flight.dec()
        try:
            body = answer.json()
        except ValueError:
            body = {"error": {"message": answer.text, "type": "server_error"}}
        ok = answer.status_code == 200
        await asyncio.to_thread(self.store.finish_line, batch["id"], row.idx, ok,
                                output_line(row.custom_id, answer.status_code, body))
        self._lines.dec(batch=batch["id"], state="pending")
        self._lines.inc(batch=batch["id"], state="completed" if ok else "failed")

    # -- state ----------------------------------------------------------------------------------

    def _show(self, batch_id: str) -> None:
        """The batch's line gauges from its rows (lines then move one at a time in _line)."""
        counts = self.store.counts(batch_id)
        for state, name in (("pending", "pending"), ("done", "completed"), ("failed", "failed")):
            self._lines.set(counts[state], batch=batch_id, state=name)

    def _set(self, batch: dict, status: str, **fields) -> None:
        batch.update(status=status, **{f"{status}_at": int(time.time())}, **fields)
        self.store.update_batch(batch)

    async def _finalize(self, batch: dict, status: str) -> None:
        """Write the output and error files, then move to `status` (one update: a restart
        before it finalizes again)."""
        if status == "expired":
            expired = {"code": "batch_expired",
                       "message": "the batch expired before this line ran"}
            await asyncio.to_thread(self.store.fail_pending, batch["id"], lambda row: output_line(
                row.custom_id, None, None, expired))
            self._show(batch["id"])
        owner = self.store.owner_of(batch["id"])
        for state, key, name in (("done", "output_file_id", "output"),
                                 ("failed", "error_file_id", "errors")):
            file_id = await asyncio.to_thread(self.store.results_file, owner, batch["id"], state,
                                              f"{batch['id']}_{name}.jsonl")
            if file_id is not None:
                batch[key] = file_id
        self._set(batch, status)

