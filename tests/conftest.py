"""Shared fixtures: model directories (built or converted once per session) and HF references."""

from __future__ import annotations

import pytest

TINY_VOCAB = 256


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random Llama (GQA, untied head) saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaky logits: greedy choices are far from ties
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir():
    from microserve.model_files import resolve_model

    return str(resolve_model(None))


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _hf_model(model_dir)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # ignore eos, like ignore_eos=True
                do_sample=False,
                pad_token_id=0,
            )
        out.append(gen[0, len(prompt) :].tolist())
    return out


_HF_MODELS: dict = {}


def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    return _HF_MODELS[model_dir]
