"""Checkpoints quantized to fp8 ahead of time (engine/models/fp8.py `checkpoint_scheme`,
engine/models/loader.py): compressed-tensors FP8-dynamic (per-channel weight scales), the "fp8"
method with per-tensor scales and static input scales, fbgemm_fp8; refused schemes.

The checkpoints are written here from the tiny test model in each format's layout (no hub:
nothing can be downloaded), then served as a user would point the engine at them.

- A per-channel checkpoint runs as fp8 without `--quantization` and gives exactly the tokens
  and logprobs of `--quantization fp8` over the 16-bit checkpoint it was made from (the same
  bytes, the same arithmetic), on CPU and on the GPU.
- A per-tensor checkpoint gives Hugging Face's greedy tokens with every projection computing
  (x8 s_x)(W8 s)^T with its one scale; its static input scales are not used.
- Scales stored in bf16 are used as stored; a projection the checkpoint left unquantized
  stays a 16-bit projection.
- Block-wise fp8, int4 and other methods, a fused projection stored half in fp8, and a
  missing scale are refused with the name of what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_core import greedy, make_core, random_prompts, run_all
from test_fp8 import _hf_fp8_greedy

from engine.models import fp8
from engine.models.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_rows
from engine.models.loader import load_model

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_DYNAMIC = {  # what llm-compressor's FP8_DYNAMIC scheme writes into config.json
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True}}},
}  # fmt: skip
PER_TENSOR_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole matrix: amax / 448."""
    scale = w.float().abs().amax().clamp(min=fp8.MIN_AMAX) * fp8.INV_FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def write_checkpoint(src: str, dst: Path, config: dict, quantize=quantize_rows,
                     scale_dtype=torch.float32, keep=(), input_scales=False,
                     edit=None) -> str:
    """src's checkpoint with every decoder projection's weight (but those named in `keep`)
    stored as fp8 with its `weight_scale` ([N, 1] per channel, a scalar per tensor)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 2)[-2]
        if name.endswith(".weight") and module in HF_PROJECTIONS and name not in keep:
            w8, scale = quantize(t)
            out[name] = w8
            out[name.removesuffix("weight") + "weight_scale"] = scale.to(scale_dtype)
            if input_scales:
                out[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
        else:
            out[name] = t
    if edit:
        edit(out)
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _logprob_greedy(n: int):
    return dataclasses.replace(greedy(n), logprobs=1)


def _run(core, prompts, n=24):
    got = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, _logprob_greedy(n))
    while core.has_work():
        for out in core.step():
            got[out.request_id] += [(t, lp.logprob) for t, lp in zip(out.token_ids,
                                                                    out.logprobs)]  # fmt: skip
    core.check_integrity()
    return got


def test_an_fp8_dynamic_checkpoint_runs_as_quantizing_at_load_does(tiny_model_dir, tmp_path):
    ckpt = write_checkpoint(tiny_model_dir, tmp_path / "fp8-dynamic", FP8_DYNAMIC)
    stored = load_file(Path(ckpt) / "model.safetensors")
    core = make_core(ckpt)  # no --quantization: the checkpoint says fp8
    assert core.info.quantization == "fp8"
    qkv = core.runner.model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    parts = [stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    assert torch.equal(qkv.weight_scale, torch.cat(
        [stored[f"model.layers.1.self_attn.{p}_proj.weight_scale"].view(-1) for p in "qkv"]))
    assert core.runner.model.lm_head.weight.dtype == torch.float32  # ignored: not quantized
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([1, 9, 40, 77]))}
    at_load = _run(make_core(tiny_model_dir, quantization="fp8"), prompts)
    assert _run(core, prompts) == at_load  # tokens and logprobs, exactly
    assert _run(make_core(ckpt, quantization="fp8"), prompts) == at_load  # the flag: no-op


def test_a_per_tensor_checkpoint_gives_hf_tokens_with_its_one_scale(tiny_model_dir, tmp_path):
    ckpt = write_checkpoint(tiny_model_dir, tmp_path / "fp8-static", PER_TENSOR_STATIC,
                            quantize=quantize_tensor, input_scales=True)  # fmt: skip
    core = make_core(ckpt)
    down = core.runner.model.model.layers[0].mlp.down_proj
    stored = load_file(Path(ckpt) / "model.safetensors")
    scale = stored["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.shape == () and torch.equal(down.weight_scale, scale.expand(down.out_features))
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([3, 21, 64]))}
    n = 24
    got = run_all(core, prompts, greedy(n))
    for rid, prompt in prompts.items():
        assert got[rid][0] == _hf_fp8_greedy(tiny_model_dir, prompt, n, quantize_tensor), rid
    per_channel = run_all(make_core(tiny_model_dir, quantization="fp8"), prompts, greedy(n))
    assert any(got[rid][0] != per_channel[rid][0] for rid in prompts)  # the scales matter


def test_bf16_scales_are_used_as_stored_and_ignored_projections_stay_16_bit(tiny_model_dir,
                                                                            tmp_path):
    keep = ("model.layers.1.mlp.down_proj.weight",)
    ckpt = write_checkpoint(tiny_model_dir, tmp_path / "bf16-scales", FP8_DYNAMIC,
                            scale_dtype=torch.bfloat16, keep=keep)  # fmt: skip
    model, _ = load_model(ckpt)
    stored = load_file(Path(ckpt) / "model.safetensors")
    o = model.model.layers[0].self_attn.o_proj
    assert torch.equal(o.weight_scale,
                       stored["model.layers.0.self_attn.o_proj.weight_scale"].float().view(-1))
    down = model.model.layers[1].mlp.down_proj
    assert not isinstance(down, Fp8Linear) and down.weight.dtype == torch.float32
    assert torch.equal(down.weight, stored[keep[0]])
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    core = make_core(ckpt)
    out = run_all(core, {"a": random_prompts([12])[0]}, greedy(8))
    assert len(out["a"][0]) == 8


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     r"weight_block_size \[128, 128\] \(block-wise fp8\) is not supported"),
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported"),
    ({**FP8_DYNAMIC, "config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     r"group_0 weights 'int' of 4 bits is not supported"),
    ({**FP8_DYNAMIC, "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block"}}}},
     r"group_0 weight strategy 'block' is not supported"),
])  # fmt: skip
def test_schemes_this_engine_cannot_run_are_refused_by_name(tiny_model_dir, tmp_path, config,
                                                            message):
    ckpt = write_checkpoint(tiny_model_dir, tmp_path / "other", config)
    with pytest.raises(ValueError, match=message):
        make_core(ckpt)


def test_a_half_quantized_fused_projection_and_a_missing_scale_are_refused(tiny_model_dir,
                                                                          tmp_path):
    half = write_checkpoint(tiny_model_dir, tmp_path / "half", FP8_DYNAMIC,
                            keep=("model.layers.0.self_attn.k_proj.weight",))  # fmt: skip
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj is stored as "
                                         r"\['F8_E4M3', 'F32', 'F8_E4M3'\]"):
        load_model(half)
    no_scale = write_checkpoint(
        tiny_model_dir, tmp_path / "no-scale", FP8_DYNAMIC,
        edit=lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))  # fmt: skip
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.mlp.up_proj"
                                         r".weight_scale'\]"):
        load_model(no_scale)


@pytest.mark.gpu
def test_an_fp8_dynamic_checkpoint_on_gpu_equals_quantizing_at_load(tiny_model_dir, tmp_path):
    """On CUDA (fp32 activations, CUDA graphs, the Triton quantization kernels, fp8 GEMMs and
    the batch-1 fp8 GEMV): the checkpoint's bytes are load-time quantization's bytes, so the
    two engines compute the same."""
    ckpt = write_checkpoint(tiny_model_dir, tmp_path / "fp8-dynamic-gpu", FP8_DYNAMIC)
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([1, 9, 40, 77]))}
    kw = {"device": "cuda", "dtype": "float32"}
    got = _run(make_core(ckpt, **kw), prompts)
    assert got == _run(make_core(tiny_model_dir, quantization="fp8", **kw), prompts)
    assert len(_run(make_core(ckpt, device="cuda", dtype="bfloat16"), prompts)["r0"]) == 24


# ---- microserve quantize ------------------------------------------------------------------------


def test_microserve_quantize_writes_a_checkpoint_that_serves_as_quantizing_at_load(
        tiny_model_dir, tmp_path, capsys):
    from launcher.cli import main

    out = tmp_path / "tiny-fp8"
    main(["quantize", tiny_model_dir, str(out), "--shard-gb", "0.0001"])  # several shards
    assert "microserve quantize: wrote" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert index["weight_map"]["model.layers.0.self_attn.k_proj.weight_scale"] in shards
    assert "lm_head.weight" in index["weight_map"]  # untied head, kept in 16/32 bits
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == \
        "channel"
    assert fp8.checkpoint_scheme(cfg) == "fp8"
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([2, 30, 70]))}
    assert _run(make_core(str(out)), prompts) == _run(
        make_core(tiny_model_dir, quantization="fp8"), prompts)
    with pytest.raises(SystemExit):  # the directory is not empty: refused, nothing written over
        main(["quantize", tiny_model_dir, str(out)])
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(out), str(tmp_path / "again")])
    assert "is already quantized (compressed-tensors)" in capsys.readouterr().err
