"""The engine on CUDA: Triton attention + fused kernels + decode CUDA graphs.

An fp32 tiny model must give exactly Hugging Face's greedy tokens (as on CPU), with graphs and
without; in bf16, a graph replay must match the eager forward of the same step.
"""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from test_engine_core import greedy, next_decode_step, random_prompts, run_all

pytestmark = pytest.mark.gpu


def make_core(model_dir, **kw):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    kw.setdefault("page_size", 16)
    kw.setdefault("num_pages", 128)
    kw.setdefault("max_num_seqs", 16)
    return EngineCore(EngineConfig(model=model_dir, device="cuda", **kw))


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    prompts = random_prompts([1, 5, 17, 40, 64, 90, 33])
    return prompts, hf_greedy(tiny_model_dir, prompts, 32)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("prompt_attention", ["paged", "sdpa"])
def test_fp32_tiny_equals_hf_on_gpu(tiny_model_dir, tiny_ref, eager, prompt_attention):
    """Hugging Face's greedy tokens through graphs or eager steps; with `sdpa`, whole prompts'
    attention through torch's SDPA over the step's own K/V."""
    prompts, ref = tiny_ref
    core = make_core(tiny_model_dir, dtype="float32", enforce_eager=eager,
                     max_num_batched_tokens=40, max_prefill_step_tokens=40,
                     mixed_graph_tokens=32, prompt_attention=prompt_attention)  # fmt: skip
    runner = core.runner
    assert (runner.graphs is None) == eager and (runner.pieces is None) == eager
    piecewise, mixed = [], []
    if not eager:  # prefill steps replay the piecewise graphs (every step here is <= 40 tokens)
        run = runner.pieces.run
        runner.pieces.run = lambda *a: piecewise.append(len(a[1])) or run(*a)
        run_mixed = runner.mixed.run  # ... or a mixed graph: decodes beside <= 32 of a prompt
        runner.mixed.run = lambda *a: mixed.append(len(a[1])) or run_mixed(*a)
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i} (len {len(prompts[i])})"
    assert eager or (runner.pieces.buckets == [16, 32, 40] and len(piecewise) + len(mixed) >= 7)
    # Prefix-cache hits through the extend kernel over cached pages.
    got = run_all(core, {f"again{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"again{i}"][0] == expected


def test_launch_marks_ride_the_piecewise_steps_and_leave_the_tokens_hf(tiny_model_dir, tiny_ref):
    """--launch-ahead-layers 1, async: each step replayed as piecewise graphs carries an event
    recorded with one layer left (the loop holds the next launch until it fires), decode-only
    steps none; launch_ready reads a fired mark once and drops it; tokens are Hugging Face's."""
    import torch

    prompts, ref = tiny_ref
    core = make_core(tiny_model_dir, dtype="float32", async_scheduling=True,
                     launch_ahead_layers=1, max_num_batched_tokens=40,
                     max_prefill_step_tokens=40)  # fmt: skip
    runner, marks, pieces = core.runner, [], []
    run, launch = runner.pieces.run, core._launch
    runner.pieces.run = lambda *a: pieces.append(a[3]) or run(*a)

    def spy(*a, **k):
        launched = launch(*a, **k)
        if launched is not None:
            marks.append(launched.near_end)
        return launched

    core._launch = spy
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == ref
    assert pieces and set(pieces) == {1}
    assert sum(isinstance(m, torch.cuda.Event) for m in marks) == len(pieces)
    assert sum(m is None for m in marks) == len(marks) - len(pieces) > 0  # the decode steps
    core.add_request("late", random_prompts([30], seed=77)[0], greedy(4))  # no cached prefix
    core.step()
    assert core._in_flight.near_end is not None
    torch.cuda.synchronize()
    assert core.launch_ready() and core._in_flight.near_end is None and core.launch_ready()
    while core.has_work():
        core.step()
    core.check_integrity()


@pytest.mark.parametrize("eager", [False, True])
def test_fp32_tiny_with_an_fp8_cache_equals_hf_reading_fp8_kv(tiny_model_dir, tiny_ref, eager):
    """--kv-cache-dtype fp8 on the GPU (compiled kernels: the store rounds to nearest even,
    as torch does): Hugging Face's greedy tokens with its attention reading K and V rounded to
    e4m3 (bench.fp8_quality.hf_fp8_kv), through graphs and prefix-cache hits. Whole prompts
    keep the paged kernel over the rounded cache though `sdpa` is asked for."""
    import torch

    from bench.fp8_quality import hf_fp8_kv
    from conftest import _hf_model

    prompts, _ = tiny_ref
    with hf_fp8_kv(_hf_model(tiny_model_dir)):
        ref = hf_greedy(tiny_model_dir, prompts, 32)
    core = make_core(tiny_model_dir, dtype="float32", enforce_eager=eager,
                     max_num_batched_tokens=40, max_prefill_step_tokens=40,
                     kv_cache_dtype="fp8", prompt_attention="sdpa")  # fmt: skip
    assert core.runner.kv.kv.dtype == torch.float8_e4m3fn
    for tag in ("first", "again"):  # again: the prompts' prefixes come from the cache
        got = run_all(core, {f"{tag}{i}": p for i, p in enumerate(prompts)})
        for i, expected in enumerate(ref):
            assert got[f"{tag}{i}"][0] == expected, f"{tag} prompt {i}"


def test_bf16_graph_replay_matches_eager(tiny_model_dir):
    import torch

    from kvcache.forward import ForwardBatch, SeqForward

    # Sync scheduling: after step() every output token is known on the host (async would
    # leave the newest one pending, on the device).
    core = make_core(tiny_model_dir, dtype="bfloat16", async_scheduling=False)
    runner = core.runner
    for i, p in enumerate(random_prompts([20, 50, 7], seed=5)):
        core.add_request(f"r{i}", p, greedy(8))
    for _ in range(3):
        core.step()
    seqs = core.scheduler.running
    batch = ForwardBatch(
        [SeqForward(s.request_id, s.num_computed_tokens, 1,
                    core.kv.page_table(s.request_id)) for s in seqs], core.kv.page_size,
    )  # fmt: skip
    # Contexts 22, 52, 9: the next token's slot is inside an already allocated page.
    ids = [s.output_token_ids[-1] for s in seqs]
    with torch.inference_mode():
        graph = runner.graphs.run(batch, ids).clone()
        eager = runner._forward_eager(batch, ids)
    torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)


def _replay_matches_eager(core, graphs: str, chunk: int, seeds: tuple[int, int]):
    """Two decodes beside a `chunk`-token prompt chunk, run by `core.runner.<graphs>`, against
    the same step run eagerly: the hidden states, the KV stored at the step's slots, and nothing
    else in the pool changed. Returns the step's batch."""
    import torch

    from kvcache.forward import ForwardBatch, SeqForward

    runner = core.runner
    for i, p in enumerate(random_prompts([20, 50], seed=seeds[0])):
        core.add_request(f"r{i}", p, greedy(8))
    for _ in range(3):
        core.step()
    seqs = core.scheduler.running
    prompt = random_prompts([chunk], seed=seeds[1])[0]
    core.kv.open("new", [])
    assert core.kv.allocate("new", chunk)
    batch = ForwardBatch(
        [SeqForward(s.request_id, s.num_computed_tokens, 1, core.kv.page_table(s.request_id))
         for s in seqs] + [SeqForward("new", 0, chunk, core.kv.page_table("new"))],
        core.kv.page_size,
    )  # fmt: skip
    ids = [s.output_token_ids[-1] for s in seqs] + prompt
    slots = torch.tensor(batch.slot_mapping(), device="cuda")
    kv = runner.kv.kv
    with torch.inference_mode():
        before = kv.flatten(2, 3).clone()
        replayed = getattr(runner, graphs).run(batch, ids).clone()
        stored = kv.flatten(2, 3)[:, :, slots].clone()
        untouched = torch.ones(before.shape[2], dtype=torch.bool, device="cuda")
        untouched[slots] = False
        assert torch.equal(kv.flatten(2, 3)[:, :, untouched], before[:, :, untouched])
        eager = runner._forward_eager(batch, ids)
        stored_eager = kv.flatten(2, 3)[:, :, slots].clone()
    assert replayed.shape == eager.shape == (len(seqs) + chunk, eager.shape[1])
    torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(stored, stored_eager, atol=2e-2, rtol=2e-2)
    core.kv.free("new")
    return batch


def test_bf16_mixed_replay_matches_eager(tiny_model_dir):
    """Two decodes beside a 13-token prompt chunk (padded to the graph's 32, its kv_len grown by
    as much), replayed as one mixed graph, match the same step run eagerly and store the same KV,
    nothing else; a decode graph could not have run the step."""
    core = make_core(tiny_model_dir, dtype="bfloat16", async_scheduling=False,
                     mixed_graph_tokens=32)
    batch = _replay_matches_eager(core, "mixed", 13, (8, 9))
    assert core.runner.mixed.can_run(batch) and not core.runner.graphs.can_run(batch)


def test_bf16_piecewise_replay_matches_eager(tiny_model_dir):
    """A mixed step (two decodes and a 30-token prefill chunk, padded to the 32-token bucket)
    replayed as piecewise graphs matches the same step run eagerly, and stores the same KV."""
    core = make_core(tiny_model_dir, dtype="bfloat16", async_scheduling=False)
    _replay_matches_eager(core, "pieces", 30, (6, 7))


def test_bf16_piecewise_replay_above_512_tokens_matches_eager(tiny_model_dir, tmp_path):
    """Two decodes beside a 600-token prefill chunk pad to the 640-token bucket (buckets every
    64 tokens above 512) and match the same step run eagerly."""
    import json
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny-1k")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    core = make_core(str(model), dtype="bfloat16", async_scheduling=False,
                     max_num_batched_tokens=700, max_prefill_step_tokens=700)
    assert core.runner.pieces.buckets[-4:] == [512, 576, 640, 700]
    batch = _replay_matches_eager(core, "pieces", 600, (11, 12))
    assert batch.num_tokens == 602


def test_bf16_long_whole_prompts_through_sdpa_match_the_paged_kernel(tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """`--prompt-attention auto`: a step of two whole 4,096-token prompts
    attends them with torch's SDPA (cuDNN's kernel on Hopper), each once a layer, over the
    step's K/V; its hidden states match the same step through the paged extend kernel."""
    import json
    import shutil

    import torch

    import engine.attention.triton_backend as tb
    from kvcache.forward import ForwardBatch, SeqForward

    model = shutil.copytree(tiny_model_dir, tmp_path / "tiny-8k")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8192}))
    core = make_core(str(model), dtype="bfloat16", async_scheduling=False, num_pages=600,
                     max_prefill_step_tokens=8192, prompt_attention="auto")
    runner = core.runner
    calls, real = [], tb._causal_sdpa
    monkeypatch.setattr(tb, "_causal_sdpa",
                        lambda q, k, v, scale: (calls.append(q.shape[0]), real(q, k, v, scale))[1])
    prompts = random_prompts([4096, 4096], seed=13)
    seqs = []
    for name in ("a", "b"):
        core.kv.open(name, [])
        assert core.kv.allocate(name, 4096)
        seqs.append(SeqForward(name, 0, 4096, core.kv.page_table(name)))
    batch = ForwardBatch(seqs, core.kv.page_size)
    ids = prompts[0] + prompts[1]
    with torch.inference_mode():
        dense = runner._forward_eager(batch, ids).clone()
        assert calls == [4096, 4096] * runner.model.config.num_layers
        runner.kv.backend.dense_min_tokens = None
        paged = runner._forward_eager(batch, ids)
    assert len(calls) == 2 * runner.model.config.num_layers
    # two bf16 kernels summing 4,096 keys in different orders, then two layers of a random
    # model: compared as a whole (8.3e-3 on an H200; the kernels' own error is the test above)
    diff = (dense.float() - paged.float()).norm() / paged.float().norm()
    assert diff < 2e-2
    for name in ("a", "b"):
        core.kv.free(name)


def test_bf16_sdpa_of_a_whole_prompt_is_as_close_to_fp32_as_the_paged_kernel():
    """One layer's attention of a whole 4,096-token prompt at Llama-3.1-8B's heads (32 / 8,
    head_dim 128, bf16, q/k/v views of one qkv buffer as the engine passes them): torch's SDPA
    (`_causal_sdpa`) and the paged extend kernel against the same attention in fp32; SDPA's
    error is no larger than 1.5x the paged kernel's."""
    import torch

    from engine.attention.triton_backend import _causal_sdpa
    from engine.kernels.paged_attention import paged_extend_attention

    n, heads, kv_heads, d, ps = 4096, 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen, device="cuda",
                      dtype=torch.bfloat16)  # fmt: skip
    q, k, v = (x.view(n, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1))
    cache = torch.stack([k, v]).view(2, n // ps, ps, kv_heads, d).contiguous()
    table = torch.arange(n // ps, dtype=torch.int32, device="cuda")[None]
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    paged = paged_extend_attention(q, cache[0], cache[1], table, cu,
                                   torch.tensor([n], dtype=torch.int32, device="cuda"), n,
                                   d**-0.5, torch.empty_like(q))  # fmt: skip
    dense = _causal_sdpa(q, k, v, d**-0.5)
    ref = _causal_sdpa(q.float(), k.float(), v.float(), d**-0.5)

    def err(x):
        return ((x.float() - ref).norm() / ref.norm()).item()

    assert err(paged) < 1e-2 and err(dense) <= 1.5 * err(paged), (err(dense), err(paged))


def test_bf16_batch1_gemv_matches_cublas(tiny_model_dir):
    """Batch-1 decode runs its projections through the Triton GEMV (PDL launches inside the
    CUDA graph): the replayed step must match an eager step with cuBLAS projections."""
    import torch

    from kvcache.forward import ForwardBatch, SeqForward

    core = make_core(tiny_model_dir, dtype="bfloat16", async_scheduling=False)
    runner = core.runner
    assert runner.model.model.layers[0].use_gemv
    core.add_request("r", random_prompts([37], seed=9)[0], greedy(8))
    for _ in range(3):
        core.step()
    (s,) = core.scheduler.running
    batch = ForwardBatch([SeqForward(s.request_id, s.num_computed_tokens, 1,
                                     core.kv.page_table(s.request_id))], core.kv.page_size)
    ids = [s.output_token_ids[-1]]
    with torch.inference_mode():
        graph = runner.graphs.run(batch, ids).clone()
        runner.model.use_triton_kernels(True, gemv=False)
        try:
            eager = runner._forward_eager(batch, ids)
        finally:
            runner.model.use_triton_kernels(True, gemv=True)
    torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)


def test_bf16_few_rows_replay_matches_cublas(tiny_model_dir):
    """`few_rows_gemm`: a decode step of three sequences replays its CUDA graph with the
    projections and the LM head through the few-rows kernel; its hidden states match an
    eager step with cuBLAS projections, and its logits cuBLAS's."""
    import torch
    import torch.nn.functional as F

    core = make_core(tiny_model_dir, dtype="bfloat16", async_scheduling=False, few_rows_gemm=8)
    runner = core.runner
    assert runner.model.model.layers[0].mlp.down_proj.few_rows == 8
    for i, p in enumerate(random_prompts([37, 12, 20], seed=5)):
        core.add_request(f"r{i}", p, greedy(8))
    for _ in range(4):
        core.step()
    assert len(core.scheduler.running) == 3
    batch, ids = next_decode_step(core)
    with torch.inference_mode():
        graph = runner.graphs.run(batch, ids)[:3].clone()
        logits = runner.model.compute_logits(graph)
        runner.model.use_triton_kernels(True, gemv=True, few_rows=0)
        try:
            eager = runner._forward_eager(batch, ids)
        finally:
            runner.model.use_triton_kernels(True, gemv=True, few_rows=8)
        ref = F.linear(graph, runner.model.lm_head.weight).float()
    torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(logits, ref, atol=2e-2, rtol=2e-2)


def test_the_device_timeline_times_every_step_and_the_host_stays_one_ahead(tiny_model_dir,
                                                                          tiny_ref):
    """CUDA events around each step: after a run the GPU's busy seconds are positive and at
    most the run's wall time, every step has been collected, and no launch found more than
    the step before it still unfinished (the host's lead is one step)."""
    import time

    prompts, want = tiny_ref
    core = make_core(tiny_model_dir, dtype="float32", async_scheduling=True,
                     max_num_batched_tokens=64, max_prefill_step_tokens=64)
    try:
        started = time.perf_counter()
        got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
        wall = time.perf_counter() - started
        loop = core.loop
        assert [got[f"r{i}"][0] for i in range(len(prompts))] == want
        stats = core.stats()  # counts the steps finished since the last launch
        assert not core.device_timeline._pending  # ... which is every one by now
        assert loop.steps > 32 and stats.steps == loop.steps
        assert 0 < stats.device_busy_seconds < wall
        assert loop.device_steps_ahead <= loop.steps  # at most one unfinished at each launch
        # the decode-only steps: some (32 tokens a prompt), fewer than all, up to 7 a batch
        assert 0 < stats.device_decode_steps < stats.steps
        assert 0 < stats.device_decode_seconds < stats.device_busy_seconds
        assert (stats.device_decode_steps <= stats.device_decode_seqs
                <= 7 * stats.device_decode_steps)
        # one step in which nothing decoded: the first (1 + 5 + 17 + 40 tokens, and the 64's
        # first one: the budget of 64)
        assert (stats.device_prompt_steps, stats.device_prompt_tokens) == (1, 64)
        assert 0 < stats.device_prompt_seconds <= (stats.device_busy_seconds
                                                   - stats.device_decode_seconds)
    finally:
        core.close()
