"""Compare routing strategies on one deployment, swapped while it serves (paper §4.1, §4.3).

    python -m bench.strategies deploy/local-cpu.toml --workload synthetic \\
        --strategy dp --strategy 1p1d --strategy 1p1d-balance-0.2 \\
        --rates 0.5,1,1.5,2 --duration-s 60 --json docs/strategies/run.json

Starts the deployment once (`microserve up FILE`, with secrets it makes up) — or drives one that
runs already (`--base-url URL --admin-token T [--api-key K]`) — and then, for each strategy:
swaps it in through the admin API (PUT /admin/strategy; no restart, which is the point of
this project), drains the engines the strategy does not use (POST /admin/engines/N/drain)
and, for each per-GPU request rate, sends Poisson arrivals at rate × GPUs, as the paper does
to compare patterns that use different numbers of GPUs. Every request streams and sets
`ignore_eos`, so each produces exactly its output length.

Per run it records TTFT, TPOT and JCT (end to end; mean, p50, p90, p99, in ms), request and
token throughput, failures, and what each engine did meanwhile (prompt and generated tokens,
KV tokens sent and received, preemptions: the proof that P/D moved KV; its steps and, on a GPU,
the device's busy seconds and those of its decode-only steps, with their count and batch). One
JSON file holds all runs; `python -m bench.plot_strategies` draws the paper's figures from it.

Strategies (--strategy, repeated): a preset, or LABEL=BUILTIN{JSON args}, either with
@ENGINE,ENGINE to use only those engines (the others are drained for its runs):

    dp                      data_parallel (round robin over every engine)
    1p1d, 1p2d              pd (the deployment's roles decide P and D)
    1p1d-balance-R          balanced_pd with ratio R (0.1, 0.2, ...)
    1p1d-balance-adaptive   balanced_pd, adaptive ratio
    dp3=data_parallel@gpu-0,gpu-1,gpu-2
    bal=balanced_pd{"ratio": 0.25, "decode_cost": 16}

Workloads (--workload; lengths are drawn once per rate, the same for every strategy; token
content is fresh for each run, so no run hits a prefix another one cached):

    synthetic       input ~ N(3000, 5), output ~ N(100, 5) tokens: the paper's synthetic set
    synthetic-5000  input ~ N(5000, 5), output ~ N(100, 5): the balance-ratio study (Fig. 13)
    chat            short prompts with the paper's ShareGPT means (input ~200, output ~260).
                    ShareGPT itself cannot be downloaded here; lengths are log-normal (input
                    sigma 1.0, output sigma 0.8, both clipped to [4, 2048]) with those means:
                    a stand-in with a long tail like the real set, not the real set.
    --input-len MEAN:STD --output-len MEAN:STD   normal lengths of your choosing
    --phases W@RATE:S,...  one run per strategy whose mix shifts: phases of a workload (or
                    IN:STD/OUT:STD) at a per-GPU rate for S seconds each (bench/workloads.py)

A run ends when every request has answered or after --run-timeout-s; requests still open then
are cancelled (the client disconnects, so the engines abort them) and counted as timed out.
With --stop-when-saturated S, a strategy's higher rates are skipped once a run times out, fails
a request, or has a p99 JCT above S seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field

import httpx
from httptools import HttpParserError

from bench.workloads import (WORKLOADS, Phase, compare_phases, overall_goodput, parse_lengths,
                             parse_phases, phase_report, phased_schedule, schedule)
from bench.serve import one, pct
from bench.slo import SLO, parse_stages, stage_quantiles
from bench.sse_client import StreamClient

PRESETS: dict[str, tuple[str, dict]] = {
    "dp": ("data_parallel", {}),
    "1p1d": ("pd", {}),
    "1p2d": ("pd", {}),
    "1p1d-balance-adaptive": ("balanced_pd", {"adaptive": True}),
}
_BALANCE = re.compile(r"1p1d-balance-(0(\.\d+)?|1(\.0+)?)$")
_SPEC = re.compile(r"(?:(?P<label>[\w.-]+)=)?(?P<builtin>[\w.-]+)(?P<args>\{.*\})?"
                   r"(?:@(?P<engines>[\w.,-]+))?$")

@dataclass
class StrategyRun:
    label: str
    builtin: str
    args: dict = field(default_factory=dict)
    engines: list[str] | None = None  # None: every engine of the deployment


def parse_strategy(text: str) -> StrategyRun:
    """A --strategy value: a preset or LABEL=BUILTIN{JSON}, with an optional @ENGINES suffix."""
    m = _SPEC.match(text.strip())
    if m is None:
        raise ValueError(f"strategy {text!r}: expected a preset or LABEL=BUILTIN{{JSON}}[@E,E]")
    name, label = m["builtin"], m["label"]
    engines = m["engines"].split(",") if m["engines"] else None
    if m["args"] is not None:
        try:
            args = json.loads(m["args"])
        except json.JSONDecodeError as e:
            raise ValueError(f"strategy {text!r}: its arguments are not JSON: {e}") from None
        return StrategyRun(label or name, name, args, engines)
    if label is None and name in PRESETS:
        builtin, args = PRESETS[name]
        return StrategyRun(name, builtin, dict(args), engines)
    if label is None and (b := _BALANCE.match(name)):
        return StrategyRun(name, "balanced_pd", {"ratio": float(b[1])}, engines)
    if label is None:
        raise ValueError(f"strategy {text!r} is not a preset ({', '.join(PRESETS)}, "
                         "1p1d-balance-R); name a builtin as LABEL=BUILTIN")
    return StrategyRun(label, name, {}, engines)


class Deployment:
    """`microserve up FILE` in a child process (its own process group), stopped on exit."""

    def __init__(self, path: str, port: int, model: str | None, log_path: str | None):
        self.path, self.port, self.model = path, port, model
        self.api_key, self.admin_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
        self.log = open(log_path or os.devnull, "wb")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "launcher.cli", "up", self.path, "--port", str(self.port)]
        if self.model:
            cmd += ["--model", self.model]
        env = os.environ | {"MICROSERVE_API_KEY": self.api_key,
                            "MICROSERVE_ADMIN_TOKEN": self.admin_token}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # up stops the router, then its engines
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Bench:
    def __init__(self, base_url: str, api_key: str | None, admin_token: str, args):
        self.args = args
        self.root = base_url.rstrip("/").removesuffix("/v1")
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = StreamClient(self.root + "/v1", auth)  # the requests measured
        self.admin = httpx.AsyncClient(
            base_url=self.root, timeout=60,
            headers={"Authorization": f"Bearer {admin_token}"})  # fmt: skip

    async def close(self) -> None:
        self.client.close()
        await self.admin.aclose()

    async def wait_ready(self, timeout_s: float, proc: subprocess.Popen | None,
                         watch_pid: int | None = None) -> list[dict]:
        """The engines, once the router answers and every engine is up. Fails at once if the
        deployment's process (`proc`, ours; `watch_pid`, a script's) has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the deployment exited with status {proc.returncode}")
            if watch_pid is not None and not process_alive(watch_pid):
                raise RuntimeError(f"the deployment's process {watch_pid} has exited")
            with contextlib.suppress(httpx.HTTPError):
                engines = (await self.admin.get("/admin/engines")).json()["engines"]
                if engines and all(e["state"] == "up" for e in engines):
                    return engines
            if time.monotonic() > deadline:
                raise RuntimeError(f"the deployment was not ready after {timeout_s:g} s")
            await asyncio.sleep(1.0)

    async def call(self, method: str, path: str, **kw) -> dict:
        resp = await self.admin.request(method, path, **kw)
        if resp.status_code != 200:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        return resp.json()

    async def use(self, run: StrategyRun, all_engines: list[str]) -> dict:
        """Swap the strategy in, drain the engines it does not use and give every engine back
        the role it joined with (an `auto` run before may have flipped it: a fixed strategy
        is measured on the deployment's roles). Its description."""
        for name in all_engines:
            action = "undrain" if run.engines is None or name in run.engines else "drain"
            await self.call("POST", f"/admin/engines/{name}/{action}")
        described = await self.call("PUT", "/admin/strategy",
                                    json={"builtin": run.builtin, "args": run.args})
        deadline = time.monotonic() + 120.0  # an `auto` swapped out restores roles itself
        while True:
            engines = (await self.call("GET", "/admin/engines"))["engines"]
            flipped = [e for e in engines if e["role"] != e["added_role"]]
            if not flipped:
                return described
            if time.monotonic() > deadline:
                left = [(e["name"], e["role"]) for e in flipped]
                raise RuntimeError(f"roles not restored: {left}")
            for e in flipped:  # 409: a flip (auto's restoring) is under way; look again
                await self.admin.post(f"/admin/engines/{e['name']}/role",
                                      json={"role": e["added_role"], "wait_s": 30.0})
            await asyncio.sleep(0.5)

    async def engine_counters(self) -> dict[str, dict]:
        engines = (await self.call("GET", "/admin/engines"))["engines"]
        # ... and where each engine's time went: its steps, its GPU's busy seconds and the
        # decode-only and prompt-only steps' shares of them (0 on CPU; engine/loop_stats.py's
        # DeviceTimeline)
        keys = ("prompt_tokens", "generation_tokens", "kv_tokens_sent", "kv_tokens_received",
                "preemptions", "steps", "prompt_tokens_computed", "device_busy_seconds",
                "device_decode_seconds", "device_decode_steps", "device_decode_seqs",
                "device_prompt_seconds", "device_prompt_steps", "device_prompt_tokens",
                "launch_holds", "launch_hold_seconds", "launch_hold_arrivals")
        return {e["name"]: {k: e["load"].get(k, 0) for k in keys} for e in engines}

    async def settle(self, timeout_s: float = 60.0) -> None:
        """Until no engine has a request open (aborts of a timed-out run included) and the
        router has polled their counters since."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engines = (await self.call("GET", "/admin/engines"))["engines"]
            if all(e["open_generations"] == 0 and e["open_sends"] == 0
                   and e["load"].get("running", 0) == 0 and e["load"].get("waiting", 0) == 0
                   for e in engines):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.2)  # two poll intervals: the counters are fresh

    async def stages(self):
        """The router's stage histograms now (bench/slo.py)."""
        return parse_stages((await self.admin.get("/metrics")).text)

    async def run(self, model: str, work: list[tuple[float, int, int]], rng: random.Random,
                  gpus: int, concurrency: int | None = None,
                  phases: tuple[list[Phase], list[int]] | None = None) -> dict:
        """Send `work` at its arrival times (or, with `concurrency`, keeping that many in
        flight); the latency figures of the requests and their goodput. `phases`: the run's
        phases and each request's phase (bench/workloads.py): their figures too."""
        vocab = self.args.vocab
        prompts = [[rng.randrange(vocab) for _ in range(n_in)] for _, n_in, _ in work]
        limit = asyncio.Semaphore(concurrency or len(work))
        stages_before = await self.stages()
        start = time.perf_counter()

        async def at(t: float, prompt: list[int], n_out: int) -> dict:
            if concurrency is None:
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            async with limit:
                try:
                    return await one(self.client, model, prompt, n_out)
                except (OSError, HttpParserError) as e:
                    return {"error": f"{type(e).__name__}: {e}"}

        tasks = [asyncio.create_task(at(t, p, n_out))
                 for (t, _, n_out), p in zip(work, prompts)]  # fmt: skip
        trace: list[dict] = []
        tracer = asyncio.create_task(self.trace(start, trace))
        done, pending = await asyncio.wait(tasks, timeout=self.args.run_timeout_s)
        tracer.cancel()
        await asyncio.gather(tracer, return_exceptions=True)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
        answers = [t.result() if t in done else None for t in tasks]
        results = [a for a in answers if a is not None]
        ok = [r for r in results if "error" not in r]
        out_tokens = sum(r["output_tokens"] for r in ok)
        in_tokens = sum(r["prompt_tokens"] for r in ok)
        ttft, tpot = pct([r["ttft"] for r in ok]), pct([r["tpot"] for r in ok])
        failed = len(work) - len(ok)
        objective = SLO(self.args.slo_ttft_s, self.args.slo_tpot_ms)
        slo = objective.report(ok, failed, wall, gpus, ttft.get("p99_ms"), tpot.get("p99_ms"))
        by_phase = {}
        if phases is not None:
            rows = phase_report(*phases, answers, objective, gpus)
            by_phase = {"phases": rows,
                        "phased_goodput_per_gpu": overall_goodput(rows, gpus)}
        return {
            "requests": len(work), "completed": len(ok), "failed": len(results) - len(ok),
            "timed_out": len(pending), "errors": [r["error"] for r in results if "error" in r][:3],
            "input_tokens": in_tokens, "output_tokens": out_tokens,
            "wall_s": wall, "request_throughput": len(ok) / wall,
            "input_tokens_per_s": in_tokens / wall, "output_tokens_per_s": out_tokens / wall,
            "ttft": ttft, "tpot": tpot, "jct": pct([r["e2e"] for r in ok]), "slo": slo,
            "stages": stage_quantiles(stages_before, await self.stages()), **by_phase,
            **({"strategy_trace": trace} if trace else {}),
        }  # fmt: skip

    async def trace(self, start: float, into: list[dict]) -> None:
        """Every --trace-s seconds of a run, what an `auto` strategy sees and holds (GET
        /admin/strategy: each engine as its last choice saw it, the role rules holding and
        for how long, its choices so far), appended to `into`; nothing for a strategy that
        describes none of it."""
        if not self.args.trace_s:
            return
        seen = None  # the flips the strategy had made when last sampled
        while True:
            await asyncio.sleep(self.args.trace_s)
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                settings = (await self.admin.get("/admin/strategy")).json()["active"]["settings"]
                last, roles = settings.get("last") or {}, settings.get("flip_roles") or {}
                flips = roles.get("flips") or []  # the last few the router keeps
                total = roles.get("flips_total", len(flips))  # every one so far
                new = 0 if seen is None else min(total - seen, len(flips))
                if "engines" in last:
                    into.append({"t": round(time.perf_counter() - start, 2),
                                 "engines": last["engines"], "chosen": settings.get("chosen"),
                                 "holding_s": roles.get("holding_s"), "flips": total,
                                 # each flip since the last sample: engine, roles, rule
                                 "flipped": [{k: v for k, v in f.items() if k != "at"}
                                             for f in flips[len(flips) - new:]]})
                seen = total


def parse_rate(text: str) -> float | str:
    """A --rates entry: a per-GPU rate, or "cN" for a closed loop of N in flight."""
    text = text.strip()
    if re.fullmatch(r"c[1-9]\d*", text):
        return text
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"rate {text!r}: a number of requests/s per GPU, or cN") from None
    if not rate > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return rate


def _delta(before: dict, after: dict) -> dict:
    return {name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in after[name]}
            for name in after}


def saturated(result: dict, max_p99_jct_s: float | None) -> bool:
    if max_p99_jct_s is None:
        return False
    p99 = result["jct"].get("p99_ms", float("inf")) / 1e3
    return result["timed_out"] > 0 or result["failed"] > 0 or p99 > max_p99_jct_s


async def main_async(args) -> dict:
    runs = [parse_strategy(s) for s in args.strategy]
    phases = parse_phases(args.phases) if args.phases else None
    rates = ["phased"] if phases else [parse_rate(r) for r in args.rates.split(",")]
    dists = WORKLOADS[args.workload]
    if args.input_len:
        dists = (parse_lengths(args.input_len), dists[1])
    if args.output_len:
        dists = (dists[0], parse_lengths(args.output_len))
    deployment = None
    if args.deployment:
        deployment = Deployment(args.deployment, args.port, args.model, args.log)
        deployment.start()
        base_url, api_key, admin_token = (f"http://127.0.0.1:{args.port}", deployment.api_key,
                                          deployment.admin_token)  # fmt: skip
    else:
        base_url, api_key, admin_token = args.base_url, args.api_key, args.admin_token
    bench = Bench(base_url, api_key, admin_token, args)
    names: list[str] = []
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "deployment": args.deployment, "model": args.model,
        "workload": args.workload, "lengths": {"input": dists[0], "output": dists[1]},
        "duration_s": args.duration_s, "seed": args.seed, "note": args.note,
        "command": " ".join(["python -m bench.strategies"] + sys.argv[1:]), "runs": [],
    }  # fmt: skip
    try:
        engines = await bench.wait_ready(args.ready_timeout_s,
                                         deployment.proc if deployment else None,
                                         args.watch_pid)
        names = [e["name"] for e in engines]
        record["engines"] = [{k: e[k] for k in ("name", "role", "url")} for e in engines]
        model = args.served_model or (await bench.client.get_json("/models"))["data"][0]["id"]
        for e in (r.engines or [] for r in runs):
            if unknown := set(e) - set(names):
                raise ValueError(f"strategy engines {sorted(unknown)} not in {names}")
        await one(bench.client, model, [1] * 16, 4)  # warm-up
        # each round runs every strategy in turn on the same arrivals (its own seed), so a
        # round's strategies are compared on one schedule and rounds sample the noise
        for k, (rnd, run) in enumerate((r, run) for r in range(args.rounds) for run in runs):
            seed = args.seed + rnd
            described = await bench.use(run, names)
            used = run.engines or names
            gpus = args.gpus or len(used)
            for rate in rates:
                closed = isinstance(rate, str) and rate != "phased"  # "cN": N in flight
                shifts = None
                if phases:
                    planned = phased_schedule(phases, gpus, seed)
                    work = [(t, n_in, n_out) for t, n_in, n_out, _ in planned]
                    shifts = (phases, [k for *_, k in planned])
                elif closed:
                    n = args.min_requests
                    work = [(0.0, i, o) for _, i, o in schedule(n, 1.0, dists, seed)]
                else:
                    n = max(args.min_requests, round(rate * gpus * args.duration_s))
                    work = schedule(n, rate * gpus, dists, seed)
                await bench.settle()
                before = await bench.engine_counters()
                result = await bench.run(model, work, random.Random(f"{args.seed}/{k}/{rate}"),
                                         gpus, int(rate[1:]) if closed else None, shifts)
                await bench.settle()
                active = (await bench.call("GET", "/admin/strategy"))["active"]
                entry = {"strategy": run.label, "round": rnd, "builtin": run.builtin,
                         "args": run.args,
                         "engines": used, "gpus": gpus,
                         **({"concurrency": int(rate[1:]), "rate_per_gpu": 0, "rate": 0}
                            if closed else {"rate_per_gpu": 0, "rate": 0} if phases
                            else {"rate_per_gpu": rate, "rate": rate * gpus}),
                         **result,
                         "engine_counters": _delta(before, await bench.engine_counters()),
                         "strategy_version": described["version"],
                         "strategy_settings": active["settings"]}
                record["runs"].append(entry)
                print(_line(entry), flush=True)
                if args.json:  # written after every run: a crash later keeps what ran
                    _write(args.json, record)
                if phases:
                    for row in result["phases"]:
                        print(f"#   phase {row['workload']}@{row['rate_per_gpu']:g}:"
                              f"{row['seconds']:g}  n={row['requests']} ok={row['completed']} "
                              f"met={row['met']} goodput {row['goodput_per_gpu']:.2f}/GPU; "
                              f"p99 ms: ttft {row['ttft'].get('p99_ms', math.nan):.0f} "
                              f"tpot {row['tpot'].get('p99_ms', math.nan):.1f} "
                              f"jct {row['jct'].get('p99_ms', math.nan):.0f}", flush=True)
                if saturated(result, args.stop_when_saturated) and rate != rates[-1]:
                    print(f"# {run.label}: saturated at {rate:g} req/s per GPU; higher rates "
                          "skipped", flush=True)
                    break
        for line in compare_phases(record["runs"]) if phases else []:
            print(line, flush=True)
        for line in compare_rounds(record["runs"]) if args.rounds > 1 else []:
            print(line, flush=True)
    finally:
        for name in names:  # a running deployment gets every engine back, even after an error
            with contextlib.suppress(Exception):
                await bench.call("POST", f"/admin/engines/{name}/undrain")
        await bench.close()
        if deployment is not None:
            deployment.stop()
    return record


def compare_rounds(runs: list[dict]) -> list[str]:
    """Per rate, each strategy's P99 JCT in every round, and its ratio to the first strategy's
    in the same round (same arrivals): the mean and range of those ratios."""
    lines = []
    rates = sorted({(e["rate_per_gpu"], e.get("concurrency")) for e in runs},
                   key=lambda r: (r[1] is not None, r))
    for rate, conc in rates:
        at = [e for e in runs if (e["rate_per_gpu"], e.get("concurrency")) == (rate, conc)]
        labels = list(dict.fromkeys(e["strategy"] for e in at))
        p99 = {(e["strategy"], e["round"]): e["jct"].get("p99_ms", math.nan) for e in at}
        rounds = sorted({e["round"] for e in at})
        load = f"c{conc}" if conc is not None else f"{rate:g}/GPU"
        lines.append(f"# rounds at {load}: P99 JCT ms per round; ratio to {labels[0]} in the "
                     f"same round (mean [min, max])")
        for label in labels:
            mine = [p99.get((label, r), math.nan) for r in rounds]
            ratios = [m / p99[labels[0], r] for m, r in zip(mine, rounds)
                      if (labels[0], r) in p99 and p99[labels[0], r] > 0 and m == m]
            spread = (f"{statistics.fmean(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
                      if ratios else "-")
            lines.append(f"#   {label:>24}: {' '.join(f'{m:.0f}' for m in mine)}  {spread}")
    return lines


def _line(e: dict) -> str:
    ms = lambda d, k: f"{d.get(k, float('nan')):.0f}"  # noqa: E731
    load = (f"c{e['concurrency']:<4}   " if "concurrency" in e else
            " phased  " if "phases" in e else f"{e['rate_per_gpu']:>5g}/GPU")
    return (f"{e['strategy']:>24} {load}  n={e['requests']:<4} "
            f"ok={e['completed']:<4} ttft {ms(e['ttft'], 'mean_ms')}/{ms(e['ttft'], 'p99_ms')} "
            f"tpot {ms(e['tpot'], 'mean_ms')}/{ms(e['tpot'], 'p99_ms')} "
            f"jct {ms(e['jct'], 'mean_ms')}/{ms(e['jct'], 'p99_ms')} ms (mean/p99) "
            f"{e['output_tokens_per_s']:.0f} out tok/s, goodput {e['slo']['goodput_per_gpu']:.2f}"
            f"/GPU{_handover(e['stages'])}{_busy(e)}")


def _busy(e: dict) -> str:
    """Each engine's GPU time in steps over the run's wall time (engines on a GPU only)."""
    wall = e.get("wall_s") or 0.0
    if wall <= 0:
        return ""
    parts = [f"{name} {c.get('device_busy_seconds', 0.0) / wall:.2f}"
             for name, c in (e.get("engine_counters") or {}).items()
             if c.get("device_busy_seconds", 0.0) > 0]
    return f"; GPU busy: {', '.join(parts)}" if parts else ""


def _handover(stages: dict) -> str:
    parts = [f"{name} {stages[name]['p50_ms']:.1f}" for name in
             ("p_queue", "p_prefill", "p_chunks", "transfer_tail", "handover") if name in stages]
    return f"; p50 ms: {', '.join(parts)}" if parts else ""


def _write(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def seconds(text: str) -> float:
    """A duration option: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds >= 0")
    return value


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.strategies", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deployment", nargs="?", help="a deployment file to start (microserve up)")
    ap.add_argument("--model", default=None, help="the model every engine loads (overrides "
                    "the file's), e.g. random:llama-3.1-8b")
    ap.add_argument("--port", type=int, default=8000, help="the router's port (with a file)")
    ap.add_argument("--log", default=None, help="where the deployment's output goes")
    ap.add_argument("--base-url", default=None, help="a running router instead of a file")
    ap.add_argument("--api-key", default=os.environ.get("MICROSERVE_API_KEY"))
    ap.add_argument("--admin-token", default=os.environ.get("MICROSERVE_ADMIN_TOKEN"))
    ap.add_argument("--served-model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--strategy", action="append", required=True, help="see above; repeat")
    ap.add_argument("--rates", default=None, help="per-GPU request rates, e.g. 0.5,1,1.5; "
                    "cN: a closed loop of --min-requests requests, N in flight (c1: one at a "
                    "time, the TTFT of an idle deployment)")
    ap.add_argument("--phases", default=None, metavar="W@RATE:S,...",
                    help="instead of --rates, one run per strategy whose traffic shifts: "
                         "WORKLOAD@RATE:SECONDS phases one after the other (bench/workloads.py), "
                         "e.g. chat@8:60,synthetic@3:60,chat@8:60")
    ap.add_argument("--slo-ttft-s", type=float, default=2.0,
                    help="goodput: a request meets the SLO with a TTFT up to this ...")
    ap.add_argument("--slo-tpot-ms", type=float, default=25.0,
                    help="... and a time per output token up to this")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs per run (default: the "
                    "engines the strategy uses; say 1 for engines that share one GPU)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="synthetic")
    ap.add_argument("--input-len", default=None, help="MEAN:STD, overrides the workload's")
    ap.add_argument("--output-len", default=None, help="MEAN:STD, overrides the workload's")
    ap.add_argument("--duration-s", type=float, default=60.0,
                    help="requests per run = rate x GPUs x this (at least --min-requests)")
    ap.add_argument("--min-requests", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the strategies in turn this many times, round r on the "
                         "arrivals of seed --seed + r, and print each one's P99 JCT against "
                         "the first strategy's round by round")
    ap.add_argument("--run-timeout-s", type=float, default=600.0)
    ap.add_argument("--trace-s", type=seconds, default=1.0,
                    help="how often an `auto` run's view of the engines and its role rules "
                         "are sampled into the JSON's strategy_trace (0: never)")
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--watch-pid", type=int, default=None,
                    help="with --base-url: the deployment's process (`microserve up` started by "
                         "a script); waiting for readiness fails at once if it has exited")
    ap.add_argument("--stop-when-saturated", type=float, default=None, metavar="P99_JCT_S")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are < this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every run here (after each run)")
    ap.add_argument("--note", default=None,
                    help="recorded in the JSON: what a --base-url deployment is, for instance")
    return ap


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal check (a zombie counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.deployment is None and (args.base_url is None or args.admin_token is None):
        parser().error("give a deployment file, or --base-url and --admin-token")
    if args.deployment is not None:
        with open(args.deployment, "rb") as f:
            tomllib.load(f)  # fails here, not after minutes of start-up
    if (args.rates is None) == (args.phases is None):
        parser().error("give --rates or --phases (one of them)")
    if args.rounds < 1:
        parser().error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        for s in args.strategy:
            parse_strategy(s)
        if args.phases:
            parse_phases(args.phases)
        for r in (args.rates or "1").split(","):
            parse_rate(r)
    except ValueError as e:
        parser().error(str(e))
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
