"""bench.peers --gpus 2: the P/D proxy in front of vLLM's NixlConnector speaks its protocol
(checked against two real local HTTP servers standing in for vLLM's prefill and decode servers),
the arguments are checked, the deployment files are what deploy/gpu-dp.toml and
deploy/gpu-1p1d.toml describe, and the microserve half runs end to end on random:tiny over
two CPU engines (real `microserve up`, real HTTP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from test_bench_peers import _environ
from test_microserving_api import live_server

from bench.peers import servers, two_gpus
from bench.peers.__main__ import parse
from bench.peers.pd_proxy import PREFILL_PARAMS, app

# what vLLM's prefill server answers (nixl/pull_scheduler.py, request_finished's dict)
P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 7]],
            "remote_engine_id": "p-engine", "remote_request_id": "cmpl-1",
            "remote_host": "localhost", "remote_port": 5601, "tp_size": 1,
            "remote_num_tokens": 24}
CHUNKS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
          b"data: [DONE]\n\n"]


def fakes(seen: dict, prefill_status: int = 200):
    async def prefill(request: Request) -> Response:
        seen.setdefault("prefill", []).append(await request.json())
        if prefill_status != 200:
            return JSONResponse({"error": {"message": "max_tokens: 9000 > 8192"}}, prefill_status)
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS})

    async def decode(request: Request) -> Response:
        seen.setdefault("decode", []).append(await request.json())

        async def stream():
            for chunk in CHUNKS:
                yield chunk
        return StreamingResponse(stream(), media_type="text/event-stream")

    async def healthy(request: Request) -> Response:
        return Response(status_code=200)

    return (Starlette(routes=[Route("/v1/completions", prefill, methods=["POST"]),
                              Route("/health", healthy)]),
            Starlette(routes=[Route("/v1/completions", decode, methods=["POST"]),
                              Route("/health", healthy)]))  # fmt: skip


BODY = {"model": "peers", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def test_the_proxy_prefills_one_token_on_p_then_streams_d_with_ps_kv_params():
    seen: dict = {}
    p_app, d_app = fakes(seen)
    async with live_server(p_app) as p, live_server(d_app) as d, \
            live_server(app(p, d)) as front, httpx.AsyncClient(base_url=front) as client:
        async with client.stream("POST", "/v1/completions", json=BODY) as resp:
            assert resp.status_code == 200
            body = b"".join([chunk async for chunk in resp.aiter_raw()])
        health = await client.get("/health")
    assert body == b"".join(CHUNKS)
    assert seen["prefill"] == [{"model": "peers", "prompt": [1, 2, 3], "max_tokens": 1,
                                "temperature": 0, "ignore_eos": True, "stream": False,
                                "kv_transfer_params": PREFILL_PARAMS}]
    assert seen["decode"] == [BODY | {"kv_transfer_params": P_PARAMS}]
    assert (health.status_code, health.json()) == (200, {"prefill": 200, "decode": 200})


async def test_a_refused_prefill_comes_back_as_is_and_d_never_hears_of_it():
    seen: dict = {}
    p_app, d_app = fakes(seen, prefill_status=400)
    async with live_server(p_app) as p, live_server(d_app) as d, \
            live_server(app(p, d)) as front, httpx.AsyncClient(base_url=front) as client:
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "max_tokens: 9000 > 8192"}}
    assert "decode" not in seen and len(seen["prefill"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "dp,tp"], "--layouts 'dp,tp': choose from dp,pd"),
    (["--sides", "engine"], "--sides 'engine': choose from vllm,up"),
    (["--devices", "cuda:0"], "--devices 'cuda:0': give two"),
    (["--pd-rates", "2,4"], "--pd-rates [2.0, 4.0]: give three rates above 0"),
    (["--pd-rates", "0,2,4"], "--pd-rates [0.0, 2.0, 4.0]: give three rates above 0"),
])  # fmt: skip
def test_two_gpu_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--gpus", "2", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_two_gpu_defaults_and_the_one_gpu_sides_unchanged():
    two = parse(["--gpus", "2"])
    assert (two.sides, two.layouts, two.devices, two.pd_rates) == (
        ["vllm", "up"], ["dp", "pd"], ["cuda:0", "cuda:1"], [2.0, 3.0, 4.0])
    assert (two.pd_input, two.pd_output, two.pd_kv_transfer) == (3000, 100, "cuda_ipc")
    assert parse([]).sides == ["vllm", "engine", "up"]
    assert parse(["--gpus", "2", "--skip-vllm"]).sides == ["up"]


def test_the_deployment_files_are_gpu_dp_and_gpu_1p1d():
    args = parse(["--gpus", "2", "--max-model-len", "4096", "--engine-arg=--seed=1"])
    dp = tomllib.loads(servers.up_config("m", *two_gpus.engines("dp", args)))
    pd = tomllib.loads(servers.up_config("m", *two_gpus.engines("pd", args)))
    common = ["--max-model-len", "4096", "--dtype", "bfloat16", "--seed=1"]
    assert dp["router"]["strategy"] == "data_parallel"
    assert dp["router"]["strategy_args"] == {"policy": "least_loaded"}
    assert [(e["name"], e.get("role"), e["args"]) for e in dp["engines"]] == [
        ("e0", None, [*common, "--device", "cuda:0", "--gpu-memory-utilization", "0.85"]),
        ("e1", None, [*common, "--device", "cuda:1", "--gpu-memory-utilization", "0.85"])]
    assert pd["router"]["strategy"] == "pd" and "strategy_args" not in pd["router"]
    assert [(e["name"], e["role"], e["args"]) for e in pd["engines"]] == [
        ("prefill-0", "prefill", [*common, "--device", "cuda:0", "--gpu-memory-utilization",
                                  "0.85"]),
        ("decode-0", "decode", [*common, "--device", "cuda:1", "--gpu-memory-utilization",
                                "0.85", "--kv-transfer", "cuda_ipc"])]  # fmt: skip
    ports = [pd["router"]["port"], *(e["port"] for e in pd["engines"])]
    assert len(set(ports)) == 3 and pd["served_model_name"] == servers.SERVED_NAME


def test_vllm_pd_is_left_out_without_nixl_and_said_so(capsys, tmp_path):
    args = parse(["--gpus", "2", "--vllm-site", str(tmp_path)])
    assert two_gpus.nixl_missing(str(tmp_path))  # not on this machine, nor in an empty site
    assert two_gpus.plan(args) == [("vllm", "dp"), ("up", "dp"), ("up", "pd")]
    assert "vLLM pd: skipped, `nixl` is not importable" in capsys.readouterr().out
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text("")
    (tmp_path / "nixl" / "_api.py").write_text("nixl_agent = object\n")
    assert not two_gpus.nixl_missing(str(tmp_path))
    assert two_gpus.plan(args) == [("vllm", "dp"), ("up", "dp"), ("vllm", "pd"), ("up", "pd")]


def test_microserve_two_gpu_half_end_to_end_on_random_tiny(tmp_path):
    """`up` in both layouts over two CPU engines (P/D's KV over shm), three rates each: every
    row with a number, and no process of it left."""
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--skip-vllm", "--model", "random:tiny", "--tiny",
         "--gpus", "2", "--rounds", "1", "--workdir", str(work), "--out",
         str(tmp_path / "peers.md")], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "peers.md").read_text().splitlines()
    assert lines[0] == "| figure | up |"
    rows = [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]
    per_rate = ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "JCT p99 ms",
                "total tokens/s", "goodput req/s/GPU"]
    assert rows == [row for layout in ("dp", "pd") for row in (
        f"{layout} start-up s",
        *(f"{layout} {r}/s/GPU {m}" for r in (1, 2, 4) for m in per_rate))]
    for line in lines[2:]:
        cell = line.strip("| ").split(" | ")[1]
        assert float(cell.split(" [")[0].replace(",", "")) > 0, line
    assert sorted(p.name for p in work.glob("*.toml")) == ["peers-up-dp.toml", "peers-up-pd.toml"]
    result = json.loads((tmp_path / "peers.json").read_text())
    assert len(result["samples"]["up"]) == 2  # one per layout
    mark = f"BENCH_PEERS_RUN={work}".encode()
    assert [pid for pid in os.listdir("/proc") if pid.isdigit() and mark in _environ(pid)] == []


def test_goodput_rows_point_up():
    from bench.peers.figures import higher_is_better

    assert higher_is_better("dp 2/s/GPU goodput req/s/GPU")
    assert higher_is_better("pd 2/s/GPU total tokens/s")
    assert not higher_is_better("pd 2/s/GPU JCT p99 ms")


def test_a_layout_that_cannot_start_is_reported_and_the_run_goes_on(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--skip-vllm", "--model", "random:tiny", "--tiny",
         "--gpus", "2", "--layouts", "pd", "--pd-kv-transfer", "carrier-pigeon", "--rounds", "1",
         "--workdir", str(work)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 1 up pd: failed: up-pd did not start" in proc.stdout
    assert "carrier-pigeon" in (work / "up-pd.log").read_text()
    mark = f"BENCH_PEERS_RUN={work}".encode()
    assert [pid for pid in os.listdir("/proc") if pid.isdigit() and mark in _environ(pid)] == []


@pytest.mark.parametrize("which", ["poisson", "pd"])
async def test_each_rate_sends_prompts_no_earlier_rate_sent(monkeypatch, which):
    """A later rate that resent the earlier rate's prompts would time prefix-cache hits (the
    first two-GPU run did: TTFT p50 80 ms at 2/s/GPU, 20 ms at 4): every rate draws its own."""
    from bench.peers import figures, two_gpus
    from bench.serve import workload

    sent: list[list[list[int]]] = []
    files = []  # where each Poisson run's requests go

    async def fake_run(ns, slo=None, gpus=1):
        sent.append([prompt for prompt, _ in workload(ns)])
        files.append(getattr(ns, "requests_out", None))
        row = {"p50_ms": 1.0, "p99_ms": 1.0}
        return {"ttft": row, "tpot": row, "jct": row, "total_tokens_per_s": 1.0,
                "failed": 0, "errors": [], "completed": ns.num_requests,
                "slo": {"goodput_per_gpu": 1.0}}

    monkeypatch.setattr(figures, "serve_run", fake_run)
    monkeypatch.setattr(two_gpus, "serve_run", fake_run)
    monkeypatch.setattr(figures, "check", lambda result, what: None)
    monkeypatch.setattr(two_gpus, "check", lambda result, what: None)
    if which == "poisson":
        args = SimpleNamespace(rates=[8.0, 16.0, 24.0], poisson_requests=5, poisson_input=32,
                               poisson_output=4, run_dir=Path("/runs"), trace_name="engine-r1")
        await figures.poisson("http://x/v1", "m", args, 1000)
        assert files == [Path(f"/runs/requests-engine-r1-{r}per-s.jsonl") for r in (8, 16, 24)]
    else:
        args = SimpleNamespace(pd_rates=[2.0, 3.0, 4.0], pd_requests=5, pd_input=32,
                               pd_output=4, slo_ttft_s=2.0, slo_tpot_ms=25.0)
        await two_gpus.rates("http://x/v1", "pd", args, 1000)
    assert len(sent) == 3
    seen = [{tuple(p) for p in rate} for rate in sent]
    assert all(len(s) == 5 for s in seen)
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_a_prompt_seed_keeps_the_lengths_and_draws_other_token_ids():
    """bench.serve's --prompt-seed (microserve ab's too): the same schedule with prompts no
    other run sent; without it the workload is what --seed alone always gave."""
    import argparse
    import random

    from bench.serve import workload, workload_options

    ap = argparse.ArgumentParser()
    workload_options(ap)
    base = ap.parse_args(["--num-requests", "20", "--input-len", "8:40", "--output-len", "4:9",
                          "--seed", "3"])
    plain = workload(base)
    rng = random.Random(3)  # what --seed alone has always drawn: lengths, then token ids
    lengths = [(rng.randint(8, 40), rng.randint(4, 9)) for _ in range(20)]
    assert plain == [([rng.randrange(32000) for _ in range(n)], m) for n, m in lengths]
    one, two = (workload(argparse.Namespace(**{**vars(base), "prompt_seed": k})) for k in (1, 2))
    for other in (one, two):
        assert [(len(p), m) for p, m in other] == lengths
    prompts = [{tuple(p) for p, _ in w} for w in (plain, one, two)]
    assert not (prompts[0] & prompts[1] or prompts[0] & prompts[2] or prompts[1] & prompts[2])
