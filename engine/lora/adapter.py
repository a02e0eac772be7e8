"""Read a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
for a Llama-family model, checking everything before any of it reaches a slot.

    adapter_model.safetensors:  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
                                [r, in]   and   ...lora_B.weight  [out, r]

The scale PEFT applies (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) is kept
beside the tensors and folded into B as it is packed for a slot (engine/lora/layers.py), so a
slot computes x @ A^T @ (scale * B)^T. The tensors stay in the dtype the file holds: the slot's
cast is the one conversion (a rank-16 adapter of Llama-3.1-8B's shape, 84 MB in bf16: read in
9 ms on this project's 2-core machine, against 28 ms when every tensor was made float32 and
scaled on the way; packed for the slots in 27 ms, against 34). Every
failure is a ValueError whose message names the adapter, the tensor or field, and the numbers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from microserve.model_config import ModelConfig

# PEFT's module names for the Llama projections, and where each one's rows sit in our fused
# projections (engine/models/llama.py): (fused projection, slice index within it).
TARGET_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])\.weight$")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of `config`'s layers."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass
class AdapterWeights:
    """One adapter read from disk: (layer, module) -> (A [r, in], B [out, r]) as the file
    holds them; a slot holds scale * B."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def resolve_path(path: str, lora_dir: str | None) -> Path:
    """The adapter directory `path` names (relative paths are under `lora_dir`). With a
    `lora_dir`, the path must resolve inside it (symbolic links followed)."""
    if lora_dir is None:
        return Path(path).resolve()
    root = Path(lora_dir).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"lora_path {path!r} is outside the adapters directory {root} "
                         "(--lora-dir)")
    return resolved


def read_adapter(name: str, path: Path, config: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read and check the adapter at `path` for a model of `config`, rank at most `max_rank`.
    Tensors come back on the CPU in the file's dtype (the caller casts them into its slot)."""
    cfg = _read_config(name, path)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    for field in ("use_dora", "fan_in_fan_out"):
        if cfg.get(field):
            raise ValueError(f"adapter {name!r}: {field} is not supported")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise ValueError(f"adapter {name!r}: {field} is not supported (got "
                             f"{cfg[field]!r})")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r}: bias {cfg['bias']!r} is not supported (none only)")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"adapter {name!r}: unknown target module(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(TARGET_MODULES)})")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights = _read_tensors(name, path, config, rank)
    if isinstance(targets, list):  # every targeted layer must be there, whole
        layers = cfg.get("layers_to_transform")
        layers = range(config.num_layers) if layers is None else (
            [layers] if isinstance(layers, int) else layers)
        for layer in layers:
            for module in targets:
                if (layer, module) not in weights:
                    raise ValueError(f"adapter {name!r}: target module {module} of layer "
                                     f"{layer} has no lora_A/lora_B tensors")
    return AdapterWeights(name, str(path), rank, scale, weights)


def _read_config(name: str, path: Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"adapter {name!r}: no adapter_config.json in {path}")
    try:
        cfg = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"adapter {name!r}: {file} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"adapter {name!r}: {file} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _read_tensors(name: str, path: Path, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"adapter {name!r}: no adapter_model.safetensors in {path} (.bin "
                         "adapters are not read)")
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(file, framework="pt") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                raise ValueError(f"adapter {name!r}: unexpected tensor {key!r}")
            layer, module, half = int(m.group(1)), m.group(3), m.group(4)
            if module not in TARGET_MODULES:
                raise ValueError(f"adapter {name!r}: unknown target module {module!r} in "
                                 f"{key!r} (supported: {', '.join(TARGET_MODULES)})")
            if layer >= config.num_layers:
                raise ValueError(f"adapter {name!r}: {key!r} is for layer {layer}; the model "
                                 f"has {config.num_layers}")
            tensor = f.get_tensor(key)
            if not tensor.is_floating_point():
                raise ValueError(f"adapter {name!r}: {key!r} has dtype {tensor.dtype}, not a "
                                 "floating-point one")
            d_in, d_out = shapes[module]
            want = (rank, d_in) if half == "A" else (d_out, rank)
            if tuple(tensor.shape) != want:
                raise ValueError(f"adapter {name!r}: {key!r} has shape {list(tensor.shape)}, "
                                 f"expected {list(want)}")
            halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has no {missing} tensor")
        weights[(layer, module)] = (pair["A"], pair["B"])
    if not weights:
        raise ValueError(f"adapter {name!r}: {file} holds no LoRA tensors")
    return weights
