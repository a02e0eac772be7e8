"""The model's shape and token ids, read from a Hugging Face directory (no torch).

The router needs the eos ids and the context length, the engine needs the shapes; both read them
from here so neither parses `config.json` itself. Only the Llama family is accepted: the engine
has one model implementation, and a config it cannot run should fail at startup with the field
that is wrong, not later inside a matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    name: str  # directory basename; what /v1/models reports unless overridden
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype name ("bfloat16"), not necessarily the serving dtype
    # None for plain RoPE; else the scaling dict with "rope_type" set ("llama3", ...)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (and `generation_config.json` if present) from a model directory."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{path}: no config.json; not a Hugging Face model directory")
        config = _read_json(config_path)
        generation_path = path / "generation_config.json"
        generation = _read_json(generation_path) if generation_path.is_file() else {}
        return cls.from_dicts(path.resolve().name, config, generation, source=str(config_path))

    @classmethod
    def from_dicts(
        cls, name: str, config: dict, generation: dict, source: str = "config.json"
    ) -> "ModelConfig":
        """Build from already-parsed `config.json` / `generation_config.json` contents.

        `source` only labels error messages.
        """
        _check_architecture(config, source)
        _check_bias_free_silu(config, source)
        num_heads = _required(config, "num_attention_heads", source)
        hidden_size = _required(config, "hidden_size", source)
        rope_theta, rope_scaling = _rope(config)
        return cls(
            name=name,
            model_type=config.get("model_type", "llama"),
            vocab_size=_required(config, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=_required(config, "intermediate_size", source),
            num_layers=_required(config, "num_hidden_layers", source),
            num_heads=num_heads,
            # HF's LlamaConfig defaults: no GQA, head_dim from the hidden size
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(_required(config, "rms_norm_eps", source)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_required(config, "max_position_embeddings", source),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id", generation.get("bos_token_id")),
            eos_token_ids=_eos_ids(config, generation),
            torch_dtype=config.get("torch_dtype") or config.get("dtype") or "float32",
        )

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse `size` ranks unless each gets whole attention heads and an equal share of the
        MLP rows; KV heads may be fewer than the ranks (each is then replicated on the ranks
        whose q heads read it) if `size` is a multiple of them. ValueError names the numbers."""
        problems = []
        if self.num_heads % size:
            problems.append(f"num_attention_heads {self.num_heads} is not divisible by it")
        kv = self.num_kv_heads
        if (kv % size if kv >= size else size % kv):
            problems.append(f"num_key_value_heads {kv} is neither a multiple nor a divisor of "
                            f"it")
        if self.intermediate_size % size:
            problems.append(f"intermediate_size {self.intermediate_size} is not divisible by "
                            f"it")
        if problems:
            raise ValueError(f"tensor_parallel_size {size} does not fit model {self.name}: "
                             f"{'; '.join(problems)}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _required(config: dict, key: str, source: str) -> Any:
    if config.get(key) is None:
        raise ValueError(f"{source}: missing required field {key!r}")
    return config[key]


def _check_architecture(config: dict, source: str) -> None:
    """Accept only architectures the engine implements; name the one we got otherwise."""
    architectures = config.get("architectures")
    if architectures is None:  # a bare saved config: fall back on model_type
        if config.get("model_type") != "llama":
            raise ValueError(
                f"{source}: model_type {config.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return
    for arch in architectures:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )


def _check_bias_free_silu(config: dict, source: str) -> None:
    """The model has no biases and a SiLU MLP; a config asking for more would run wrong silently."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"{source}: {key}=true is not supported (bias-free Llama only)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")


def _rope(config: dict) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout.

    transformers 4 writes `rope_theta` at top level and `rope_scaling` (with `type` or
    `rope_type`); transformers 5 writes one `rope_parameters` dict holding `rope_theta` and
    `rope_type` ("default" for plain RoPE).
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    # early Llama 2 configs omit it and rely on LlamaConfig's default
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def _eos_ids(config: dict, generation: dict) -> tuple[int, ...]:
    """Union of both files' eos ids, config's first: chat models often add <|im_end|> only in
    generation_config.json, and generation must stop on either."""
    ids: list[int] = []
    for source in (config, generation):
        value = source.get("eos_token_id")
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


# generation_config.json keys that become request defaults, as vLLM's `--generation-config
# auto` and SGLang's `--sampling-defaults model` take them, with the range each must be in
# (a value outside it, or not a number, is left out and named in the returned notes)
_SAMPLING_KEYS = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (-1, 1 << 31),
                  "min_p": (0.0, 1.0), "repetition_penalty": (1e-9, 2.0),
                  "max_new_tokens": (1, 1 << 31)}


def sampling_defaults(path: str | Path) -> tuple[dict[str, float | int], list[str]]:
    """The sampling defaults a model directory's generation_config.json recommends:
    (temperature / top_p / top_k / min_p / repetition_penalty / max_tokens as the request
    fields name them, what was left out and why). Nothing if there is no such file."""
    generation_path = Path(path) / "generation_config.json"
    if not generation_path.is_file():
        return {}, []
    generation = _read_json(generation_path)
    found, skipped = {}, []
    for key, (low, high) in _SAMPLING_KEYS.items():
        if key not in generation:
            continue
        value = generation[key]
        integral = key in ("top_k", "max_new_tokens")
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (integral and not float(value).is_integer()) or not low <= value <= high):
            skipped.append(f"{key}={value!r} (outside [{low}, {high}])")
            continue
        found["max_tokens" if key == "max_new_tokens" else key] = (
            int(value) if integral else float(value))
    return found, skipped
