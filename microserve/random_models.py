"""Synthetic models: the exact shapes of real Llamas with random weights (no torch here).

`--model random:llama-3.1-8b` benchmarks a GPU without downloading weights: speed depends on
shapes, not values. `materialize()` writes a small directory in the model cache holding the real
model's config.json, a marker file instead of weights (the loader then fills every weight with
random values on the device), and a placeholder word-level tokenizer whose token i is `<i>`, so
the frontend can stream text for any generated id. Send prompts as token ids.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

RANDOM_PREFIX = "random:"
RANDOM_WEIGHTS_MARKER = "RANDOM_WEIGHTS"  # a file in the directory; its content is the seed

_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

RANDOM_MODELS = {
    "llama-3.1-8b": {
        **_LLAMA3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    # Llama-3.1-70B's shape (141 GB in bf16): for tensor-parallel figures on 2 GPUs
    "llama-3.1-70b": {
        **_LLAMA3_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.2-1b": {
        **_LLAMA3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
    # Not a real model: 2 small layers, a 2,048-token vocabulary, fp32. For measuring what
    # surrounds the model (the router's overhead, HTTP, scheduling) on a CPU, where a real
    # model's step time and its variation would hide it.
    "tiny": {
        **_LLAMA3_COMMON,
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
}  # fmt: skip

_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def is_random_spec(spec: str | None) -> bool:
    return spec is not None and spec.startswith(RANDOM_PREFIX)


def materialize(spec: str, models_dir: Path) -> Path:
    """The directory for `random:NAME` (written once, atomically)."""
    name = spec[len(RANDOM_PREFIX) :]
    if name not in RANDOM_MODELS:
        raise ValueError(
            f"--model {spec!r}: unknown synthetic model (known: "
            f"{', '.join(RANDOM_PREFIX + n for n in RANDOM_MODELS)})"
        )
    target = models_dir / f"random-{name}"
    if (target / RANDOM_WEIGHTS_MARKER).is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
    config = RANDOM_MODELS[name]
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    _placeholder_tokenizer(config["vocab_size"]).save(str(tmp / "tokenizer.json"))
    eos = config["eos_token_id"]
    eos = eos[-1] if isinstance(eos, list) else eos  # Llama 3's end-of-turn token
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": _CHAT_TEMPLATE, "bos_token": None, "eos_token": f"<{eos}>",
        "add_bos_token": False,
    }))  # fmt: skip
    (tmp / RANDOM_WEIGHTS_MARKER).write_text("0\n")
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race, or an older copy exists: keep that one
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / RANDOM_WEIGHTS_MARKER).is_file():
            raise
    return target


def _placeholder_tokenizer(vocab_size: int) -> Tokenizer:
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok
