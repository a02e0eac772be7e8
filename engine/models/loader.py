"""Load a Hugging Face Llama checkpoint (safetensors) into `LlamaForCausalLM`.

The model is built on the meta device (no memory, no random init), materialized empty on the
target device, and filled tensor by tensor from the safetensors files, so peak memory is one
copy of the weights plus one checkpoint tensor. HF's separate q/k/v and gate/up weights are
copied into row ranges of the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models import fp8
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel import TensorParallel
from microserve.model_config import ModelConfig
from microserve.random_models import RANDOM_WEIGHTS_MARKER

# checkpoint names that are not weights (old HF Llama checkpoints saved the RoPE inv_freq)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    quantization: str | None = None, tp: TensorParallel = TensorParallel(),
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `model_dir`'s config.json and load its weights; `quantization`
    "fp8" then quantizes the decoder layers' projections (engine/models/fp8.py). A checkpoint
    whose config.json has an fp8 `quantization_config` loads its fp8 projections as they are
    stored, with or without `quantization` (fp8.checkpoint_scheme).

    With `tp` of more than one rank, builds and loads this rank's share of every weight
    (engine/models/parallel.py); the config returned is still the whole model's.

    Returns the model in eval mode with gradients off, and its config. Raises ValueError naming
    the weights when the checkpoint lacks some the model needs, has ones it does not know, or
    has a tensor of the wrong shape, and when the device cannot run the quantization.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    config_json = model_dir / "config.json"
    fp8_checkpoint = fp8.checkpoint_scheme(json.loads(config_json.read_text()),
                                           where=str(config_json)) == "fp8"  # fmt: skip
    if quantization is not None:
        if quantization not in fp8.QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(fp8.QUANTIZATIONS)} or "
                             f"None; got {quantization!r}")
        fp8.check_supported(torch.device(device))  # before the weights load, not after
    if fp8_checkpoint:
        fp8.check_supported(torch.device(device), f"the fp8 checkpoint {model_dir}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    marker = model_dir / RANDOM_WEIGHTS_MARKER
    if marker.is_file():
        _random_weights(model, seed=int(marker.read_text().strip() or 0), whole=config)
    else:
        files = _safetensors_files(model_dir)
        if fp8_checkpoint:
            _fp8_projections(model, files)
        _load_weights(model, files, fp8_checkpoint, whole=config)
    if quantization == "fp8":
        fp8.quantize_model(model)
    model.reset_cache()
    model.eval()
    model.requires_grad_(False)
    return model, config


@torch.no_grad()
def _random_weights(model: LlamaForCausalLM, seed: int, whole: ModelConfig) -> None:
    """Synthetic models (microserve/random_models.py): N(0, 0.02) matrices, unit norms, drawn
    on the model's device so an 8B model fills in seconds. A rank of a tensor-parallel model
    draws each whole matrix, in the same order, and keeps its share: every rank count serves
    the same model."""
    tp = model.tp
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    if tp.size > 1:
        with torch.device("meta"):
            shapes = {name: p.shape for name, p in LlamaForCausalLM(whole).named_parameters()}
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        elif tp.size == 1:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            full = torch.empty(shapes[name], dtype=param.dtype, device=param.device)
            param.copy_(tp.shard_parameter(name, full.normal_(0.0, 0.02, generator=gen), whole))


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the shards an index names, else the single model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def fused_rows(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF module name -> (fused module, first row, row count)::

        qkv_proj:     [ q: 0 .. q_size | k: q_size .. +kv_size | v: q_size+kv_size .. +kv_size ]
        gate_up_proj: [ gate: 0 .. intermediate | up: intermediate .. 2*intermediate ]
    """
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q_size),
        "k_proj": ("qkv_proj", q_size, kv_size),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


def fused_parts(config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """`fused_rows` the other way: fused module -> its HF parts, each (name, first row, rows)."""
    parts: dict[str, list[tuple[str, int, int]]] = {}
    for hf, (module, start, rows) in fused_rows(config).items():
        parts.setdefault(module, []).append((hf, start, rows))
    return parts


def _checkpoint_target(name: str, fused: dict) -> tuple[str, int, int]:
    """(parameter name, first row, row count or -1 for all) that checkpoint tensor `name` fills."""
    module_path, _, tensor = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
    parent, _, module = module_path.rpartition(".")
    if module in fused:
        fused_module, start, rows = fused[module]
        return f"{parent}.{fused_module}.{tensor}", start, rows
    return name, 0, -1


def _fp8_projections(model: LlamaForCausalLM, files: list[Path]) -> None:
    """Make each decoder projection whose checkpoint weights are float8 an empty `Fp8Linear`
    (a fused one when all its parts are; a checkpoint may leave some projections unquantized,
    as its `ignore` list says)."""
    dtypes = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            dtypes |= {name: f.get_slice(name).get_dtype() for name in f.keys()}
    fused = fused_parts(model.config)
    for i, layer in enumerate(model.model.layers):
        for path in fp8.PROJECTIONS:
            parent_name, _, name = path.rpartition(".")
            prefix = f"model.layers.{i}.{parent_name}"
            parts = [hf for hf, _, _ in fused.get(name, [(name, 0, 0)])]
            stored = [dtypes.get(f"{prefix}.{part}.weight") for part in parts]
            if all(d != "F8_E4M3" for d in stored):
                continue
            if any(d != "F8_E4M3" for d in stored):
                raise ValueError(f"{files[0].parent}: {prefix}.{name} is stored as {stored} "
                                 f"for {parts}: the parts of a fused projection must all be "
                                 "float8 e4m3 or none")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, name)
            setattr(parent, name, fp8.Fp8Linear.empty(
                linear.out_features, linear.in_features, linear.weight.dtype,
                linear.weight.device))  # fmt: skip


def _load_weights(model: LlamaForCausalLM, files: list[Path], fp8_checkpoint: bool = False,
                  whole: ModelConfig | None = None) -> None:
    """`whole`: the unsharded model's config, for a rank of a tensor-parallel one to cut its
    share out of each checkpoint tensor."""
    # the parameters and the fp8 projections' weight and scale buffers
    params = dict(model.state_dict(keep_vars=True))
    fused = fused_rows(model.config)
    unused = _IGNORED_SUFFIXES + (fp8.CHECKPOINT_UNUSED_SUFFIXES if fp8_checkpoint else ())
    # every (parameter, first row) still to fill; a fused parameter has one entry per part
    missing = {_checkpoint_target(name, fused)[:2]: name for name in _checkpoint_names(params)}
    unexpected = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(unused) or _is_tied_head(model, name):
                    continue
                target, start, rows = _checkpoint_target(name, fused)
                if target not in params:
                    unexpected.append(name)
                    continue
                tensor = model.tp.shard_checkpoint(name, f.get_tensor(name), whole or model.config)
                _copy_rows(params[target], start, rows, tensor, name)
                missing.pop((target, start), None)
    problems = []
    if missing:
        problems.append(f"missing weights {sorted(missing.values())}")
    if unexpected:
        problems.append(f"unexpected weights {sorted(unexpected)}")
    if problems:
        where = files[0].parent
        raise ValueError(f"{where}: checkpoint does not match config.json: {'; '.join(problems)}")


def _checkpoint_names(params: dict) -> list[str]:
    """The HF names the model expects: its own, with fused parameters split back apart."""
    names = []
    for name in params:
        if ".qkv_proj." in name:
            names += [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
        elif ".gate_up_proj." in name:
            names += [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
        else:
            names.append(name)
    return names


def _is_tied_head(model: LlamaForCausalLM, name: str) -> bool:
    """Some tied checkpoints also store lm_head.weight (a copy of the embedding): skip it."""
    return name == "lm_head.weight" and model.lm_head is None


@torch.no_grad()
def _copy_rows(
    param: torch.Tensor, start: int, rows: int, tensor: torch.Tensor, name: str
) -> None:
    dest = param if rows == -1 else param[start : start + rows]
    if name.endswith(".weight_scale") and param.dtype == torch.float32:
        # an fp8 checkpoint's scales, [N, 1] per channel or [1] / [] per tensor, as [N] fp32
        tensor = tensor.float().reshape(-1)
        if tensor.numel() == 1:
            tensor = tensor.expand(dest.shape[0])
    elif tensor.dtype == fp8.FP8 and dest.dtype != fp8.FP8:
        raise ValueError(f"weight {name!r} is float8 e4m3 but its projection is not quantized")
    if dest.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)
