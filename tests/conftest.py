"""Shared fixtures: model directories (built or converted once per session) and HF references."""

from __future__ import annotations

import os

import pytest

TINY_VOCAB = 256


def pytest_configure(config):
    """One torch thread in the test process (the engine daemons it starts keep their own). On
    the two-core machine the test process, its daemons and whatever else runs share the cores,
    and threads that spin on every core wait for each other: Hugging Face's greedy reference
    and the in-process engine tests ran 3-10x slower with two threads than with one while the
    machine was busy. The engine daemons get one thread too (tests/daemons.py, cpu_threads),
    for the same reason.

    Without CUDA, Triton runs under its interpreter for the whole session: TRITON_INTERPRET=1
    is read when `import triton` decorates its own helpers, so it must be set before any test
    module imports triton (tests/triton_kernels.py). The whole suite's collection used to set
    it early by chance (a module importing triton_kernels came first); a run of a few files,
    such as test_lora.py then test_lora_triton_cpu.py, imported triton compiled and failed."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


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
def tiny_served_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a word-level tokenizer (token i is `<i>`) and a chat template, so
    the engine and the router can serve it over the OpenAI API."""
    import json
    import shutil

    from microserve.random_models import _CHAT_TEMPLATE, _placeholder_tokenizer

    path = tmp_path_factory.mktemp("tiny-served")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    _placeholder_tokenizer(TINY_VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": _CHAT_TEMPLATE, "bos_token": "<1>", "eos_token": "<2>",
        "add_bos_token": False}))
    return str(path)


@pytest.fixture(scope="session")
def smollm2_dir():
    from microserve.model_files import resolve_model

    return str(resolve_model(None))


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt, one prompt at a time.

    A plain greedy loop over the HF model with its own KV cache, never stopping at eos: what
    `generate(do_sample=False)` computes, and what our `ignore_eos=True` means. (`generate`'s
    `min_new_tokens` would instead mask eos out of the distribution.)
    """
    import torch

    model = _hf_model(model_dir)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            step = model(torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                token = int(step.logits[0, -1].argmax())
                tokens.append(token)
                step = model(torch.tensor([[token]]), past_key_values=step.past_key_values,
                             use_cache=True)  # fmt: skip
            out.append(tokens)
    return out


def hf_generate(model_dir: str, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """Hugging Face's `generate(do_sample=False, **options)` continuation of one prompt: it
    stops at the model's eos (included) or after max_new_tokens, as our engine does without
    ignore_eos. `options` are generate's logits processors (repetition_penalty,
    min_new_tokens, sequence_bias, ...)."""
    import torch

    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=max_new_tokens, **options)
    return out[0, len(prompt):].tolist()


_HF_MODELS: dict = {}


def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    return _HF_MODELS[model_dir]


# ---- daemon logs in failure reports (tests/test_engine_server.py) ---------------------------

# Log files of the `microserve engine` processes a test talked to; a failed test's report shows
# their tails (the daemons write to files, which pytest does not capture).
DAEMON_LOGS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for path in item.stash.get(DAEMON_LOGS, []):
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()[-60:]
            report.sections.append((f"daemon log {path} (last 60 lines)", "\n".join(lines)))
