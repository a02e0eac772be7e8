"""bench.engine_host drives the real EngineCore with a stub model: it must keep up with the
core's runner interface (it once fell behind `ModelRunner.sample`'s signature unnoticed)."""

from __future__ import annotations

from bench.engine_host import run


def test_engine_host_bench_runs_its_workload_to_the_end():
    out = run(6, profile=False, budget=64, max_seqs=4, input_len=(20, 40), output_len=(3, 5))
    assert out["requests"] == 6 and out["preemptions"] == 0
    # every request got exactly its output tokens (the stub samples token 7 for each row)
    assert 6 * 3 <= out["output_tokens"] <= 6 * 5
    assert out["steps"] >= out["output_tokens"] // 4  # at most 4 sequences per step
