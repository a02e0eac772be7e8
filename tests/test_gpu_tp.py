"""Tensor parallelism on two GPUs (NCCL, CUDA graphs over the all-reduces): in fp32 a TP 2
engine gives the greedy tokens of a TP 1 engine (and, for the tiny model, of Hugging Face),
with graphs and eagerly. Each engine runs in a process of its own: a process joins one NCCL
group in its life (engine/tp/group.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy
from test_engine_core import random_prompts

pytestmark = pytest.mark.gpu

_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from test_engine_core import greedy, run_all
from engine.config import EngineConfig
from engine.core import EngineCore
prompts = json.loads(sys.argv[1])
core = EngineCore(EngineConfig(model={model!r}, device="cuda", dtype="float32", page_size=16,
                               num_pages=256, max_num_seqs=16, **json.loads(sys.argv[2])))
got = run_all(core, {{f"r{{i}}": p for i, p in enumerate(prompts)}}, greedy(32))
core.close()
print(json.dumps([got[f"r{{i}}"][0] for i in range(len(prompts))]))
"""


@pytest.fixture(autouse=True)
def two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def tokens(model: str, prompts: list[list[int]], **config) -> list[list[int]]:
    """Greedy tokens of an engine with `config`, run in a process of its own."""
    code = _RUN.format(tests=str(Path(__file__).parent), model=model)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts), json.dumps(config)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_fp32_tiny_tp2_equals_hf(tiny_model_dir, eager):
    prompts = random_prompts([1, 5, 17, 40, 64, 90, 33])
    ref = hf_greedy(tiny_model_dir, prompts, 32)
    assert tokens(tiny_model_dir, prompts, tensor_parallel_size=2, enforce_eager=eager,
                  max_num_batched_tokens=40) == ref


def test_fp32_llama_1b_shape_tp2_equals_tp1(tmp_path):
    """random:llama-3.2-1b (32 heads, 8 KV heads, tied embeddings) in fp32."""
    from microserve.random_models import materialize

    model = str(materialize("random:llama-3.2-1b", tmp_path))
    prompts = random_prompts([7, 300, 1000], vocab=128256)
    one = tokens(model, prompts, max_num_batched_tokens=512)
    assert tokens(model, prompts, tensor_parallel_size=2, max_num_batched_tokens=512) == one
