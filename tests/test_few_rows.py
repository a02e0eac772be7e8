"""The few-rows projection (engine/kernels/few_rows.py) against a float64 product.

Without CUDA the kernel runs under the Triton interpreter on CPU (small shapes); with CUDA the
same tests run compiled, plus `gpu`-marked ones at Llama-3.1-8B's projection shapes. The
interpreter's `tl.dot` over bf16 operands returns garbage (numpy has no bf16), so on CPU the
16-bit cases run in fp16 (the same kernel: the dtype is only the operands'); on CUDA in bf16.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernels import DEVICE, INTERPRET, load

few = load("engine.kernels.few_rows")
HALF = torch.float16 if INTERPRET else torch.bfloat16  # see above


def inputs(m: int, n: int, k: int, dtype=HALF, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed + m * 1009 + n * 7 + k)
    w = torch.randn(n, k, generator=g, device=DEVICE).to(dtype)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    return x, w


def assert_within_rounding(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """fp32 sums (in another order than float64's) rounded once to out's dtype: within one
    step of it around the exact value, plus the fp32 accumulation error."""
    ref = x.double() @ w.double().t()
    bits = 23 if out.dtype == torch.float32 else 7 if out.dtype == torch.bfloat16 else 10
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - bits)
    tol = step * 1.01 + 2.0**-16 * (x.double().abs() @ w.double().abs().t())
    assert out.shape == ref.shape
    assert ((out.double() - ref).abs() <= tol).all(), (out, ref)


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 256), (40, 300), (130, 128)])
def test_few_rows_match_float64(m, n, k):
    """Even tiles, ragged N and K (masked), and N past one row block."""
    x, w = inputs(m, n, k)
    out = few.few_rows_linear(x, w, config=few.FewRowsConfig(64, 128, 4))
    assert out.dtype == HALF
    assert_within_rounding(out, x, w)


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("k", [512, 500])
def test_split_k_sums_the_slices_in_order(split, k):
    """K shared by programs of one row block: partials in fp32, summed by the second kernel,
    the same value as the unsplit kernel's to fp32 rounding (before the cast to 16 bits); the
    last split's tail (500 columns) is masked."""
    x, w = inputs(3, 64, k, seed=split)
    whole = few.few_rows_linear(x, w, torch.empty(3, 64, device=DEVICE),
                                config=few.FewRowsConfig(64, 64, 4))  # fmt: skip
    parts = few.few_rows_linear(x, w, torch.empty(3, 64, device=DEVICE),
                                config=few.FewRowsConfig(64, 64, 4, split_k=split))  # fmt: skip
    assert_within_rounding(whole, x, w)
    assert_within_rounding(parts, x, w)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-4)
    half = few.few_rows_linear(x, w, config=few.FewRowsConfig(64, 64, 4, split_k=split))
    assert_within_rounding(half, x, w)


def test_float32_out_and_fp16():
    """The LM head's logits straight from the fp32 sums; fp16 weights as well."""
    x, w = inputs(4, 72, 192)
    out = few.few_rows_linear(x, w, torch.empty(4, 72, device=DEVICE))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-4)
    x, w = inputs(6, 64, 128, dtype=torch.float16)
    assert_within_rounding(few.few_rows_linear(x, w), x, w)


def test_rows_beyond_m_are_not_written():
    """The padded rows (M < 16) are masked: an out buffer's other memory is left alone."""
    x, w = inputs(3, 64, 128)
    buf = torch.full((5, 64), 7.0, device=DEVICE, dtype=HALF)
    few.few_rows_linear(x, w, buf[:3])
    assert (buf[3:] == 7.0).all()


def test_the_default_tile_splits_k_to_cover_the_sms():
    """64 features a program; K is split while the row blocks alone leave SMs idle and each
    split keeps >= 1,024 columns: o and down (4,096 rows) split, gate_up and the LM head do
    not."""
    cfg = few.few_rows_config
    assert cfg(4096, 4096) == few.FewRowsConfig(64, 128, 4, 3, split_k=4)  # o: 64 blocks
    assert cfg(4096, 14336) == few.FewRowsConfig(64, 128, 4, 3, split_k=4)  # down
    assert cfg(6144, 4096).split_k == 2  # qkv: 96 blocks
    assert cfg(28672, 4096).split_k == 1  # gate_up: 448 blocks
    assert cfg(128256, 4096).split_k == 1
    assert cfg(64, 576).split_k == 1  # SmolLM2: too short to split


def test_an_h200_takes_its_swept_tiles_for_rows_of_up_to_4096_columns():
    """The H200's sweep: 4 stages, K unsplit; 256 columns a load for N up to 8,192 (qkv, o),
    128 wider (gate_up, the LM head); the down projection keeps the rule; other GPUs too."""
    cfg, tile = few.few_rows_config, few.FewRowsConfig
    h200 = "NVIDIA H200"
    assert cfg(6144, 4096, 132, h200) == tile(64, 256, 4, 4, split_k=1)  # qkv
    assert cfg(4096, 4096, 132, h200) == tile(64, 256, 4, 4, split_k=1)  # o
    assert cfg(28672, 4096, 132, h200) == tile(64, 128, 4, 4, split_k=1)  # gate_up
    assert cfg(128256, 4096, 132, h200) == tile(64, 128, 4, 4, split_k=1)  # LM head
    assert cfg(4096, 14336, 132, h200) == cfg(4096, 14336, 132) == tile(64, 128, 4, 3, 4)
    assert cfg(6144, 4096, 132, "NVIDIA H100 80GB HBM3") == cfg(6144, 4096, 132)
    # where `--few-rows-gemm` auto turns the kernel on
    assert few.has_swept_tiles(h200) and not few.has_swept_tiles("NVIDIA H100 80GB HBM3")


def test_refuses_what_it_does_not_take():
    x, w = inputs(2, 8, 16)
    assert few.fits(x, w)
    for bad_x, bad_w in ((x[:1], w), (torch.zeros(17, 16, device=DEVICE, dtype=x.dtype), w),
                         (x.float(), w.float()), (x, w.float()), (x, w[:, :8])):  # fmt: skip
        assert not few.fits(bad_x, bad_w)
        with pytest.raises(ValueError, match=r"few_rows_linear takes x \[2\.\.16, K\]"):
            few.few_rows_linear(bad_x, bad_w)
    with pytest.raises(ValueError, match=r"out must be \[2, 8\]"):
        few.few_rows_linear(x, w, torch.empty(2, 9, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama_shapes_on_gpu(m, n, k):
    """Llama-3.1-8B's projections with the default tiles (split K for o and down)."""
    x, w = inputs(m, n, k)
    w = w * 0.02
    assert_within_rounding(few.few_rows_linear(x, w), x, w)


def test_few_rows_gemm_auto_is_16_on_one_gpu_with_swept_tiles(monkeypatch):
    """`--few-rows-gemm` unset (auto): 16 rows on one H200, off on other GPUs, across
    tensor-parallel ranks and on CPU; a number given is kept."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    gpu = {"name": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])

    def resolved(cuda=True, tp=1, **config):
        runner = SimpleNamespace(cuda=cuda, device="cuda:0")
        return ModelRunner._few_rows(runner, EngineConfig(model="m", **config), tp)

    assert resolved() == 16
    assert resolved(tp=2) == 0 and resolved(cuda=False) == 0
    assert resolved(few_rows_gemm=0) == 0 and resolved(few_rows_gemm=4, tp=2) == 4
    gpu["name"] = "NVIDIA H100 80GB HBM3"
    assert resolved() == 0
