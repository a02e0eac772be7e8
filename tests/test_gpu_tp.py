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


_PD = """
import faulthandler, json, sys
faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where, in the test's output
sys.path.insert(0, {tests!r})
from test_kv_exchange import make_core
from test_tp_transfer import pd_between
prompts, ref, p_size = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
kw = dict(dtype="float32", page_size=16, num_pages=256, max_num_seqs=16)
tp = make_core({model!r}, "cuda_ipc", device="cuda:0", tensor_parallel_size=2, **kw)
one = make_core({model!r}, "cuda_ipc", device="cuda:2", **kw)
pd_between(*((tp, one) if p_size == 2 else (one, tp)), prompts, ref, "gpu")
tp.close()
one.close()
print("ok")
"""


@pytest.mark.parametrize("p_size", [2, 1], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_cuda_ipc_pd_between_tp2_and_tp1(tiny_model_dir, p_size):
    """P/D over cuda_ipc between a TP 2 engine (cuda:0-1) and a TP 1 engine (cuda:2), both
    ways: D's tokens equal Hugging Face's and D's KV equals P's to the byte, head by head."""
    import torch

    if torch.cuda.device_count() < 3:
        pytest.skip("needs three GPUs")
    from test_kv_exchange import N_NEW

    prompts = random_prompts([45, 23, 70], seed=11)
    ref = hf_greedy(tiny_model_dir, prompts, N_NEW)
    code = _PD.format(tests=str(Path(__file__).parent), model=tiny_model_dir)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts), json.dumps(ref),
                          str(p_size)], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-6000:]
