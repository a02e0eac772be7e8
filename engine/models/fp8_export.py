"""`microserve quantize`: write a 16-bit Llama checkpoint's fp8 copy, in the compressed-tensors
layout llm-compressor's FP8_DYNAMIC scheme writes (vLLM and this engine read it as fp8).

The decoder layers' projections are quantized exactly as `--quantization fp8` quantizes them
at load (engine/models/fp8.py: float8 e4m3, one scale per output channel; no calibration
data, activations are quantized per token when the model runs), so an engine serving the copy
computes what one quantizing the original at load computes, and starts from half the bytes.
The embedding, the norms and the LM head keep the checkpoint's dtype.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.loader import fused_parts, load_model
from microserve.model_config import ModelConfig
from microserve.random_models import RANDOM_WEIGHTS_MARKER

FP8_DYNAMIC_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True},
    }},
}  # fmt: skip
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# files of the source directory not copied: its weights, and what the copy rewrites
_NOT_COPIED = ("config.json", "model.safetensors.index.json", RANDOM_WEIGHTS_MARKER)


def write_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, device: str = "cpu",
                         shard_bytes: int = 4 << 30) -> Path:
    """Write model_dir's fp8 copy into out_dir (new or empty); returns out_dir.

    Raises ValueError when out_dir holds files, when model_dir is already quantized, or for
    what `load_model` refuses.
    """
    src, out = Path(model_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty")
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{src} is already quantized "
                         f"({raw['quantization_config'].get('quant_method')})")
    dtype_name = ModelConfig.from_dir(src).torch_dtype
    if dtype_name not in _DTYPES:
        raise ValueError(f"{src}: torch_dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
    model, config = load_model(src, dtype=_DTYPES[dtype_name], device=device, quantization="fp8")
    tensors = _hf_tensors(model)
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name not in _NOT_COPIED and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    _write_shards(tensors, out, shard_bytes)
    raw["quantization_config"] = FP8_DYNAMIC_CONFIG
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _hf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face's names, fused projections split back into their
    parts; an fp8 projection as its weight and `weight_scale` [rows, 1] (fp32)."""
    parts = fused_parts(model.config)
    out = {}
    for name, tensor in model.state_dict().items():
        module_path, _, kind = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if kind == "weight_scale":
            tensor = tensor.view(-1, 1)
        for hf, start, rows in parts.get(module, [(module, 0, tensor.shape[0])]):
            key = ".".join(filter(None, (parent, hf, kind)))  # lm_head.weight has no parent
            out[key] = tensor[start : start + rows].contiguous().cpu()
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, shard_bytes: int) -> None:
    """model.safetensors, or shards of at most shard_bytes each (one tensor may exceed it)
    with their model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
