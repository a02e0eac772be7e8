"""`microserve ab`: an A/B of routing strategies on a running router, on live traffic it makes.

    microserve ab --base-url http://127.0.0.1:8000 --admin-token T \\
        --arm a=data_parallel --arm b=balanced_pd:ratio=0.3 --duration-s 60 \\
        --rate 4 --input-len 3000 --output-len 100

It sets the arms (PUT /admin/strategy {"arms": ...}), drives Poisson load at --rate for
--duration-s with bench/serve.py's workload and client, prints the router's comparison of the
arms (GET /admin/strategy: per arm requests, goodput under the SLO, TTFT/TPOT/JCT, and each
arm's difference from the first, all with 95% intervals), and restores the strategy that was
active before (a built-in or a file; an uploaded module cannot be re-sent and is named
instead). docs/router.md, "A/B arms", says what the numbers mean. No torch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os

import httpx

from bench import serve


def parse_arm(value: str) -> dict:
    """NAME=STRATEGY[:KEY=VALUE,...][@WEIGHT] as an arm of the PUT body; STRATEGY is a
    built-in name or a .py path in the router's strategies directory; VALUEs are JSON
    where they parse as JSON (0.3, true, "x"), else strings."""
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"an arm is NAME=STRATEGY[:KEY=VALUE,...][@WEIGHT], "
                                         f"got {value!r}")
    rest, _, weight = rest.partition("@")
    strategy, _, arg_text = rest.partition(":")
    args = {}
    for pair in filter(None, arg_text.split(",")):
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"arm {name!r}: an argument is KEY=VALUE, got "
                                             f"{pair!r}")
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw
    try:
        w = float(weight) if weight else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"arm {name!r}: weight {weight!r} is not a number")
    where = "path" if strategy.endswith(".py") or "/" in strategy else "builtin"
    return {"name": name, where: strategy, "args": args, "weight": w}


def ab_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=os.environ.get("MICROSERVE_BASE_URL",
                                                        "http://127.0.0.1:8000"),
                   help="the router (its /v1 suffix, if given, is dropped)")
    p.add_argument("--admin-token", default=os.environ.get("MICROSERVE_ADMIN_TOKEN"),
                   help="the router's admin token (default: $MICROSERVE_ADMIN_TOKEN)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="the router's API key, if it has one (default: $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--arm", action="append", type=parse_arm, required=True, dest="arms",
                   metavar="NAME=STRATEGY[:K=V,...][@W]",
                   help="an arm (repeat: two or more); e.g. b=balanced_pd:ratio=0.3@2")
    p.add_argument("--sticky-by", default="request_id",
                   help="request_id (default; this client sends no user or header), user, "
                        "header:NAME")
    p.add_argument("--slo-ttft-s", type=float, default=2.0, help="goodput's TTFT target")
    p.add_argument("--slo-tpot-s", type=float, default=0.025, help="goodput's TPOT target")
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="how long arrivals go on (the requests then in flight finish)")
    serve.workload_options(p)
    p.add_argument("--rate", dest="request_rate", type=float, default=argparse.SUPPRESS,
                   help="Poisson arrivals per second (as --request-rate)")
    p.add_argument("--keep-arms", action="store_true",
                   help="leave the experiment running instead of restoring the strategy")
    p.add_argument("--json", default=None, help="write the router's comparison and the "
                                                "client's figures here")
    p.set_defaults(num_requests=None, request_rate=4.0)


def run_ab(args) -> None:
    root = args.base_url.rstrip("/").removesuffix("/v1")
    if not args.admin_token:
        raise ValueError("ab needs the router's admin token: --admin-token or "
                         "MICROSERVE_ADMIN_TOKEN")
    if len(args.arms) < 2:
        raise ValueError(f"an A/B needs two arms or more, got {len(args.arms)}")
    if not 0 < args.request_rate < math.inf:
        raise ValueError(f"--rate must be a positive number, got {args.request_rate}")
    auth = {"Authorization": f"Bearer {args.admin_token}"}
    with httpx.Client(base_url=root, headers=auth, timeout=120) as admin:
        before = _checked(admin.get("/admin/strategy"))
        _checked(admin.put("/admin/strategy", json={
            "arms": args.arms, "sticky_by": args.sticky_by,
            "slo": {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}}))
        try:
            args.base_url = root + "/v1"
            if args.num_requests is None:
                args.num_requests = max(1, round(args.request_rate * args.duration_s))
            client = asyncio.run(serve.run(args))
            state = _checked(admin.get("/admin/strategy"))
        finally:
            if not args.keep_arms:
                print(_restore(admin, before))
    experiment = state["experiment"]
    print(comparison(experiment))
    print(f"client: {client['requests']} requests, {client['failed']} failed, "
          f"{client['wall_s']:.1f} s, {client['output_tokens_per_s']:.0f} output tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"experiment": experiment, "client": client}, f, indent=1)


def _checked(r: httpx.Response) -> dict:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.method} {r.request.url.path}: {r.status_code} "
                           f"{r.text[:500]}")
    return r.json()


def _restore(admin: httpx.Client, before: dict) -> str:
    """Put back what served before the A/B; says what it did."""
    if before.get("experiment"):
        e = before["experiment"]
        arms = [_spec(a["strategy"]) | {"name": a["name"], "weight": a["weight"]}
                for a in e["arms"]]
        if all(arms):
            _checked(admin.put("/admin/strategy", json={"arms": arms, "sticky_by":
                                                         e["sticky_by"], "slo": e["slo"]}))
            return "restored the previous experiment's arms"
        return "left the A/B arms in place: the previous experiment had an uploaded arm"
    spec = _spec(before["active"])
    if spec is None:
        return (f"left the A/B arms in place: the previous strategy "
                f"({before['active']['source']}) was uploaded; PUT it again to restore it")
    _checked(admin.put("/admin/strategy", json=spec))
    return f"restored {before['active']['source']} {before['active']['args']}"


def _spec(described: dict) -> dict | None:
    kind, _, where = described["source"].partition(":")
    if kind not in ("builtin", "file"):
        return None
    return {"builtin" if kind == "builtin" else "path": where, "args": described["args"],
            "class": described["class"]}


def comparison(experiment: dict) -> str:
    """The arms side by side, then each arm's difference from the first."""
    def ms(m: dict | None, key: str) -> str:
        return "-" if m is None else f"{m[key] * 1e3:.1f}"

    def mean_ci(m: dict | None) -> str:
        if m is None:
            return "-"
        return f"{m['mean'] * 1e3:.1f} [{m['ci95'][0] * 1e3:.1f}, {m['ci95'][1] * 1e3:.1f}]"

    slo = experiment["slo"]
    lines = [f"A/B: sticky by {experiment['sticky_by']}; SLO TTFT <= {slo['ttft_s']:g} s, "
             f"TPOT <= {slo['tpot_s'] * 1e3:g} ms; 95% intervals in brackets (ms)",
             f"{'arm':<8} {'strategy':<22} {'weight':>6} {'reqs':>5} {'fail':>4} "
             f"{'goodput':<22} {'TTFT mean':<26} {'p50':>7} {'p99':>7} "
             f"{'TPOT mean':<22} {'p99':>6} {'JCT mean':<26} {'p99':>7}"]
    for a in experiment["arms"]:
        g = a["goodput"]
        good = "-" if g["fraction"] is None else (
            f"{g['fraction']:.3f} [{g['ci95'][0]:.3f}, {g['ci95'][1]:.3f}]")
        s = a["strategy"]
        strategy = f"{s['class']} {json.dumps(s['args'], separators=(',', ':'))}"[:22]
        lines.append(f"{a['name']:<8} {strategy:<22} {a['weight']:>6g} {a['requests']:>5} "
                     f"{a['failed']:>4} {good:<22} {mean_ci(a['ttft']):<26} "
                     f"{ms(a['ttft'], 'p50'):>7} {ms(a['ttft'], 'p99'):>7} "
                     f"{mean_ci(a['tpot']):<22} {ms(a['tpot'], 'p99'):>6} "
                     f"{mean_ci(a['jct']):<26} {ms(a['jct'], 'p99'):>7}")
    for pair, d in experiment["differences"].items():
        parts = []
        if "goodput" in d:
            gd = d["goodput"]
            parts.append(f"goodput {gd['diff']:+.3f} [{gd['ci95'][0]:+.3f}, "
                         f"{gd['ci95'][1]:+.3f}]")
        for measure in ("ttft", "tpot", "jct"):
            m = d.get(measure)
            if m is not None:
                parts.append(f"{measure.upper()} {m['diff'] * 1e3:+.1f} ms "
                             f"[{m['ci95'][0] * 1e3:+.1f}, {m['ci95'][1] * 1e3:+.1f}]")
        lines.append(f"difference {pair}: " + ("; ".join(parts) or "too few requests"))
    return "\n".join(lines)
