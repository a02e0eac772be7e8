"""bench.lora_gpu's CPU smoke run (`--device cpu`, random:tiny): every phase the GPU run
measures runs end to end and reports its fields, so the bench does not rot between device
calls. The figures themselves are the GPU's (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_bench_runs_every_phase_on_cpu(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.lora_gpu", "--device", "cpu", "--model", "random:tiny",
         "--adapters", "2", "--rank", "8", "--requests", "4", "--num-pages", "512",
         "--only", "throughput,load", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["startup_load_ms_mean"] > 0 and result["startup_slot_write_ms_mean"] > 0
    assert result["throughput"]["lora"]["output_tokens_per_s"] > 0
    load = result["load"]
    assert load["load_ms"] > 0 and load["steps_during_load"] >= 1
    assert {"step_ms_max_while_pinning_spare", "alone_read_into_slab_ms", "slot_write_ms_mean"} <= set(load)
