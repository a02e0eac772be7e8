"""Tensor parallelism on two GPUs (NCCL, CUDA graphs over the all-reduces): in fp32 a TP 2
engine gives the greedy tokens of a TP 1 engine (and, for the tiny model, of Hugging Face),
with graphs and eagerly, in one process after another."""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from test_engine_core import greedy, random_prompts, run_all

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def make_core(model_dir, **kw):
    from engine.config import EngineConfig
    from engine.core import EngineCore

    kw.setdefault("page_size", 16)
    kw.setdefault("num_pages", 256)
    kw.setdefault("max_num_seqs", 16)
    return EngineCore(EngineConfig(model=model_dir, device="cuda", dtype="float32", **kw))


def tokens(core, prompts, n=32):
    try:
        got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(n))
    finally:
        core.close()
    return [got[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_fp32_tiny_tp2_equals_hf(tiny_model_dir, eager):
    prompts = random_prompts([1, 5, 17, 40, 64, 90, 33])
    ref = hf_greedy(tiny_model_dir, prompts, 32)
    core = make_core(tiny_model_dir, tensor_parallel_size=2, enforce_eager=eager,
                     max_num_batched_tokens=40)
    assert (core.runner.graphs is None) == eager
    assert tokens(core, prompts) == ref


def test_fp32_llama_1b_shape_tp2_equals_tp1(tmp_path):
    """random:llama-3.2-1b (32 heads, 8 KV heads, tied embeddings) in fp32."""
    from microserve.random_models import materialize

    model = str(materialize("random:llama-3.2-1b", tmp_path))
    prompts = random_prompts([7, 300, 1000], vocab=128256)
    one = tokens(make_core(model, max_num_batched_tokens=512), prompts)
    two = tokens(make_core(model, tensor_parallel_size=2, max_num_batched_tokens=512), prompts)
    assert two == one
