"""Synthetic `random:` models: the real configs, a placeholder tokenizer, random weights."""

import json
import shutil

import pytest

from microserve.model_config import ModelConfig
from microserve.model_files import resolve_model
from microserve.random_models import RANDOM_WEIGHTS_MARKER
from microserve.tokenizer import Tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_llama_31_8b_shapes_and_tokenizer(cache):
    d = resolve_model("random:llama-3.1-8b")
    assert d == cache / "models" / "random-llama-3.1-8b"
    c = ModelConfig.from_dir(d)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        128256, 4096, 14336, 32)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (32, 8, 128, False)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert c.eos_token_ids == (128001, 128008, 128009)
    tok = Tokenizer.from_dir(d)
    assert tok.encode("<5> <128255>", add_special_tokens=False) == [5, 128255]
    assert tok.decode([1, 2]) == "<1> <2>"
    assert resolve_model("random:llama-3.1-8b") == d  # reused


def test_llama_32_1b_is_tied(cache):
    c = ModelConfig.from_dir(resolve_model("random:llama-3.2-1b"))
    assert (c.hidden_size, c.num_layers, c.head_dim, c.tie_word_embeddings) == (2048, 16, 64, True)


def test_tiny_is_fp32_with_its_own_eos(cache):
    d = resolve_model("random:tiny")
    c = ModelConfig.from_dir(d)
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.head_dim) == (2048, 128, 2, 32)
    assert c.eos_token_ids == (2,)
    assert Tokenizer.from_dir(d).eos_token_id == 2


def test_unknown_synthetic_model(cache):
    with pytest.raises(ValueError, match="unknown synthetic model .*random:llama-3.1-8b"):
        resolve_model("random:gpt-5")


def test_loader_fills_random_weights(tiny_model_dir, tmp_path):
    import torch

    from engine.models.loader import load_model

    d = tmp_path / "tiny-random"
    d.mkdir()
    shutil.copy(f"{tiny_model_dir}/config.json", d / "config.json")
    (d / RANDOM_WEIGHTS_MARKER).write_text("7\n")
    model, config = load_model(d)
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005 and model.model.norm.weight.eq(1).all()
    again, _ = load_model(d)
    assert torch.equal(again.model.layers[0].self_attn.qkv_proj.weight, w)  # seeded
    assert json.loads((d / "config.json").read_text())["vocab_size"] == config.vocab_size
