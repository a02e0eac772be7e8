"""How many batch lines a second the router's batch runner can start and finish when the
engines answer at once: the runner's own cost per line (the in-process request through an ASGI
app, the line's result committed to the store), without the router's strategy or an engine.

    python -m bench.scripts.batch_dispatch_rate [--lines 3000 --in-flight 256 --answer-ms 50]

A FastAPI app answers every `/v1/completions` line after --answer-ms (an engine's time for a
short line); the real BatchRunner over a real Store dispatches --lines lines in file order, at
most --in-flight at once. Prints lines/s; --in-flight / (--answer-ms / 1000) is the ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from fastapi import FastAPI

from bench.scripts.batch_loop_lag import stored_batch
from microserve.metrics import Registry
from router.batches.admission import Admission
from router.batches.runner import BatchRunner
from router.batches.store import Store


def answering_app(answer_s: float) -> FastAPI:
    app = FastAPI()

    async def completions(body: dict) -> dict:
        await asyncio.sleep(answer_s)
        return {"id": "cmpl-1", "object": "text_completion",
                "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


async def main(args) -> None:
    app = answering_app(args.answer_ms / 1000)
    store = Store(tempfile.mkdtemp(prefix="dispatch-rate-"))
    runner = BatchRunner(store, lambda: app, None, Registry(),
                         Admission(args.in_flight, lambda: 1), None, order="file")
    data = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": [1, 2, 3, i], "max_tokens": 1}}) + "\n"
                   for i in range(args.lines)).encode()
    batch = stored_batch(store, data, "batch-rate")
    await runner._validate(batch)
    start = time.perf_counter()
    await runner._dispatch(batch)
    wall = time.perf_counter() - start
    counts = store.counts(batch["id"])
    store.close()
    print(f"{args.lines} lines, {args.in_flight} in flight, answers after {args.answer_ms} ms: "
          f"{wall:.2f} s, {args.lines / wall:,.0f} lines/s ({counts['done']} done, "
          f"{counts['failed']} failed; ceiling {args.in_flight * 1000 / args.answer_ms:,.0f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--answer-ms", type=float, default=50.0)
    asyncio.run(main(ap.parse_args()))
