"""`microserve batch run FILE.jsonl`: upload a batch input file to a router, start the batch,
show its progress, and write its output (and error) lines when it ends.

    microserve batch run prompts.jsonl --output results.jsonl
    microserve batch run prompts.jsonl --base-url http://10.0.0.5:8000/v1 --api-key KEY
    microserve batch run prompts.jsonl --up deploy/local-cpu.toml   # a deployment of its own

The endpoint is the `url` of the file's first line. Ctrl-C cancels the batch (what finished is
still written). With --up, the batch runs on a deployment of its own: `microserve up CONFIG`
on a free port and a temporary data directory, stopped when the batch ends. Plain httpx
against the router's OpenAI API; no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
    p.add_argument("--up", default=None, metavar="CONFIG",
                   help="start `microserve up CONFIG` for this batch alone (free port, "
                        "temporary data directory) instead of using --base-url")
    p.add_argument("--output", type=Path, default=None,
                   help="where the output lines go (default: FILE with .output.jsonl)")
    p.add_argument("--errors", type=Path, default=None,
                   help="where the error lines go (default: FILE with .errors.jsonl)")


def _endpoint(name: str, data: bytes) -> str:
    for raw in data.splitlines():
        if raw.strip():
            try:
                return json.loads(raw)["url"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{name}: its first line has no \"url\" to take the batch's "
                                 "endpoint from") from None
    raise ValueError(f"{name} has no lines")


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


def client(base_url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url.rstrip("/"), headers=headers,
                        timeout=httpx.Timeout(30, write=600))


def submit(http: httpx.Client, name: str, data: bytes) -> dict:
    """Upload a batch input file and start its batch; returns the batch object."""
    endpoint = _endpoint(name, data)
    answer = http.post("/files", files={"file": (name, data)}, data={"purpose": "batch"})
    _fail(answer, f"uploading {name}")
    answer = http.post("/batches", json={"input_file_id": answer.json()["id"],
                                         "endpoint": endpoint, "completion_window": "24h"})
    _fail(answer, "creating the batch")
    return answer.json()


def follow(http: httpx.Client, batch: dict, on_progress=None) -> dict:
    """Poll until the batch ends (Ctrl-C cancels it, then waits for that); returns it."""
    try:
        while batch["status"] not in FINAL:
            time.sleep(POLL_S)
            answer = http.get(f"/batches/{batch['id']}")
            _fail(answer, "following the batch")
            batch = answer.json()
            if on_progress is not None:
                on_progress(batch)
    except KeyboardInterrupt:
        print("\nmicroserve: cancelling (what finished is kept)", file=sys.stderr)
        http.post(f"/batches/{batch['id']}/cancel")
        while batch["status"] not in FINAL:
            time.sleep(POLL_S)
            batch = http.get(f"/batches/{batch['id']}").json()
    return batch


def download(http: httpx.Client, batch: dict, output: Path, errors: Path) -> list[Path]:
    """Write the batch's output and error files (those it has); returns where."""
    written = []
    for key, path in (("output_file_id", output), ("error_file_id", errors)):
        if batch.get(key):
            answer = http.get(f"/files/{batch[key]}/content")
            _fail(answer, f"downloading {batch[key]}")
            path.write_bytes(answer.content)
            written.append(path)
    return written


def summary(batch: dict) -> str:
    counts = batch["request_counts"]
    return (f"batch {batch['status']}: {counts['completed']} completed, {counts['failed']} "
            f"failed of {counts['total']}")


@contextlib.contextmanager
def own_deployment(config: str) -> Iterator[str]:
    """`microserve up CONFIG` on a free port and a temporary data directory; yields its base
    URL, and stops it (Ctrl-C, as an operator would) when the block ends."""
    with socket.socket() as probe:  # the router's port; up checks its engines' ports itself
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="microserve-batch-") as data:
        log = Path(data) / "up.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", config,
                                     "--port", str(port), "--data-dir", f"{data}/data"],
                                    stdout=out, stderr=subprocess.STDOUT)
        try:
            print(f"microserve: starting {config} (log: {log})", file=sys.stderr, flush=True)
            while "microserve up:" not in log.read_text(errors="replace"):
                if proc.poll() is not None:
                    raise RuntimeError(f"microserve up {config} exited with {proc.returncode}:"
                                       f"\n{log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            proc.wait()


def run_batch(args: argparse.Namespace) -> int:
    """Submit, follow, download; returns the exit code (0: completed)."""
    if args.up is not None:
        with own_deployment(args.up) as url:
            return _run(args, url)
    return _run(args, args.base_url)


def _run(args: argparse.Namespace, base_url: str) -> int:
    tty = sys.stderr.isatty()
    shown = ""

    def show(batch: dict) -> None:
        nonlocal shown
        line = _progress(batch, started)
        # On a terminal the bar redraws in place; in a log, a line when counts change.
        if tty or line.rsplit(" ", 1)[0] != shown.rsplit(" ", 1)[0]:
            print(("\r" if tty else "") + line, end="" if tty else "\n", file=sys.stderr,
                  flush=True)
            shown = line

    with client(base_url, args.api_key) as http:
        batch, started = submit(http, args.file.name, args.file.read_bytes()), time.monotonic()
        print(f"microserve: batch {batch['id']} of {args.file} ({batch['endpoint']})",
              file=sys.stderr)
        batch = follow(http, batch, show)
        if tty:
            print(file=sys.stderr)
        for path in download(http, batch, args.output or args.file.with_suffix(".output.jsonl"),
                             args.errors or args.file.with_suffix(".errors.jsonl")):
            print(f"microserve: lines in {path}", file=sys.stderr)
    print(f"microserve: {summary(batch)} in {time.monotonic() - started:.1f} s",
          file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1
