"""Side by side with vLLM on one machine, in one run: the same model shape and dtype, the same
requests through the same client, one table of ratios.

    python -m bench.peers --model random:llama-3.1-8b --out peers.md      # on a GPU with vLLM
    python -m bench.peers --skip-vllm --model random:tiny --tiny          # CPU smoke run
    python -m bench.peers --gpus 2 --layouts dp,pd --out peers-2gpu.md      # two GPUs

Each round starts every server alone (vLLM, one `microserve engine`, `microserve up` with the
router over one engine), takes every figure (bench/peers/figures.py) and stops it; the order
of the servers is reversed every round so drift of a shared machine falls on both sides.
--gpus 2 runs vLLM and `up` over two GPUs instead (bench/peers/two_gpus.py): data parallel and
1P1D on 3,000/100 at three Poisson rates.
The table gives each figure's median over the rounds with its min-max spread, and the ratio
of microserve to vLLM oriented so that > 1 means microserve is better. vLLM is imported from
--vllm-site when given (bench/peers/install.sh puts it in /tmp/peers-site).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from bench.peers import figures, servers, two_gpus
from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model

SIDES = ("vllm", "engine", "up")

# --tiny: a CPU smoke run on random:tiny that finishes in seconds (not a measurement).
# batch_tokens 160 (the default): with 8, and again with 32 (2026-11-28), on a busy 2-core CI
# host the first of the 4 requests finished before the last began decoding, leaving decode4 no
# window where all four decode; random:tiny's steps take milliseconds, so 160 costs ~1 s.
TINY = dict(device="cpu", dtype="float32", max_model_len=512, first_len=16, decode_context=32,
            decode_tokens=8, prefill_seqs=2, prefill_len=32,
            batch_seqs=4, batch_context=16, batch_tokens=160, serve_requests=8, serve_input=16,
            serve_output=4, rates=[4.0, 8.0, 16.0], poisson_requests=6, poisson_input=16,
            poisson_output=4, devices="cpu,cpu", pd_kv_transfer="shm", pd_rates=[1.0, 2.0, 4.0],
            pd_requests=4, pd_input=24, pd_output=4)


def options() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b",
                    help="what both load: a random: model (vLLM gets --load-format dummy) or a "
                         "Hugging Face directory")
    ap.add_argument("--dtype", default="bfloat16", help="passed to both")
    ap.add_argument("--max-model-len", type=int, default=8192, help="passed to both")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="passed to both")
    ap.add_argument("--device", default="cuda", help="microserve's --device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(figures.FIGURES),
                    help=f"figures to take, of {','.join(figures.FIGURES)}")
    ap.add_argument("--sides", default=None,
                    help=f"servers, of {','.join(SIDES)} (all; with --gpus 2, vllm,up)")
    ap.add_argument("--skip-vllm", action="store_true", help="microserve's servers only")
    ap.add_argument("--vllm-site", default=None, help="a folder put in front of vLLM's PYTHONPATH")
    ap.add_argument("--vllm-arg", action="append", default=[], help="one more vLLM argument")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="one more `microserve engine` argument (both microserve sides)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="one more server: one `microserve engine` with these arguments as well,\n"
                         "side `engine@NAME` (one GPU), e.g. 'big=--max-num-seqs 1024'")
    ap.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp folder)")
    ap.add_argument("--out", type=Path, default=None, help="the table (Markdown); JSON beside it")
    ap.add_argument("--tiny", action="store_true", help="every size set for a CPU smoke run")
    two = ap.add_argument_group("two GPUs (--gpus 2: vLLM and `up` only)")
    two.add_argument("--gpus", type=int, choices=(1, 2), default=1)
    two.add_argument("--layouts", default=",".join(two_gpus.LAYOUTS),
                     help=f"of {','.join(two_gpus.LAYOUTS)}: data parallel x2, 1P1D")
    two.add_argument("--devices", default="cuda:0,cuda:1", help="our two engines' --device")
    two.add_argument("--pd-kv-transfer", default="cuda_ipc", help="our D engine's --kv-transfer")
    two.add_argument("--pd-rates", type=lambda s: [float(x) for x in s.split(",")],
                     default=[2.0, 3.0, 4.0],
                     help="Poisson rates, requests/s per GPU (twice that in all)")
    two.add_argument("--pd-requests", type=int, default=60, help="requests per rate")
    two.add_argument("--pd-input", type=int, default=3000)
    two.add_argument("--pd-output", type=int, default=100)
    two.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput's TTFT bound")
    two.add_argument("--slo-tpot-ms", type=float, default=25.0, help="goodput's TPOT bound")
    sizes = ap.add_argument_group("sizes (the issue's figures by default)")
    sizes.add_argument("--first-len", type=int, default=1024)
    sizes.add_argument("--decode-context", type=int, default=1024)
    sizes.add_argument("--decode-tokens", type=int, default=256)
    sizes.add_argument("--prefill-seqs", type=int, default=8)
    sizes.add_argument("--prefill-len", type=int, default=4096)
    sizes.add_argument("--batch-seqs", type=int, default=128)
    sizes.add_argument("--batch-context", type=int, default=1024)
    sizes.add_argument("--batch-tokens", type=int, default=160)
    sizes.add_argument("--serve-requests", type=int, default=400)
    sizes.add_argument("--serve-input", type=int, default=1024)
    sizes.add_argument("--serve-output", type=int, default=128)
    sizes.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                       default=[8.0, 16.0, 24.0], help="Poisson request rates, requests/s")
    sizes.add_argument("--poisson-requests", type=int, default=200)
    sizes.add_argument("--poisson-input", type=int, default=1024)
    sizes.add_argument("--poisson-output", type=int, default=128)
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = options()
    args = ap.parse_args(argv)
    if args.tiny:
        ap.set_defaults(**TINY)
        args = ap.parse_args(argv)  # flags given on the command line still win
    # vLLM's own client needs vLLM: without it, the other figures only
    args.only = [f for f in args.only.split(",") if f and not (args.skip_vllm and f == "vllmbench")]
    args.variants = {}
    args.trace_name = "run"  # the side and round, once a round starts (figures.poisson)
    for given in args.variant:
        name, eq, extra = given.partition("=")
        if not eq or not name.isidentifier() or not extra.strip():
            ap.error(f"--variant {given!r}: give NAME=ARGS, e.g. 'big=--max-num-seqs 1024'")
        args.variants[f"engine@{name}"] = shlex.split(extra)
    variants = ",".join(args.variants)
    sides = args.sides or ",".join(two_gpus.SIDES if args.gpus == 2 else SIDES)
    sides += "," + variants if variants and not args.sides and args.gpus == 1 else ""
    args.sides = [s for s in sides.split(",") if s and not (args.skip_vllm and s == "vllm")]
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.devices = [x for x in args.devices.split(",") if x]
    checks = [("--only", args.only, figures.FIGURES),
              ("--sides", args.sides, (*SIDES, *args.variants))]
    if args.gpus == 2:
        checks = [("--sides", args.sides, two_gpus.SIDES), ("--layouts", args.layouts,
                                                            two_gpus.LAYOUTS)]
        if len(args.devices) != 2:
            ap.error(f"--devices {','.join(args.devices)!r}: give two, e.g. cuda:0,cuda:1")
        if len(args.pd_rates) != 3 or min(args.pd_rates) <= 0:
            ap.error(f"--pd-rates {args.pd_rates}: give three rates above 0")
    for name, given, known in checks:
        if not given or set(given) - set(known):
            ap.error(f"{name} {','.join(given)!r}: choose from {','.join(known)}")
    if args.gpus == 1 and (left := [v for v in args.variants if v not in args.sides]):
        # a variant asked for and silently not run costs a GPU call its comparison
        ap.error(f"--variant {', '.join(left)}: not in --sides {','.join(args.sides)}; add it "
                 f"there (or leave --sides out)")
    return args


def start(side: str, model_dir: Path, args, workdir: Path) -> servers.Server:
    shared = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if side == "vllm":
        return servers.start_vllm(model_dir, workdir, [
            *shared, "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *args.vllm_arg], args.vllm_site)  # fmt: skip
    ours = [*shared, "--device", args.device, *args.engine_arg]
    if args.device.startswith("cuda"):
        ours += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if side in args.variants:
        return servers.start_engine(str(model_dir), workdir, [*ours, *args.variants[side]], side)
    launch = servers.start_engine if side == "engine" else servers.start_up
    return launch(str(model_dir), workdir, ours)


async def one_round(side: str, model_dir: Path, args, workdir: Path, vocab: int) -> dict:
    server = start(side, model_dir, args, workdir)
    try:
        await server.wait_ready()
        rows = {"start-up s": server.startup_s}
        # in FIGURES' order, whatever --only's: "first" must meet a server nothing reached yet
        for name in (f for f in figures.FIGURES if f in args.only):
            rows |= await figures.RUNNERS[name](server.url, servers.SERVED_NAME, args, vocab)
        return rows
    finally:
        server.stop()


def table(samples: dict[str, list[dict]], sides: list[str]) -> tuple[str, dict]:
    """Markdown: per row, each side's median [min-max] and microserve's ratios to vLLM."""
    rows = list(dict.fromkeys(r for side in sides for run in samples[side] for r in run))
    ours = [s for s in sides if s != "vllm"]
    head = ["figure", *sides, *(f"{s} / vllm" for s in ours if "vllm" in sides)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    summary = {}
    for row in rows:
        medians, cells = {}, [row]
        for side in sides:
            values = [run[row] for run in samples[side] if row in run]
            medians[side] = statistics.median(values) if values else None
            cells.append(f"{_num(medians[side])} [{_num(min(values))}–{_num(max(values))}]"
                         if values else "—")
        for side in ours:
            if "vllm" not in sides:
                break
            a, b = medians[side], medians["vllm"]
            ratio = None if not a or not b else (a / b if figures.higher_is_better(row) else b / a)
            medians[f"{side}/vllm"] = ratio
            cells.append("—" if ratio is None else f"{ratio:.3f}x")
        summary[row] = medians
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", summary


def _num(x: float) -> str:
    """Four significant figures; thousands grouped, never an exponent."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


async def run(args) -> tuple[str, dict]:
    model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args.model_dir, args.run_dir = model_dir, workdir  # for vllm bench serve's tokenizer and file
    samples = {side: [] for side in args.sides}
    if args.gpus == 2:
        return await run_two(args, model_dir, workdir, vocab, samples)
    for r in range(args.rounds):
        for side in (args.sides if r % 2 == 0 else args.sides[::-1]):
            args.trace_name = f"{side}-r{r + 1}"  # names the Poisson runs' request files
            rows = await one_round(side, model_dir, args, workdir, vocab)
            samples[side].append(rows)
            print(f"round {r + 1} {side}: {json.dumps(rows)}", flush=True)
            markdown, result = report(samples, args)  # after every round: a run cut short
    return markdown, result                            # by a time limit keeps what it took


async def run_two(args, model_dir: Path, workdir: Path, vocab: int,
                  samples: dict) -> tuple[str, dict]:
    markdown, result = report(samples, args)
    order = two_gpus.plan(args)
    for r in range(args.rounds):
        for side, layout in (order if r % 2 == 0 else order[::-1]):
            try:
                rows = await two_gpus.one_round(side, layout, model_dir, args, workdir, vocab)
            except RuntimeError as e:  # one layout that cannot start leaves the others theirs
                print(f"round {r + 1} {side} {layout}: failed: {e}", flush=True)
                continue
            samples[side].append(rows)
            print(f"round {r + 1} {side} {layout}: {json.dumps(rows)}", flush=True)
            markdown, result = report(samples, args)
    return markdown, result


def report(samples: dict[str, list[dict]], args) -> tuple[str, dict]:
    markdown, summary = table(samples, [s for s in args.sides if samples[s]])
    result = {"summary": summary, "samples": samples, "model": args.model, "dtype": args.dtype,
              "rounds": args.rounds, "gpus": args.gpus}
    if args.out:
        args.out.write_text(markdown)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return markdown, result


def _stop_on_sigterm(signum, frame) -> None:
    # The servers run in sessions of their own (so a stop can kill each whole tree) and would
    # outlive this process; `timeout` sends SIGTERM: unwind, so each round's `finally` stops
    # its server.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    markdown, _ = asyncio.run(run(args))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
