"""FP8 weights (`--quantization fp8`, engine/models/fp8.py and engine/kernels/quant.py).

- Quantizing rows: the scale is the row's largest magnitude times 1/448, that element lands
  on +-448, every value within e4m3's rounding, a zero row stays zeros, and a fused matrix
  quantizes to the bytes of its parts quantized apart.
- `Fp8Linear` computes (x8 s_x)(W8 s_w)^T; the Triton GEMV with fp8 weights computes
  x (W8 s_w)^T, plain, gated and with the RMSNorm before it.
- The activation quantization kernel gives `quantize_rows`'s bytes: under the CPU interpreter
  on values its (inexact) fp8 conversion holds exactly, on the GPU on random values.
- The engine with `quantization="fp8"` generates exactly the greedy tokens of Hugging Face's
  model with each projection replaced by the same W8A8 arithmetic, and they differ from the
  unquantized model's (the quantization is real).
- Bad settings are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import _hf_model
from test_engine_core import greedy, make_core, random_prompts, run_all
from triton_kernels import DEVICE, load

from bench.fp8_quality import hf_fp8_projections
from engine.config import EngineConfig
from engine.models import fp8
from engine.models.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_rows
from microserve.messages import SamplingParams

quant_mod = load("engine.kernels.quant")
gemv_mod = load("engine.kernels.gemv")
# e4m3: 3 mantissa bits, so rounding moves a normal value by at most 2^-4 of itself
E4M3_REL = 2.0**-4
E4M3_MIN_NORMAL = 2.0**-6


def test_quantize_rows_scales_each_row_by_its_largest_magnitude():
    torch.manual_seed(0)
    x = torch.randn(4, 96) * torch.tensor([[1.0], [1e-3], [50.0], [0.0]])
    x8, scale = quantize_rows(x)
    assert x8.dtype == FP8 and scale.shape == (4, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.equal(scale[:3], amax[:3] * fp8.INV_FP8_MAX)
    assert scale[3].item() == pytest.approx(fp8.MIN_AMAX / FP8_MAX)  # a zero row: no NaN
    assert x8[3].float().abs().max().item() == 0.0
    top = x[:3].abs().argmax(-1)
    assert x8[:3].float().gather(1, top[:, None]).abs().flatten().tolist() == [FP8_MAX] * 3
    back = x8.float() * scale
    normal = x8.float().abs() >= E4M3_MIN_NORMAL
    assert ((back - x).abs() <= E4M3_REL * x.abs() + 1e-30)[normal].all()
    # the bytes are torch's own round-to-nearest-even cast of x / scale
    expected = (x * (1.0 / scale)).to(FP8)
    assert torch.equal(x8.view(torch.uint8), expected.view(torch.uint8))


def test_a_fused_matrix_quantizes_to_its_parts_bytes():
    """A scale per output row: quantizing qkv fused equals quantizing q, k and v apart, so HF's
    separate projections quantized alone are a reference for our fused ones."""
    torch.manual_seed(1)
    q, k, v = torch.randn(32, 64), torch.randn(8, 64) * 3, torch.randn(8, 64) * 0.1
    fused8, fused_scale = quantize_rows(torch.cat([q, k, v]))
    parts = [quantize_rows(t) for t in (q, k, v)]
    assert torch.equal(fused8.view(torch.uint8),
                       torch.cat([p[0] for p in parts]).view(torch.uint8))  # fmt: skip
    assert torch.equal(fused_scale, torch.cat([p[1] for p in parts]))


def test_fp8_linear_is_w8a8_on_cpu():
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 48, bias=False)
    proj = Fp8Linear.from_linear(linear)
    assert proj.weight.dtype == FP8 and proj.weight_scale.shape == (48,)
    x = torch.randn(5, 64)
    x8, sx = quantize_rows(x)
    expected = (x8.float() * sx) @ (proj.weight.float() * proj.weight_scale[:, None]).t()
    assert torch.equal(proj(x), expected)
    assert (proj(x) - linear(x)).abs().max() < 0.1 * linear(x).abs().max()  # close, not equal
    assert not torch.equal(proj(x), linear(x))
    out = torch.empty(5, 48)
    assert proj(x, out=out) is out and torch.equal(out, expected)
    gate_up = torch.randn(3, 128)
    gate, up = gate_up.chunk(2, dim=-1)
    down = Fp8Linear.from_linear(torch.nn.Linear(64, 16, bias=False))
    assert torch.equal(down(gate_up, gated=True), down(F.silu(gate) * up))


# ---- the activation kernel (the interpreter on CPU, compiled on CUDA) -------------------------

def _exact_rows(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose quantization the interpreter's fp8 conversion holds exactly: each row is e4m3
    values >= 2^-6 (or 0) times a power of two, one of them +-448, so x / scale is exact."""
    grid = torch.arange(0, 256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid) & ((grid.abs() >= E4M3_MIN_NORMAL) | (grid == 0))]
    picks = grid[torch.randint(len(grid), (rows, k), generator=gen)]
    picks[:, 0] = FP8_MAX * torch.where(torch.rand(rows, generator=gen) < 0.5, -1.0, 1.0)
    powers = 2.0 ** torch.randint(-12, 4, (rows, 1), generator=gen).float()
    return picks * powers


@pytest.mark.parametrize("k", [576, 4096, 1000, 20000])  # 20,000: the two-pass loop
def test_quant_kernel_equals_the_reference_on_exact_values(k):
    gen = torch.Generator().manual_seed(k)
    x = _exact_rows(6, k, gen).to(DEVICE)
    x[3] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        x8, scale = quant_mod.quantize_fp8(x.to(dtype))
        ref8, ref_scale = quantize_rows(x.to(dtype))
        assert torch.equal(scale, ref_scale)
        assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
        assert torch.equal(x8.float() * scale, x.to(dtype).float())  # exact round trip


def test_quant_kernel_gated_computes_silu_mul_then_quantizes():
    """gate = 32 makes silu(gate) = gate exactly in fp32 (exp(-32) vanishes beside 1), so
    silu(gate) * up = 32 up: exact values again; the scale carries the factor."""
    gen = torch.Generator().manual_seed(7)
    up = _exact_rows(4, 1536, gen).to(DEVICE)
    gate = torch.full_like(up, 32.0)
    x8, scale = quant_mod.quantize_fp8(torch.cat([gate, up], dim=1), gated=True)
    ref8, ref_scale = quantize_rows(32.0 * up)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    with pytest.raises(ValueError, match=r"\[T, 2 \* K\]"):
        quant_mod.quantize_fp8(torch.zeros(2, 7, device=DEVICE), gated=True)


@pytest.mark.parametrize("hidden", [576, 4096])
def test_rms_norm_fp8_equals_the_norm_then_the_quantization(hidden):
    """The norm before qkv and gate_up writes fp8 itself: the same bytes and scales as the
    Triton norm followed by the quantization kernel, and the same summed residual."""
    fused = load("engine.kernels.fused")
    torch.manual_seed(hidden)
    x = torch.randn(7, hidden, device=DEVICE).bfloat16()
    residual = torch.randn(7, hidden, device=DEVICE).bfloat16()
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).bfloat16()
    normed, ref_residual = x.clone(), residual.clone()
    fused.fused_add_rms_norm(normed, ref_residual, weight, 1e-5)
    ref8, ref_scale = quant_mod.quantize_fp8(normed)
    got_residual = residual.clone()
    x8, scale = fused.rms_norm_fp8(x, got_residual, weight, 1e-5)
    assert torch.equal(got_residual, ref_residual)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    ref8, ref_scale = quant_mod.quantize_fp8(fused.rms_norm(x, weight, 1e-5))
    x8, scale = fused.rms_norm_fp8(x, None, weight, 1e-5)  # the first layer: no residual
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    with pytest.raises(ValueError, match="hidden <= 8192, got 16384"):
        fused.rms_norm_fp8(torch.zeros(1, 16384, device=DEVICE), None,
                           torch.ones(16384, device=DEVICE), 1e-5)  # fmt: skip


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("values", ["exact", pytest.param("random", marks=pytest.mark.gpu)])
def test_the_norm_applies_the_scales_an_fp8_projection_left_out(hidden, values):
    """o and down at decode sizes leave `s_x[t] * s_w[n]` to the norm after them (fp8.Fp8Output):
    it gives the bytes of the projection's output rounded to bf16 first, then the plain norms
    (fused_add_rms_norm, rms_norm_fp8), and the same summed residual. The interpreter rounds
    fp32 to bf16 by truncation, torch to nearest even: on CPU the scaled values are exact in
    bf16 (integers up to 256 times powers of two); on the GPU, random."""
    fused = load("engine.kernels.fused")
    torch.manual_seed(hidden + 1)
    if values == "exact":
        acc = torch.randint(-256, 257, (9, hidden), device=DEVICE).float()
        row_scale = 2.0 ** -torch.randint(8, 12, (9, 1), device=DEVICE).float()
        col_scale = 2.0 ** -torch.randint(0, 4, (hidden,), device=DEVICE).float()
    else:
        acc = torch.randn(9, hidden, device=DEVICE) * 300
        row_scale = torch.rand(9, 1, device=DEVICE) * 1e-3
        col_scale = torch.rand(hidden, device=DEVICE) * 1e-2
    residual = torch.randn(9, hidden, device=DEVICE).bfloat16()
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).bfloat16()
    out = fp8.Fp8Output(acc, row_scale, col_scale, torch.bfloat16)
    y = out.materialize()
    assert torch.equal(y, (acc * row_scale * col_scale).bfloat16())
    normed, ref_residual = y.clone(), residual.clone()
    fused.fused_add_rms_norm(normed, ref_residual, weight, 1e-5)
    got_residual = residual.clone()
    got = fused.rms_norm_scaled(out, got_residual, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, normed) and torch.equal(got_residual, ref_residual)
    ref8, ref_scale = fused.rms_norm_fp8(y, residual.clone(), weight, 1e-5)
    got_residual = residual.clone()
    x8, scale = fused.rms_norm_scaled(out, got_residual, weight, 1e-5, quant=True)
    assert torch.equal(got_residual, ref_residual) and torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    with pytest.raises(ValueError, match=r"residual \(9, 5\) torch.bfloat16 must be"):
        fused.rms_norm_scaled(out, residual[:, :5], weight, 1e-5)
    with pytest.raises(ValueError, match=r"row scales \[9, 1\] and column scales"):
        fused.rms_norm_scaled(out._replace(col_scale=col_scale[:3]), residual.clone(), weight,
                              1e-5)  # fmt: skip


# ---- the fp8 GEMV (batch-1 decode) ----------------------------------------

@pytest.mark.parametrize("n,k", [(40, 64), (33, 96), (16, 5000)])
def test_fp8_gemv_equals_linear_over_dequantized_weights(n, k):
    torch.manual_seed(n + k)
    w8, scale = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.05)
    dequant = w8.float() * scale
    scale = scale.view(-1)
    x = torch.randn(1, k, device=DEVICE)
    out = gemv_mod.gemv(x, w8, scale=scale)
    assert torch.allclose(out, F.linear(x, dequant), rtol=1e-4, atol=1e-5)
    gate_up = torch.randn(1, 2 * k, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    out = gemv_mod.gemv(gate_up, w8, gated=True, scale=scale)
    assert torch.allclose(out, F.linear(F.silu(gate) * up, dequant), rtol=1e-4, atol=1e-5)
    residual, norm_w = torch.randn(1, k, device=DEVICE), torch.rand(k, device=DEVICE) + 0.5
    out, res_out = gemv_mod.rms_norm_gemv(x, residual, norm_w, 1e-5, w8, scale=scale)
    s = x + residual
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    assert torch.equal(res_out, s)
    assert torch.allclose(out, F.linear(normed, dequant), rtol=1e-4, atol=1e-5)


def test_fp8_gemv_refuses_mismatched_scales():
    w8, scale = quantize_rows(torch.randn(8, 32, device=DEVICE))
    x = torch.zeros(1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="x's dtype"):
        gemv_mod.gemv(x, w8)  # fp8 weights without their scales
    with pytest.raises(ValueError, match=r"float32 scales \[N\]"):
        gemv_mod.gemv(x, w8, scale=scale.view(-1)[:4])


# ---- the engine with SmolLM2 ------------------------------------------------------------------

def _hf_fp8_greedy(model_dir: str, prompt: list[int], n: int,
                   quantize_weight=quantize_rows) -> list[int]:
    """HF's greedy loop with every decoder projection computing W8A8 (per-row weights unless
    `quantize_weight` says otherwise, per-token activations:
    `bench.fp8_quality.hf_fp8_projections`)."""
    tokens = []
    with torch.no_grad(), hf_fp8_projections(_hf_model(model_dir), quantize_weight) as model:
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values,
                         use_cache=True)  # fmt: skip
    return tokens


def test_engine_fp8_equals_hf_with_the_same_quantization(tiny_model_dir):
    """The tiny model (peaky logits: greedy choices far from ties) batched as the engine
    batches. A model whose logits sit closer together flips greedy choices on the fp32
    summation order alone: rounding to e4m3 turns a last-bit difference into a whole step of
    the grid (SmolLM2's logprobs move by ~0.05 between two correct implementations)."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([1, 5, 17, 40, 64, 90]))}
    n = 32
    core = make_core(tiny_model_dir, quantization="fp8")
    assert core.info.quantization == "fp8"
    model = core.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    assert model.model.embed_tokens.weight.dtype == torch.float32  # not quantized
    assert model.lm_head.weight.dtype == torch.float32
    got = run_all(core, prompts, greedy(n))
    plain = run_all(make_core(tiny_model_dir), prompts, greedy(n))
    for rid, prompt in prompts.items():
        assert got[rid][0] == _hf_fp8_greedy(tiny_model_dir, prompt, n), rid
        assert got[rid][0] != plain[rid][0], rid  # the weights really changed


def test_bad_quantization_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="quantization must be fp8 or None, got 'int4'"):
        EngineConfig(model="/unused", quantization="int4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or later .* A100 \(8.0\)"):
        fp8.check_supported(torch.device("cuda:0"))
    fp8.check_supported(torch.device("cpu"))  # emulated on CPU


def test_cli_takes_quantization():
    from launcher.cli import parser

    args = parser().parse_args(["engine", "--quantization", "fp8"])
    assert args.quantization == "fp8"
    assert parser().parse_args(["engine"]).quantization is None
    with pytest.raises(SystemExit):
        parser().parse_args(["engine", "--quantization", "int8"])


# ---- on the GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336, 1000])
def test_quant_kernel_bytes_equal_the_reference_on_gpu(k):
    from engine.kernels.fused import silu_and_mul
    from engine.kernels.quant import quantize_fp8

    torch.manual_seed(k)
    x = (torch.randn(37, k, device="cuda") * torch.rand(37, 1, device="cuda") * 10).bfloat16()
    x[5] = 0
    x8, scale = quantize_fp8(x)
    ref8, ref_scale = quantize_rows(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    g = torch.randn(37, 2 * k, device="cuda").bfloat16() * 4
    x8, scale = quantize_fp8(g, gated=True)
    ref8, ref_scale = quantize_rows(silu_and_mul(g))
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))


@pytest.mark.gpu
def test_fp8_linear_on_gpu_matches_the_cpu_arithmetic():
    torch.manual_seed(3)
    linear = torch.nn.Linear(4096, 6144, bias=False).cuda().bfloat16()
    proj = Fp8Linear.from_linear(linear)
    proj.use_triton = True
    x = torch.randn(77, 4096, device="cuda").bfloat16()
    x8, sx = quantize_rows(x)
    expected = (x8.float() * sx) @ proj.dequantized().t()
    got = proj(x)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max())
    out = torch.empty(80, 6144, device="cuda", dtype=torch.bfloat16)[:77]
    assert proj(x, out=out).data_ptr() == out.data_ptr() and torch.equal(out, got)
    w8 = proj.weight
    from engine.kernels.gemv import gemv

    one = gemv(x[:1], w8, scale=proj.weight_scale)
    ref = F.linear(x[:1].float(), proj.dequantized())
    assert torch.allclose(one.float(), ref, rtol=2e-2, atol=1e-2 * ref.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 77, 256, 257])
def test_o_and_down_leave_their_scales_to_the_norm_at_decode_sizes(m):
    """Up to DEFER_MAX_TOKENS rows a deferring projection returns the tensorwise GEMM and the
    scales (what the norm applies), equal to the rowwise GEMM's output within fp32 accumulation
    order; above, the rowwise output itself."""
    torch.manual_seed(m)
    proj = Fp8Linear.from_linear(torch.nn.Linear(14336, 4096, bias=False).cuda().bfloat16())
    proj.use_triton = proj.defer_scales = True
    x = torch.randn(m, 2 * 14336, device="cuda").bfloat16()
    got = proj(x, gated=True)
    proj.defer_scales = False
    rowwise = proj(x, gated=True)
    if m > fp8.DEFER_MAX_TOKENS:
        assert isinstance(got, torch.Tensor) and torch.equal(got, rowwise)
        return
    assert isinstance(got, fp8.Fp8Output) and got.acc.dtype == torch.float32
    y = got.materialize()
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), rowwise.float(), rtol=1e-2, atol=1e-3 * rowwise.abs().max())


def _first_tokens(core, prompts: dict) -> dict:
    """Each prompt's greedy first token and its logprob (one prefill)."""
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))
    first = {}
    while core.has_work():
        for out in core.step():
            first[out.request_id] = (out.token_ids[0], out.logprobs[0].logprob)
    return first


@pytest.mark.gpu
def test_engine_fp8_on_gpu_in_fp32_gives_the_cpu_first_tokens(tiny_model_dir):
    """An fp32 engine on CUDA runs the same W8A8 arithmetic as the CPU (torch._scaled_mm,
    fp32 out), up to the order and precision in which fp8 tensor cores accumulate: the same
    first tokens, their logprobs within 0.1 (0.053 seen on an H100, where fp8 against the
    unquantized model moves them by ~0.2; over later steps e4m3's rounding turns such
    differences into other tokens, as between any two implementations: see the HF test). In
    bf16 the CUDA path (the fp8 GEMV at batch 1, CUDA graphs, the Triton quantizations)
    runs alone and batched."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([1, 17, 64, 90]))}
    cpu = _first_tokens(make_core(tiny_model_dir, quantization="fp8"), prompts)
    gpu = _first_tokens(make_core(tiny_model_dir, quantization="fp8", device="cuda",
                                  dtype="float32"), prompts)  # fmt: skip
    for rid in prompts:
        assert gpu[rid][0] == cpu[rid][0], rid
        assert gpu[rid][1] == pytest.approx(cpu[rid][1], abs=0.1), rid
    graphs = make_core(tiny_model_dir, quantization="fp8", device="cuda", dtype="bfloat16")
    assert graphs.runner.graphs is not None
    norm = graphs.runner.model.model.layers[0].input_layernorm
    assert norm.quant_fp8  # the Triton kernels quantize
    assert len(run_all(graphs, {"one": prompts["r1"]}, greedy(16))["one"][0]) == 16  # GEMV
    assert len(run_all(graphs, prompts, greedy(16))["r2"][0]) == 16


@pytest.mark.gpu
def test_engine_with_scales_left_to_the_norms_gives_the_rowwise_engines_tokens(tiny_model_dir,
                                                                                monkeypatch):
    """The fp8 engine on CUDA (fp32, CUDA graphs) with o's and down's scales applied by the norms
    at decode sizes gives the tokens of the same engine with the rowwise GEMM everywhere, and
    logprobs within fp32 accumulation order."""
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([5, 33, 80, 120]))}
    sampling = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)

    def generate() -> dict:
        core = make_core(tiny_model_dir, quantization="fp8", device="cuda", dtype="float32")
        o_proj = core.runner.model.model.layers[0].self_attn.o_proj
        for rid, prompt in prompts.items():
            core.add_request(rid, prompt, sampling)
        out = {rid: ([], []) for rid in prompts}
        while core.has_work():
            for o in core.step():
                out[o.request_id][0].extend(o.token_ids)
                out[o.request_id][1].extend(lp.logprob for lp in o.logprobs)
        return o_proj.defer_scales, out

    deferred, got = generate()
    monkeypatch.setattr(fp8, "DEFER_MAX_TOKENS", 0)
    _, rowwise = generate()
    assert deferred
    for rid in prompts:
        assert got[rid][0] == rowwise[rid][0] and len(got[rid][0]) == 12, rid
        assert got[rid][1] == pytest.approx(rowwise[rid][1], abs=2e-3), rid
