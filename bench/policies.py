"""Compare scheduling policies: one engine per policy, the same requests at the same times.

    python -m bench.policies --model random:llama-3.1-8b --device cuda \\
        --policies fcfs,mlfq,priority --rates 2,4,8 --num-requests 300 \\
        --workload heavy-tail --json docs/policies.json

For each policy it starts `microserve engine --scheduling-policy P` itself (the other engine
options after `--`, e.g. `-- --gpu-memory-utilization 0.5`), waits for /health, and for each
rate sends bench.serve's workload (same --seed: the same prompts, lengths and Poisson arrival
times for every policy; each rate its own prompt token ids, so that no rate finds the last
one's prompts in the prefix cache) and records its figures; then stops the engine. Under
`priority` each request's priority is its output length (shortest job first; --priority-by
none to send none).
One line per run holds the mean and p99 of JCT, TTFT and TPOT, in ms, and the run's
preemptions, swaps to host memory (with `-- --kv-host-memory-gb N`) and recomputes chosen
over a swap, from the engine's /metrics; --json writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx

from bench.serve import run as serve_run, workload_options
from engine.policies import POLICIES


class Engine:
    """`microserve engine` in a child process (its own process group), stopped on exit."""

    def __init__(self, model: str, policy: str, extra: list[str], log_path: str):
        with socket.socket() as s:  # a free port (the engine binds it right after)
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [sys.executable, "-m", "launcher.cli", "engine", "--model", model,
                    "--port", str(self.port), "--scheduling-policy", policy, *extra]
        self.log = open(log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}  # no auth
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited with status {self.proc.returncode}; "
                                   f"see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the engine was not ready after {timeout_s:g} s; see {self.log.name}")

    # /metrics counters a run's line reports (the run's share: after less before)
    COUNTERS = ("preemptions", "kv_swap_outs", "kv_swap_recomputes")

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text
        values = {}
        for key in self.COUNTERS:
            name = f"microserve_engine_{key}_total "
            values[key] = next((float(l.split()[-1]) for l in text.splitlines()
                                if l.startswith(name)), 0.0)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def line(policy: str, rate: float, r: dict) -> str:
    def f(key):
        q = r.get(key) or {}
        return f"{q.get('mean_ms', float('nan')):9.0f} {q.get('p99_ms', float('nan')):9.0f}"

    c = r.get("engine_counters", {})
    return (f"{policy:9s} {rate:6g} {r['requests'] - r['failed']:5d}/{r['requests']:<5d} "
            f"{f('jct')}  {f('ttft')}  {f('tpot')}  {r['output_tokens_per_s']:8.0f} "
            f"{c.get('preemptions', 0):8.0f} {c.get('kv_swap_outs', 0):6.0f} "
            f"{c.get('kv_swap_recomputes', 0):9.0f}")


HEADER = ("policy      rate    ok/sent   JCT mean   JCT p99  TTFT mean  TTFT p99 TPOT mean "
          " TPOT p99  out tok/s  preempt  swaps recomputes")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policies", default="fcfs,mlfq,priority")
    ap.add_argument("--rates", default="1", help="requests/s, comma-separated")
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--log-dir", default="/tmp", help="each engine's log goes here")
    ap.add_argument("--json", default=None)
    workload_options(ap)
    ap.set_defaults(workload="heavy-tail", priority_by="output-len")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: {p!r} is not one of {', '.join(POLICIES)}")
    rates = [float(r) for r in args.rates.split(",")]
    runs = []
    print(HEADER, flush=True)
    for policy in policies:
        engine = Engine(args.model, policy, ["--device", args.device, *extra],
                        os.path.join(args.log_dir, f"bench-policies-{policy}.log"))
        try:
            engine.wait_ready(args.ready_timeout_s)
            for i, rate in enumerate(rates):
                # each later rate its own prompts (the same for every policy): it must not
                # find an earlier rate's prompts in the engine's prefix cache
                base_seed = args.seed if args.prompt_seed is None else args.prompt_seed
                run_args = SimpleNamespace(**vars(args) | {
                    "base_url": engine.base_url, "api_key": None, "model": None,
                    "request_rate": rate, "event_loop": "asyncio",
                    "prompt_seed": base_seed + i if i else args.prompt_seed})
                if policy != "priority":
                    run_args.priority_by = "none"
                before = engine.counters()
                result = asyncio.run(serve_run(run_args))
                after = engine.counters()
                result["engine_counters"] = {k: after[k] - before[k] for k in after}
                runs.append({"policy": policy, "rate": rate, **result})
                print(line(policy, rate, result), flush=True)
                if args.json:  # after every run: a run cut short by a timeout keeps the others
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args) | {"engine_args": extra}, "runs": runs},
                                  f, indent=1)
        finally:
            engine.stop()


if __name__ == "__main__":
    main()
