"""The single-row Triton GEMV (engine/kernels/gemv.py) against a float64 product.

Without CUDA the kernel runs under the Triton interpreter on CPU (small shapes, no PDL). With
CUDA the same tests run compiled, plus `gpu`-marked ones at Llama-3.1-8B's projection shapes and
a CUDA-graph chain whose kernels launch programmatically dependent (PDL) on the one before.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from triton_kernels import DEVICE, load

from engine.models.llama import RMSNorm

gemv_mod = load("engine.kernels.gemv")


def gated_input(x: torch.Tensor, k: int) -> torch.Tensor:
    gate, up = x[:, :k].float(), x[:, k:].float()
    return (F.silu(gate) * up).to(x.dtype)  # rounded like silu_and_mul's output


def check(n: int, k: int, dtype: torch.dtype, gated: bool, config=None) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g, device=DEVICE).to(dtype)
    x = torch.randn(1, 2 * k if gated else k, generator=g, device=DEVICE).to(dtype)
    out = gemv_mod.gemv(x, w, gated=gated, config=config)
    assert out.shape == (1, n) and out.dtype == dtype
    xin = gated_input(x, k) if gated else x
    ref = xin.double() @ w.double().t()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
        return
    # fp32 sums (in another order than float64's) rounded once: within one bf16 step of the
    # exact value plus the fp32 accumulation error (outputs near zero have tiny steps); gated, an input may round one step apart from torch's silu, which moves
    # the sum by up to 2^-8 of its terms' magnitude
    step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    tol = step * 1.01 + 2.0**-16 * (xin.double().abs() @ w.double().abs().t())
    if gated:
        tol = tol + 2.0**-8 * (xin.double().abs() @ w.double().abs().t())
    assert ((out.double() - ref).abs() <= tol).all(), (out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n,k", [(64, 1024), (48, 2048), (50, 70), (3, 576)])
def test_gemv_matches_float64(n, k, dtype, gated):
    """Even tiles, several K tiles, and ragged N and K (SmolLM2's 576 columns)."""
    check(n, k, dtype, gated)


def test_gemv_float32_out_from_bf16():
    """The LM head writes fp32 logits straight from the fp32 sums (no bf16 rounding)."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    w = torch.randn(40, 300, generator=g, device=DEVICE).bfloat16()
    x = torch.randn(1, 300, generator=g, device=DEVICE).bfloat16()
    out = gemv_mod.gemv(x, w, torch.empty(1, 40, device=DEVICE))
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-4)


def test_gemv_small_tiles_walk_k():
    check(40, 300, torch.float32, False, gemv_mod.GemvConfig(block_n=8, block_k=64, num_warps=4))
    check(40, 300, torch.float32, True, gemv_mod.GemvConfig(block_n=8, block_k=64, num_warps=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n,k", [(64, 1024), (50, 576)])
def test_rms_norm_gemv_matches_norm_then_linear(n, k, dtype, with_residual):
    """One kernel = RMSNorm (llama.py's, residual add first) then the projection; the summed
    residual comes back (program 0 writes it) and the inputs are left alone."""
    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    x = torch.randn(1, k, generator=g, device=DEVICE).to(dtype)
    residual = (torch.randn(1, k, generator=g, device=DEVICE) * 3).to(dtype)
    norm = RMSNorm(k, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(k, generator=g, device=DEVICE))
    norm = norm.to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEVICE) * 0.05).to(dtype)
    x_before, r_before = x.clone(), residual.clone()
    with torch.no_grad():
        if with_residual:
            normed, summed = norm(x, residual)
        else:
            normed, summed = norm(x), x
        out, res_out = gemv_mod.rms_norm_gemv(x, residual if with_residual else None,
                                              norm.weight, norm.eps, w)  # fmt: skip
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)
    if not with_residual:
        assert res_out is x
    ref = normed.double() @ w.double().t()
    if dtype == torch.float32:
        torch.testing.assert_close(res_out, summed, rtol=0, atol=0)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    else:  # one bf16 rounding apart per step (the interpreter truncates where torch rounds)
        torch.testing.assert_close(res_out.float(), summed.float(), rtol=2**-7, atol=1e-6)
        bound = 2.0**-7 * (normed.double().abs() @ w.double().abs().t()) + 2.0**-7 * ref.abs()
        assert ((out.double() - ref).abs() <= bound).all()


def test_rms_norm_gemv_rejects_bad_shapes():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm_weight \[16\]"):
        gemv_mod.rms_norm_gemv(torch.zeros(1, 16, device=DEVICE), None,
                               torch.ones(15, device=DEVICE), 1e-5, w)  # fmt: skip
    with pytest.raises(ValueError, match="residual must be"):
        gemv_mod.rms_norm_gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(1, 8, device=DEVICE),
                               torch.ones(16, device=DEVICE), 1e-5, w)  # fmt: skip


def test_gemv_default_tiles():
    assert gemv_mod.gemv_config(6144, 4096) == gemv_mod.GemvConfig(2, 4096, 8)  # qkv
    assert gemv_mod.gemv_config(28672, 4096) == gemv_mod.GemvConfig(2, 4096, 8)  # gate_up
    assert gemv_mod.gemv_config(4096, 14336) == gemv_mod.GemvConfig(4, 2048, 8)  # down
    assert gemv_mod.gemv_config(128256, 4096) == gemv_mod.GemvConfig(1, 4096, 8)  # LM head
    assert gemv_mod.gemv_config(49152, 576) == gemv_mod.GemvConfig(2, 1024, 4)  # masked past 576


def test_gemv_tiles_by_gpu():
    """An H200 takes the tiles of its own sweep for bf16 projections of 16 Mi weights and more;
    fp8 weights, the small shares of tensor parallelism and other GPUs keep the H100's."""
    h200 = functools.partial(gemv_mod.gemv_config, gpu="NVIDIA H200")
    assert h200(6144, 4096) == gemv_mod.GemvConfig(4, 2048, 4)  # qkv
    assert h200(4096, 4096) == gemv_mod.GemvConfig(4, 2048, 4)  # o (16 Mi)
    assert h200(28672, 4096) == gemv_mod.GemvConfig(4, 2048, 4)  # gate_up
    assert h200(128256, 4096) == gemv_mod.GemvConfig(4, 4096, 8)  # LM head
    assert h200(4096, 14336) == gemv_mod.GemvConfig(8, 2048, 8)  # down
    assert h200(3072, 4096) == gemv_mod.GemvConfig(8, 1024, 4)  # a TP 2 share of qkv
    assert h200(28672, 4096, fp8=True) == gemv_mod.gemv_config(28672, 4096, fp8=True)
    assert gemv_mod.gemv_config(28672, 4096, gpu="NVIDIA H100 80GB HBM3") == (
        gemv_mod.GemvConfig(2, 4096, 8))
    assert gemv_mod.device_gpu(torch.zeros(1)) == ""  # off CUDA: no name, the H100's tiles


def test_gemv_rejects_bad_shapes():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[1, 16\] for weight \[8, 16\], got \(2, 16\)"):
        gemv_mod.gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"x must be \[1, 32\]"):
        gemv_mod.gemv(torch.zeros(1, 16, device=DEVICE), w, gated=True)
    with pytest.raises(ValueError, match="must be x.s dtype torch.bfloat16, got torch.float32"):
        gemv_mod.gemv(torch.zeros(1, 16, device=DEVICE, dtype=torch.bfloat16), w)


# ---------------------------------------------------------------------------------------------
# on the GPU

LLAMA_8B_PROJECTIONS = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, False),
                        (4096, 14336, True), (128256, 4096, False)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,gated", LLAMA_8B_PROJECTIONS)
def test_gpu_gemv_llama8b(n, k, gated):
    check(n, k, torch.bfloat16, gated)


@pytest.mark.gpu
def test_gpu_gemv_chain_in_cuda_graph():
    """A chain of GEMVs, each reading the one before's output, captured once and replayed after
    the input changes: under PDL each kernel starts before the previous one ends, so a missing
    wait would read stale input. The result must equal the eager chain's, bit for bit."""
    torch.manual_seed(0)
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(6)]
    up = torch.randn(2 * 4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)

    def chain():
        h = x
        for w in ws:
            h = gemv_mod.gemv(h, w)
        return gemv_mod.gemv(gemv_mod.gemv(h, up), ws[0], gated=True)

    x.normal_()
    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        x.normal_()
        expected = chain()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
