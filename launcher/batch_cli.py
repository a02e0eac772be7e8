"""`microserve batch run FILE.jsonl`: upload a batch input file to a router, start the batch,
show its progress, and write its output (and error) lines when it ends.

    microserve batch run prompts.jsonl --output results.jsonl
    microserve batch run prompts.jsonl --base-url http://10.0.0.5:8000/v1 --api-key KEY

The endpoint is the `url` of the file's first line. Ctrl-C cancels the batch (what finished is
still written). Plain httpx against the router's OpenAI API; no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
POLL_S = 0.5
FINAL = ("completed", "failed", "cancelled", "expired")


def batch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="the batch input file (OpenAI's JSONL: custom_id, "
                                           "method, url, body)")
    p.add_argument("--base-url", default=os.environ.get("MICROSERVE_BASE_URL", DEFAULT_BASE_URL),
                   help="the router's OpenAI API (default: $MICROSERVE_BASE_URL or "
                        f"{DEFAULT_BASE_URL})")
    p.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"),
                   help="the router's --api-key (default: $MICROSERVE_API_KEY)")
    p.add_argument("--output", type=Path, default=None,
                   help="where the output lines go (default: FILE with .output.jsonl)")
    p.add_argument("--errors", type=Path, default=None,
                   help="where the error lines go (default: FILE with .errors.jsonl)")


def _endpoint(path: Path) -> str:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return json.loads(raw)["url"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}: its first line has no \"url\" to take the "
                                     "batch's endpoint from") from None
    raise ValueError(f"{path} has no lines")


def _fail(answer: httpx.Response, what: str) -> None:
    if answer.status_code >= 400:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text
        raise ValueError(f"{what}: {answer.status_code} {message}")


def _progress(batch: dict, started: float) -> str:
    counts = batch["request_counts"]
    done = counts["completed"] + counts["failed"]
    total = max(counts["total"], 1)
    bar = "#" * (30 * done // total)
    return (f"[{bar:<30}] {done}/{counts['total']} ({counts['failed']} failed) "
            f"{batch['status']} {time.monotonic() - started:.0f}s")


def run_batch(args: argparse.Namespace) -> int:
    """Submit, follow, download; returns the exit code (0: completed)."""
    endpoint = _endpoint(args.file)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tty = sys.stderr.isatty()
    with httpx.Client(base_url=args.base_url.rstrip("/"), headers=headers,
                      timeout=httpx.Timeout(30, write=600)) as http:
        with open(args.file, "rb") as f:
            answer = http.post("/files", files={"file": (args.file.name, f)},
                               data={"purpose": "batch"})
        _fail(answer, f"uploading {args.file}")
        file_id = answer.json()["id"]
        answer = http.post("/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                             "completion_window": "24h"})
        _fail(answer, "creating the batch")
        batch, started, shown = answer.json(), time.monotonic(), ""
        print(f"microserve: batch {batch['id']} of {args.file} ({endpoint})", file=sys.stderr)
        try:
            while batch["status"] not in FINAL:
                time.sleep(POLL_S)
                answer = http.get(f"/batches/{batch['id']}")
                _fail(answer, "following the batch")
                batch = answer.json()
                line = _progress(batch, started)
                # On a terminal the bar redraws in place; in a log, a line when counts change.
                if tty or line.rsplit(" ", 1)[0] != shown.rsplit(" ", 1)[0]:
                    print(("\r" if tty else "") + line, end="" if tty else "\n",
                          file=sys.stderr, flush=True)
                    shown = line
        except KeyboardInterrupt:
            print("\nmicroserve: cancelling (what finished is kept)", file=sys.stderr)
            http.post(f"/batches/{batch['id']}/cancel")
            while batch["status"] not in FINAL:
                time.sleep(POLL_S)
                batch = http.get(f"/batches/{batch['id']}").json()
        if tty:
            print(file=sys.stderr)
        for key, path in (("output_file_id", args.output or args.file.with_suffix(
                ".output.jsonl")), ("error_file_id", args.errors or args.file.with_suffix(
                    ".errors.jsonl"))):
            if batch.get(key):
                answer = http.get(f"/files/{batch[key]}/content")
                _fail(answer, f"downloading {batch[key]}")
                path.write_bytes(answer.content)
                print(f"microserve: {key.split('_')[0]} lines in {path}", file=sys.stderr)
    counts = batch["request_counts"]
    print(f"microserve: batch {batch['status']}: {counts['completed']} completed, "
          f"{counts['failed']} failed of {counts['total']} in "
          f"{time.monotonic() - started:.1f} s", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1
