"""The batch API's benchmark (issue 42's targets): one synthetic file run in each order, and
live traffic measured with and without a batch beside it.

    python -m bench.batch_bench --config deploy/gpu-dp.toml --model random:llama-3.1-8b \\
        --lines 10000 [--live-rate 4 --live-requests 200] [--json out.json]

For each --orders entry it starts `microserve up CONFIG --batch-order ORDER` on a fresh data
directory, runs the file from bench/batch_workload.py (--lines, --templates, --scale, --seed)
through the Batch API, and stops the deployment (--engine-arg: more args for every engine,
such as `--engine-arg=--num-pages --engine-arg=8192` to hold the KV pool to what a batch's
shared prefixes outgrow). Then, with --live-rate, one more deployment: bench.serve's live load
alone, then the same load while a batch (blend order) runs. Prints one JSON object:
`orders.ORDER.{wall_s, output_tokens_per_s, prompt_tokens, cached_prompt_tokens,
prefix_sharing_vs_dfs}`, `blend_vs_file`, `blend_vs_dfs` (throughput ratios; `alternate_vs_file`
and `alternate_vs_dfs` with --orders alternate,...), and with live load `live.{alone,
with_batch}` (bench.serve's figures), `ttft_p99_ratio`, `tpot_p99_ratio`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.batch_workload import workload
from launcher.batch_cli import follow, submit

START_TIMEOUT_S = 900


class Deployment:
    """`microserve up` in a child process on its own data directory."""

    def __init__(self, config: str, model: str, port: int, order: str, log: Path,
                 lines_per_engine: int, engine_args: Sequence[str] = ()):
        self.url = f"http://127.0.0.1:{port}/v1"
        self.data = tempfile.mkdtemp(prefix="microserve-batch-bench-")
        self.log = log
        if engine_args:
            config = with_engine_args(config, engine_args, Path(self.data) / "deploy.toml")
        cmd = [sys.executable, "-m", "launcher.cli", "up", config, "--model", model, "--port",
               str(port), "--batch-order", order, "--data-dir", self.data,
               "--batch-lines-per-engine", str(lines_per_engine)]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "microserve up:" not in log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"microserve up did not start; see {log}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(120)
        shutil.rmtree(self.data, ignore_errors=True)


def with_engine_args(config: str, extra: Sequence[str], out: Path) -> str:
    """A copy of the deployment file `config` whose every engine gets `extra` before its own
    args (each `args = [` line of an [[engines]] table)."""
    text = Path(config).read_text()
    engines = len(re.findall(r"^\[\[engines\]\]", text, flags=re.M))
    head = "args = [" + "".join(json.dumps(a) + ", " for a in extra)
    text, n = re.subn(r"^args = \[", lambda _: head, text, flags=re.M)
    if n != engines or not engines:
        raise SystemExit(f"{config}: {engines} [[engines]] tables but {n} `args = [` lines; "
                         "--engine-arg needs one per engine")
    out.write_text(text)
    return str(out)


def run_file(url: str, data: bytes) -> dict:
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60, write=600)) as http:
        batch = submit(http, "bench.jsonl", data)
        started = time.monotonic()
        batch = follow(http, batch)
        wall = time.monotonic() - started
        out = http.get(f"/files/{batch['output_file_id']}/content").text.splitlines()
    usage = [json.loads(x)["response"]["body"]["usage"] for x in out]
    tokens = sum(u["completion_tokens"] for u in usage)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage)
    return {"status": batch["status"], "lines": batch["request_counts"], "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "cached_prompt_tokens": cached,
            "prefix_sharing_vs_dfs": batch["ordering"]["prefix_sharing_vs_dfs"]}


def live(url: str, args, tag: str, prompt_seed: int) -> dict:
    """bench.serve's load at --live-rate; each run gets its own `prompt_seed` (the same lengths
    and arrivals, other token ids), so the second run meets none of the first's prompts cached."""
    out = Path(tempfile.mkdtemp()) / f"live-{tag}.json"
    subprocess.run([sys.executable, "-m", "bench.serve", "--base-url", url, "--num-requests",
                    str(args.live_requests), "--request-rate", str(args.live_rate),
                    "--input-len", args.live_input_len, "--output-len", args.live_output_len,
                    "--vocab", str(args.vocab), "--prompt-seed", str(prompt_seed),
                    "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/gpu-dp.toml")
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--lines", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--scale", type=int, default=1, help="bench/batch_workload.py's --scale")
    ap.add_argument("--templates", type=int, default=8,
                    help="bench/batch_workload.py's --templates (few-shot templates)")
    ap.add_argument("--documents", type=float, default=0.0,
                    help="bench/batch_workload.py's --documents (share of document lines)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="more args for every engine (repeat: --engine-arg=--num-pages "
                         "--engine-arg=8192 holds the KV pool small)")
    ap.add_argument("--orders", default="blend,dfs,file")
    ap.add_argument("--lines-per-engine", type=int, default=256,
                    help="the router's --batch-lines-per-engine (a GPU wants hundreds)")
    ap.add_argument("--live-rate", type=float, default=0.0, help="requests/s (0: no live run)")
    ap.add_argument("--live-requests", type=int, default=200)
    ap.add_argument("--live-input-len", default="256:1024")
    ap.add_argument("--live-output-len", default="64:256")
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(x) + "\n" for x in
                   workload(args.lines, args.templates, args.vocab, args.seed, args.scale,
                            args.documents)).encode()
    result: dict = {"lines": args.lines, "templates": args.templates, "scale": args.scale,
                    "documents": args.documents,
                    "engine_args": args.engine_arg, "orders": {}}
    for order in [o for o in args.orders.split(",") if o]:  # "": the live run alone
        up = Deployment(args.config, args.model, args.port, order,
                        Path(args.logs) / f"batch-bench-{order}.log", args.lines_per_engine,
                        args.engine_arg)
        try:
            result["orders"][order] = run_file(up.url, data)
        finally:
            up.stop()
        print(f"{order}: {result['orders'][order]}", file=sys.stderr, flush=True)
    speed = {k: v["output_tokens_per_s"] for k, v in result["orders"].items()}
    for mine in ("blend", "alternate"):
        for other in ("file", "dfs"):
            if mine in speed and other in speed:
                result[f"{mine}_vs_{other}"] = speed[mine] / speed[other]
    if args.live_rate > 0:
        up = Deployment(args.config, args.model, args.port, "blend",
                        Path(args.logs) / "batch-bench-live.log", args.lines_per_engine,
                        args.engine_arg)
        try:
            alone = live(up.url, args, "alone", 1)
            with httpx.Client(base_url=up.url, timeout=60) as http:
                batch = submit(http, "bench.jsonl", data)
                with_batch = live(up.url, args, "with-batch", 2)
                http.post(f"/batches/{batch['id']}/cancel")
        finally:
            up.stop()
        result["live"] = {"alone": alone, "with_batch": with_batch}
        for key in ("ttft", "tpot"):
            result[f"{key}_p99_ratio"] = with_batch[key]["p99_ms"] / alone[key]["p99_ms"]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
