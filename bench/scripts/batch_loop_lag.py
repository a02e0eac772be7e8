"""How long the router's event loop stalls while a batch starts (issue 42's live TTFT beside a
batch): a 10,000-line file from bench/batch_workload.py is validated and ordered by the real
BatchRunner (router/batches/runner.py) over a real Store, then its pending lines are read, while
a probe coroutine sleeps 1 ms at a time and records how late it wakes. No engine is involved.

    python bench/scripts/batch_loop_lag.py [--lines 10000 --scale 4]

Prints the wall time and the probe's lateness (max, p99, count over 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from fastapi import FastAPI

from bench.batch_workload import workload
from microserve.heap import freeze_startup_heap
from microserve.metrics import Registry
from router.batches.admission import Admission
from router.batches.runner import BatchRunner
from router.batches.store import Store


def stored_batch(store: Store, data: bytes, batch_id: str) -> dict:
    """A `/v1/completions` batch of the JSONL `data`, its file and row in `store`, not yet
    validated (what `POST /v1/batches` leaves for the runner)."""
    made = store.add_file("", "in.jsonl", "batch", data)
    batch = {"id": batch_id, "endpoint": "/v1/completions", "input_file_id": made["id"],
             "status": "validating", "expires_at": time.time() + 3600}
    store.add_batch("", batch)
    return batch


async def main(args) -> None:
    freeze_startup_heap()  # as a router does once started (microserve/http_server.py)
    store = Store(tempfile.mkdtemp(prefix="loop-lag-"))
    runner = BatchRunner(store, FastAPI, None, Registry(), Admission(2, lambda: 1), None)
    data = "".join(json.dumps(x) + "\n"
                   for x in workload(args.lines, 8, 128000, 0, args.scale)).encode()
    batch = stored_batch(store, data, "batch-lag")
    late: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - start - 0.001)

    task = asyncio.create_task(probe())
    start = time.perf_counter()
    await runner._validate(batch)
    await asyncio.to_thread(store.pending, batch["id"])
    wall = time.perf_counter() - start
    done.set()
    await task
    store.close()
    late.sort()
    print(f"{args.lines} lines: validate + pending {wall:.2f} s; event loop late by max "
          f"{late[-1] * 1e3:.0f} ms, p99 {late[int(len(late) * 0.99)] * 1e3:.1f} ms, "
          f"{sum(x > 0.05 for x in late)} of {len(late)} wake-ups over 50 ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--scale", type=int, default=4)
    asyncio.run(main(ap.parse_args()))
