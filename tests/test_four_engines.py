"""The four-GPU layouts (deploy/gpu-1p2d.toml, deploy/gpu-2p2d.toml) with CPU engines of the
embedded model: the whole `bench.strategies` pipeline runs over four engines — 2P2D, 1P2D on
three of them, data parallel over four and over three — and answers every request, with KV
moving exactly where each strategy sends it. What the four-GPU runs of the paper's Fig. 10 and
11 need, checked before those machines are lent."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from daemons import free_port
from deployments import toml_value

from bench.strategies import main as bench_main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def cpu_copy(path: Path, out: Path, model_dir: str) -> Path:
    """The deployment file with its engines on the CPU (shm between them)."""
    config = tomllib.loads(path.read_text())
    lines = [f"model = {toml_value(model_dir)}", "", "[router]",
             f"strategy = {toml_value(config['router']['strategy'])}", ""]
    for engine in config["engines"]:
        args = [a for a in engine["args"] if a not in ("--device", "--kv-transfer")
                and not a.startswith("cuda")]
        lines += ["[[engines]]", f"name = {toml_value(engine['name'])}",
                  f"role = {toml_value(engine['role'])}", f"port = {free_port()}",
                  f"args = {toml_value(args + ['--kv-cache-memory-gb', '0.25', '--cpu-threads', '1'])}",
                  ""]
    out.write_text("\n".join(lines))
    return out


def test_the_2p2d_layout_serves_every_strategy_and_moves_kv_where_each_sends(
        smollm2_dir, tmp_path):
    assert tomllib.loads((ROOT / "deploy/gpu-1p2d.toml").read_text())["engines"][2]["name"] \
        == "decode-1"  # the 1P2D file names the engines the 1p2d run below uses
    config = cpu_copy(ROOT / "deploy/gpu-2p2d.toml", tmp_path / "cpu-2p2d.toml", smollm2_dir)
    record = tmp_path / "run.json"
    bench_main([str(config), "--port", str(free_port()), "--input-len", "48:0",
                "--output-len", "4:0", "--rates", "1", "--duration-s", "1",
                "--min-requests", "4", "--run-timeout-s", "240",
                "--strategy", "2p2d=pd", "--strategy", "1p2d=pd@prefill-0,decode-0,decode-1",
                "--strategy", "dp", "--strategy", "dp3=data_parallel@prefill-0,decode-0,decode-1",
                "--log", str(tmp_path / "up.log"), "--json", str(record)])
    runs = {r["strategy"]: r for r in json.loads(record.read_text())["runs"]}
    assert list(runs) == ["2p2d", "1p2d", "dp", "dp3"]
    for name, run in runs.items():
        assert (run["completed"], run["failed"], run["timed_out"]) == (run["requests"], 0, 0), name
        assert run["gpus"] == (3 if name in ("1p2d", "dp3") else 4)
    counters = {name: run["engine_counters"] for name, run in runs.items()}
    # P/D: the decode engines computed no prompt token of a fresh prompt but its last (P sent
    # all but that one, or all of it with the first token); only prefill engines sent
    for name in ("2p2d", "1p2d"):
        sent = sum(c["kv_tokens_sent"] for c in counters[name].values())
        received = sum(c["kv_tokens_received"] for c in counters[name].values())
        assert sent == received > 0, name
        assert all(c["kv_tokens_sent"] == 0 for e, c in counters[name].items()
                   if e.startswith("decode")), name
    assert counters["1p2d"]["prefill-1"]["prompt_tokens"] == 0  # drained for 1P2D
    assert counters["dp3"]["prefill-1"]["prompt_tokens"] == 0
    for name in ("dp", "dp3"):
        assert sum(c["kv_tokens_sent"] for c in counters[name].values()) == 0, name
