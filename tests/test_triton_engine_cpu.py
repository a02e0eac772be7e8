"""The Triton attention backend and fused kernels inside the real engine, on CPU under the
Triton interpreter: the tiny model's greedy tokens equal Hugging Face's, as with the torch
backend. (On a GPU, tests/test_gpu_engine.py runs the same path compiled, with CUDA graphs.)"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    pytest.skip("covered compiled by test_gpu_engine.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from conftest import hf_greedy  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from kvcache.forward import ForwardBatch  # noqa: E402
from test_engine_core import greedy, next_decode_step, random_prompts, run_all  # noqa: E402
from test_prompt_logprobs import assert_hf_scores, collect, scoring  # noqa: E402


def triton_core_equals_hf(model_dir, prompts, n_new, **config) -> tuple[EngineCore, list]:
    """A Triton-backend engine (page size 4) that has run `prompts` together, each giving
    Hugging Face's greedy tokens; returns it and those tokens."""
    ref = hf_greedy(model_dir, prompts, n_new)
    core = EngineCore(EngineConfig(model=model_dir, attention_backend="triton", page_size=4,
                                   **config))
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(n_new))
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i}"
    return core, ref


def test_triton_backend_engine_equals_hf(tiny_model_dir):
    prompts = random_prompts([1, 9, 17, 40], seed=11)
    core, ref = triton_core_equals_hf(tiny_model_dir, prompts, 12, num_pages=64,
                                      max_num_batched_tokens=24, max_num_seqs=8)
    got = run_all(core, {f"again{i}": p for i, p in enumerate(prompts)}, greedy(12))
    for i, expected in enumerate(ref):
        assert got[f"again{i}"] == (expected, (len(prompts[i]) - 1) // 4 * 4)



def test_whole_prompts_attend_with_sdpa_and_equal_hf(tiny_model_dir, monkeypatch):
    """`prompt_attention="sdpa"`: a step whose prompt rows are all whole prompts or first
    chunks (no cached prefix), at most DENSE_MAX_SEQS of them (2 here), attends them with
    torch's SDPA over the step's own K/V, one call a prompt and layer; more prompts, or a chunk
    over a cached prefix (later chunks, prompts run again) take the paged kernel. Greedy tokens
    equal Hugging Face's either way, and the KV the SDPA steps cached serves a second run."""
    import engine.attention.triton_backend as tb

    calls, real = [], tb._causal_sdpa

    def counted(q, k, v, scale):
        calls.append(q.shape[0])
        return real(q, k, v, scale)

    monkeypatch.setattr(tb, "_causal_sdpa", counted)
    monkeypatch.setattr(tb, "DENSE_MAX_SEQS", 2)
    steps, plan = [], tb.TritonAttentionBackend.plan

    def planned(self, batch):
        plan(self, batch)
        ext = batch.seqs[self.num_decode:]
        if ext:
            steps.append(([(s.context_len, s.num_new_tokens) for s in ext],
                          [b - a for a, b in self.dense]))

    monkeypatch.setattr(tb.TritonAttentionBackend, "plan", planned)
    # three whole prompts in the first step: over the cap, so no SDPA
    prompts = random_prompts([5, 9, 17, 40], seed=11)
    core, ref = triton_core_equals_hf(tiny_model_dir, prompts, 12, num_pages=64,
                                      max_num_batched_tokens=24, max_num_seqs=8,
                                      prompt_attention="sdpa")  # fmt: skip
    assert steps[0] == ([(0, 5), (0, 9), (0, 10)], []) and calls == []
    assert all(dense == [] for _, dense in steps)
    # two fresh prompts: 20 whole and the first 4 of 30 by SDPA; the rest of 30 over that prefix
    steps.clear()
    fresh = random_prompts([20, 30], seed=12)
    want = hf_greedy(tiny_model_dir, fresh, 12)
    got = run_all(core, {f"fresh{i}": p for i, p in enumerate(fresh)}, greedy(12))
    assert [got[f"fresh{i}"][0] for i in range(2)] == want
    assert steps[:2] == [([(0, 20), (0, 4)], [20, 4]), ([(4, 23)], [])]  # beside a decode
    layers = core.runner.model.config.num_layers
    assert calls == [20, 4] * layers
    # the same prompts again: everything but their last page's tokens cached, no SDPA
    before = len(calls)
    got = run_all(core, {f"again{i}": p for i, p in enumerate(prompts + fresh)}, greedy(12))
    for i, expected in enumerate(ref + want):
        assert got[f"again{i}"] == (expected, (len((prompts + fresh)[i]) - 1) // 4 * 4)
    assert len(calls) == before
    core.check_integrity()


def test_prompt_attention_auto_takes_sdpa_only_for_few_long_whole_prompts():
    """`auto` (DENSE_AUTO_MIN_TOKENS): SDPA where it measured faster — at most
    DENSE_MAX_SEQS whole prompts of 4,096 tokens or more, all of the step's prompt rows — and
    the paged kernel for shorter prompts, a chunk over a cached prefix beside them, or more
    prompts. Outside 16-bit q only while the math kernel's scores stay small; never over an
    fp8 cache."""
    from engine.attention.triton_backend import (
        DENSE_AUTO_MIN_TOKENS,
        DENSE_MAX_SEQS,
        TritonAttentionBackend,
    )
    from kvcache.forward import SeqForward

    assert (DENSE_AUTO_MIN_TOKENS, DENSE_MAX_SEQS) == (4096, 8)
    backend = TritonAttentionBackend("cpu", 4, 2, 8, max_tokens=9 * 4096 + 1, max_seqs=10,
                                     max_pages_per_seq=640, page_size=16,
                                     dense_min_tokens=4096)  # fmt: skip
    ids = iter(range(1000))

    def plan(*seqs):  # (cached, new) per sequence
        batch, page = [], 0
        for cached, new in seqs:
            pages = -(-(cached + new) // 16)
            batch.append(SeqForward(f"s{next(ids)}", cached, new, list(range(page, page + pages))))
            page += pages
        backend.plan(ForwardBatch(batch, 16))
        return backend.dense

    assert plan((0, 4096), (0, 5000)) == [(0, 4096), (4096, 9096)]
    assert plan((70, 1), (0, 4096)) == [(1, 4097)]  # a decode row before it
    assert plan((0, 4095)) == []
    assert plan((0, 4096), (0, 100)) == []
    assert plan((0, 4096), (16, 4096)) == []  # a chunk over a cached prefix
    assert plan(*[(0, 4096)] * 9) == []
    assert len(plan(*[(0, 4096)] * 8)) == 8
    assert plan((70, 1), (71, 1)) == []
    plan((0, 4100))
    cache16 = torch.zeros(1, dtype=torch.bfloat16)
    q16 = torch.zeros(4100, 4, 8, dtype=torch.bfloat16)
    assert backend._dense_fits(q16, cache16)
    assert not backend._dense_fits(q16, torch.zeros(1, dtype=torch.float8_e4m3fn))
    assert not backend._dense_fits(q16.float(), cache16.float())  # 4 x 4,100^2 scores > 2^26
    plan((0, 4096))
    assert backend._dense_fits(q16[:4096].float(), cache16.float())  # 4 x 4,096^2 = 2^26


def test_few_rows_projections_match_cublas_path_in_the_engine(tiny_model_dir):
    """`few_rows_gemm`: a decode step of 2..N sequences runs the projections and the LM head
    through the few-rows kernel (fp16 here: the interpreter's bf16 dots are wrong); its logits
    match the same step with torch's projections, and steps of one row or more than N rows
    take torch's. The engine keeps generating with it (every request finishes)."""
    import torch.nn.functional as F

    few = []  # (rows) of each call the kernel took
    import engine.kernels.few_rows as kernel

    real = kernel.few_rows_linear

    def counted(x, weight, out=None, config=None):
        few.append(x.shape[0])
        return real(x, weight, out, config)

    core = EngineCore(EngineConfig(model=tiny_model_dir, attention_backend="triton", page_size=4,
                                   num_pages=64, max_num_seqs=8, dtype="float16",
                                   few_rows_gemm=3))  # fmt: skip
    runner = core.runner
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.few_rows == 3 and runner.model.few_rows_logits == 3
    prompts = random_prompts([5, 9, 13, 7], seed=4)
    for i, p in enumerate(prompts[:3]):
        core.add_request(f"r{i}", p, greedy(6))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in core.scheduler.running) or (
            core.scheduler.waiting):  # fmt: skip
        core.step()
    seqs = list(core.scheduler.running)
    assert len(seqs) == 3
    batch, ids = next_decode_step(core)
    kernel.few_rows_linear = counted
    try:
        with torch.inference_mode():
            hidden = runner._forward_eager(batch, ids)
            logits = runner.model.compute_logits(hidden)
            runner.model.use_triton_kernels(True, few_rows=0)
            ref_hidden = runner._forward_eager(batch, ids)
            ref = F.linear(ref_hidden, runner.model.lm_head.weight).float()
    finally:
        kernel.few_rows_linear = real
        runner.model.use_triton_kernels(True, few_rows=3)
    n_layers = len(runner.model.model.layers)
    assert few == [3] * (4 * n_layers + 1)  # qkv, o, gate_up, down a layer; the LM head
    torch.testing.assert_close(hidden.float(), ref_hidden.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits, ref, atol=5e-2, rtol=2e-2)
    core.add_request("r3", prompts[3], greedy(6))  # the three decode on with a fourth
    tokens = {f"r{i}": [] for i in range(4)}
    for s in seqs:
        tokens[s.request_id] = list(s.output_token_ids)
    few.clear()
    kernel.few_rows_linear = counted
    try:
        while core.has_work():
            for out in core.step():
                tokens[out.request_id] += out.token_ids
    finally:
        kernel.few_rows_linear = real
    assert [len(t) for t in tokens.values()] == [6] * 4
    assert set(few) <= {2, 3}  # four rows or a prompt's 16: torch's projections


def test_piecewise_buckets_come_every_step_tokens_above_512():
    """Steps pad to their bucket; above 512 tokens the buckets come every
    `piecewise_bucket_step` tokens and end at the largest step exactly."""
    from engine.cuda_graphs import piece_buckets

    small = [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert piece_buckets(24, 64) == [16, 24]
    assert piece_buckets(512, 64) == small
    assert piece_buckets(700, 64) == small + [576, 640, 700]
    assert piece_buckets(2048, 256) == small + [768, 1024, 1280, 1536, 1792, 2048]
    assert piece_buckets(2048, 64) == small + list(range(576, 2049, 64))
    assert len(piece_buckets(2048, 64)) == 35


@pytest.mark.parametrize("prompt_attention", ["paged", "sdpa"])
def test_piecewise_forward_equals_hf_with_mixed_and_padded_steps(tiny_model_dir, monkeypatch,
                                                                 prompt_attention):
    """The forward pass cut at attention (engine/cuda_graphs.py's PiecewiseGraphs, run here
    without capturing: the same pieces, launched one by one) in the real engine: prefill
    chunks beside decodes, every step padded to a bucket (16 or 24 tokens), Hugging Face's
    greedy tokens; the pad rows store nothing (a stray write would corrupt another
    sequence's KV and change its tokens). With `sdpa`, whole prompts attend to the pieces'
    own K/V rows (the qkv buffer's, rotated by the piece before)."""
    import engine.attention.triton_backend as tb
    from engine.cuda_graphs import PiecewiseGraphs

    prompts = random_prompts([3, 9, 17, 30], seed=21)
    ref = hf_greedy(tiny_model_dir, prompts, 10)
    core = EngineCore(EngineConfig(model=tiny_model_dir, attention_backend="triton", page_size=4,
                                   num_pages=64, max_num_batched_tokens=24, max_num_seqs=4,
                                   prompt_attention=prompt_attention))  # fmt: skip
    runner = core.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv, runner.kv.backend, 24, use_graphs=False)
    assert pieces.buckets == [16, 24]
    steps = []
    run = pieces.run

    def counted(batch, input_ids, fill=None, mark_layers_left=0):
        chunks = sum(s.num_new_tokens > 1 for s in batch.seqs)
        steps.append((len(input_ids), chunks, len(batch.seqs) - chunks))
        return run(batch, input_ids, fill, mark_layers_left)

    def eager(*args):
        raise AssertionError("a step ran eagerly")

    pieces.run = counted
    runner.pieces, runner._forward_eager = pieces, eager
    sdpa, real_sdpa = [], tb._causal_sdpa
    monkeypatch.setattr(tb, "_causal_sdpa", lambda q, k, v, scale: (
        sdpa.append(q.shape[0]), real_sdpa(q, k, v, scale))[1])
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(10))
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i}"
    assert any(n not in (16, 24) for n, _, _ in steps)  # padded
    assert any(chunks and decodes for _, chunks, decodes in steps)  # chunks beside decodes
    # the first step, [3, 9, 12 of 17], is whole prompts: SDPA on each, every layer
    layers = runner.model.config.num_layers
    assert steps[0] == (24, 3, 0)
    assert sdpa == ([3, 9, 12] * layers if prompt_attention == "sdpa" else [])
    # Prompt logprobs read the pieces' hidden states (the last piece's static output, padded)
    prompt = random_prompts([30], seed=22)[0]
    assert_hf_scores(tiny_model_dir, prompt,
                     collect(core, {"scored": (prompt, scoring())})["scored"][1])
    core.check_integrity()


def test_device_page_tables_follow_shared_prefixes_and_preemption(tiny_model_dir):
    """Page tables stay on the device between steps; the KV manager changes them in place when
    a sequence switches to a prefix another computed first, and frees them on preemption. The
    tokens still equal Hugging Face's (a stale row would read another sequence's KV), and every
    row is given back."""
    base = random_prompts([22], seed=3)[0]
    prompts = [base, base, base + [5, 6, 7], random_prompts([30], seed=4)[0]]
    core, _ = triton_core_equals_hf(tiny_model_dir, prompts, 16, num_pages=26,
                                    max_num_batched_tokens=16, max_num_seqs=4)
    assert core.stats().preemptions > 0
    tables = core.runner.kv.backend.tables
    # The last drops reach the tables with the next step's batch; then no row is held.
    tables.sync(ForwardBatch([], 4, core.kv.take_table_changes()))
    assert len(tables) == 0


def test_mixed_forward_equals_hf_with_decodes_beside_small_padded_chunks(tiny_model_dir):
    """Decodes beside one small prompt chunk as one padded pass (engine/cuda_graphs.py's
    MixedGraphs, run here without capturing): decode rows padded to a bucket, the chunk's rows
    padded to 8 with its kv_len grown by as much. Hugging Face's greedy tokens: the padded
    rows neither store (another sequence's KV would change) nor shift the chunk's positions.
    Three seats and a step budget of 10: two decodes beside up to 8 tokens of a third prompt,
    one decode beside a chunk, a short prompt alone (one padding decode row)."""
    from engine.cuda_graphs import MixedGraphs

    core = EngineCore(EngineConfig(model=tiny_model_dir, attention_backend="triton", page_size=4,
                                   num_pages=96, max_num_batched_tokens=10, max_num_seqs=3))
    runner = core.runner
    mixed = MixedGraphs(runner.model, runner.kv, runner.kv.backend, 3, chunk=8,
                        use_graphs=False)
    assert mixed.buckets == [1, 2]  # 3 rows (+1 for the chunk) and 10 tokens (+8) allow these
    ran = []
    run = mixed.run

    def counted(batch, input_ids, fill=None):
        ran.append((len(batch.seqs) - 1, batch.seqs[-1].num_new_tokens))
        return run(batch, input_ids, fill)

    mixed.run = counted
    runner.mixed = mixed
    for seed, lengths in ((23, [3, 9, 17, 30, 12, 21]), (24, [3, 20]), (25, [6])):
        prompts = random_prompts(lengths, seed=seed)
        ref = hf_greedy(tiny_model_dir, prompts, 10)
        got = run_all(core, {f"r{seed}-{i}": p for i, p in enumerate(prompts)}, greedy(10))
        for i, expected in enumerate(ref):
            assert got[f"r{seed}-{i}"][0] == expected, f"seed {seed}, prompt {i}"
    assert {d for d, _ in ran} == {0, 1, 2}  # both buckets, and a chunk alone
    assert any(n < 8 for _, n in ran)  # a padded chunk
    core.check_integrity()
