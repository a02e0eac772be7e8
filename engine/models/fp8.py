"""FP8 weights (`--quantization fp8`): the decoder layers' projections stored as float8 e4m3 with
one scale per output channel, quantized from the checkpoint's 16-bit weights when the model loads
(what vLLM calls online dynamic fp8; the embedding and the LM head keep the model's dtype, as
there).

Why: at batch 1 a decode step reads every weight once (Llama-3.1-8B: 15 GB in bf16), and a
prompt's step is mostly GEMMs; fp8 halves the bytes and doubles the tensor-core rate on
Hopper.

Numerics, for a projection y = x W^T with W [N, K]:
- weights: `s_w[n] = max_k |W[n, k]| * (1/448)`, `W8[n, k] = fp8(W[n, k] / s_w[n])` (round to
  nearest even, e4m3's largest finite value 448). A scale per output row is also a scale per
  row of each part of a fused qkv or gate_up matrix: fusing changes nothing.
- rows of more than one token (W8A8): each token's activations are quantized the same way with
  their own scale `s_x[t] = max_k |x[t, k]| * (1/448)`, and `y = (x8 s_x)(W8 s_w)^T` accumulates in
  fp32 (`torch._scaled_mm` on CUDA; the same arithmetic in fp32 elsewhere, the reference the
  CPU tests hold the model to);
- one token (the batch-1 decode path, engine/kernels/gemv.py): W8A16, the weights are
  dequantized in the GEMV and the activations stay in the model's dtype (there the step is
  bound by reading weights, and quantizing the row would cost accuracy for nothing).
- o and down at up to `DEFER_MAX_TOKENS` rows on CUDA (decode steps): the GEMM runs with unit
  scales (cuBLASLt's tensorwise fp8 GEMM, fp32 out) and the RMSNorm after the projection,
  which reads its output anyway, applies `s_x[t] * s_w[n]` and rounds to the model's dtype, as
  the rowwise GEMM's epilogue would (`Fp8Output`). At M = 128 torch's rowwise GEMM (CUTLASS)
  takes 14.3 and 37.6 us for o and down, the tensorwise one 10.0 and 26.1; from 512 rows on
  the two are equal and the fp32 output costs more (docs/benchmarks.md, `bench.fp8_sweep`).

The CPU path is there for the tests and for a model that must fit in less memory: it keeps
the fp8 weights but is slower than the model's own dtype (it dequantizes per call).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from engine.kernels.fp8_format import FP8, FP8_MAX, INV_FP8_MAX, MIN_AMAX

QUANTIZATIONS = ("fp8",)
# o and down leave their scales to the norm after them up to this many rows (see above)
DEFER_MAX_TOKENS = 256
# the projections quantized in each decoder layer (the embedding and LM head are not)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Fp8Activation(NamedTuple):
    """A projection's input already quantized per token (by the RMSNorm kernel before it)."""

    x8: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32


class Fp8Output(NamedTuple):
    """A projection's output with its scales not yet applied: the value is
    `(acc * row_scale * col_scale)` rounded to `dtype`, which the RMSNorm after it computes
    (engine/kernels/fused.py); `materialize` for anything else."""

    acc: torch.Tensor  # [T, N] float32, the GEMM of the fp8 operands with unit scales
    row_scale: torch.Tensor  # [T, 1] float32, the activations' per-token scales
    col_scale: torch.Tensor  # [N] float32, the weights' per-channel scales
    dtype: torch.dtype  # the model's

    def materialize(self) -> torch.Tensor:
        return (self.acc * self.row_scale * self.col_scale).to(self.dtype)


def check_supported(device: torch.device, what: str = "quantization fp8") -> None:
    """Raise ValueError naming the device when fp8 (`what`: weights, or the KV cache) cannot
    run on it: CUDA needs compute capability 8.9 (Ada, Hopper) or later for fp8 tensor cores
    and Triton's e4m3 conversions."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{what} needs a GPU of compute capability 8.9 or later "
                         f"(Ada, Hopper); {device} is {name} ({major}.{minor})")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, scale): x [R, K] as fp8 with one fp32 scale per row [R, 1], x ~ x8 * scale.

    The reference of the Triton kernel (engine/kernels/quant.py), same operations in the same
    order: amax, scale = amax * fp32(1/448), then x * (1 / scale), saturated to +-448.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    scale = amax * INV_FP8_MAX
    x8 = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, scale


class Fp8Linear(nn.Module):
    """A bias-free projection with fp8 weights [N, K] and fp32 scales [N] (see the module doc).

    `use_triton` (set by `LlamaForCausalLM.use_triton_kernels` for weights on CUDA) quantizes
    activations with the Triton kernel (and, for the down projection, computes SiLU·mul in the
    same pass); otherwise torch ops do, as `quantize_rows` (the interpreter's fp8 rounding is
    not the GPU's: engine/kernels/quant.py). `defer_scales` (set there for o and down, whose
    outputs go to a Triton RMSNorm) returns an `Fp8Output` for up to `DEFER_MAX_TOKENS` rows
    on CUDA.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", scale)  # [N] float32
        # the tensorwise GEMM's scales when the norm applies the real ones (`Fp8Output`)
        self.register_buffer("unit_scale", torch.ones((), device=weight.device),
                             persistent=False)  # fmt: skip
        self.out_dtype = out_dtype
        self.use_triton = False
        self.defer_scales = False

    @classmethod
    def empty(cls, out_features: int, in_features: int, out_dtype: torch.dtype,
              device: torch.device) -> "Fp8Linear":
        """Unfilled, for an fp8 checkpoint's weights and scales to be copied in."""
        return cls(torch.empty(out_features, in_features, dtype=FP8, device=device),
                   torch.empty(out_features, dtype=torch.float32, device=device), out_dtype)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        if linear.bias is not None:
            raise ValueError("fp8 projections have no bias")
        weight, scale = quantize_rows(linear.weight)
        return cls(weight, scale.view(-1), linear.weight.dtype)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor | Fp8Activation, gated: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor | Fp8Output:
        """`x W^T` for x [T, K] (or already quantized), or for `silu(gate) * up` of x =
        [gate | up] [T, 2K] (gated); into out [T, N] when given; an `Fp8Output` when
        `defer_scales` and x has at most `DEFER_MAX_TOKENS` rows on CUDA."""
        if isinstance(x, Fp8Activation):
            x8, scale = x
        elif self.use_triton:
            from engine.kernels.quant import quantize_fp8

            x8, scale = quantize_fp8(x, gated=gated)
        else:
            if gated:
                gate, up = x.chunk(2, dim=-1)
                x = nn.functional.silu(gate) * up
            x8, scale = quantize_rows(x)
        if (self.defer_scales and out is None and x8.is_cuda
                and x8.shape[0] <= DEFER_MAX_TOKENS):  # fmt: skip
            acc = torch._scaled_mm(x8, self.weight.t(), scale_a=self.unit_scale,
                                   scale_b=self.unit_scale, out_dtype=torch.float32)
            return Fp8Output(acc, scale, self.weight_scale, self.out_dtype)
        return self.matmul(x8, scale, out)

    def matmul(self, x8: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """(x8 scale)(W8 s_w)^T for quantized activations x8 [T, K] and their scales [T, 1]."""
        if x8.is_cuda:
            kwargs = {} if out is None else {"out": out}
            return torch._scaled_mm(x8, self.weight.t(), scale_a=scale,
                                    scale_b=self.weight_scale.view(1, -1),
                                    out_dtype=self.out_dtype, **kwargs)  # fmt: skip
        y = torch.mm(x8.float() * scale, self.dequantized().t()).to(self.out_dtype)
        return y if out is None else out.copy_(y)

    def dequantized(self) -> torch.Tensor:
        """W8 s_w in fp32 [N, K] (tests, references)."""
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, weight=float8_e4m3fn, per-channel scales"


@torch.no_grad()
def quantize_model(model: nn.Module) -> None:
    """Replace every decoder layer's projections with `Fp8Linear`, one at a time, so the peak
    memory is the model plus one projection's copy (those an fp8 checkpoint filled already
    stay as they are)."""
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, name)
            if isinstance(linear, Fp8Linear):
                continue
            setattr(parent, name, Fp8Linear.from_linear(linear))
            del linear


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


# ---- fp8 checkpoints --------------------------------------------------------------------------
# A checkpoint quantized ahead of time (llm-compressor's FP8 and FP8-dynamic, fbgemm's fp8, the
# "fp8" method's per-tensor scales) stores each projection's weight as float8 e4m3 with a
# `weight_scale` per output channel ([N, 1]) or per tensor ([1] or a scalar). Both are this
# module's weights: a per-tensor scale is the same scale on every row. Activations are always
# quantized per token as the step runs: a static `input_scale` is not used (per-token scales
# are at least as fine as a per-tensor one, so the outputs are close to, not equal to, an
# engine that applies it). Block-wise scales (`weight_block_size`) and other schemes (int4,
# int8, nvfp4) are refused by name.

# checkpoint tensors beside an fp8 weight that the engine does not use (see above; the KV
# cache's k_scale / v_scale: --kv-cache-dtype fp8 uses scale 1)
CHECKPOINT_UNUSED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale")


def checkpoint_scheme(model_config: dict, where: str = "config.json") -> str | None:
    """"fp8" when `quantization_config` in a checkpoint's config.json describes fp8 weights
    with per-channel or per-tensor scales; None when there is none. Raises ValueError naming
    the method or setting for any other scheme."""
    qc = model_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")

    def refuse(what: str) -> ValueError:
        return ValueError(f"{where}: quantization_config {what} is not supported; this engine "
                          "reads fp8 checkpoints with per-channel or per-tensor weight scales "
                          "(compressed-tensors FP8 / FP8-dynamic, fbgemm_fp8, fp8 without "
                          "weight_block_size), or a 16-bit checkpoint with --quantization fp8")

    if method == "fbgemm_fp8":
        return "fp8"
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise refuse(f"weight_block_size {qc['weight_block_size']} (block-wise fp8)")
        return "fp8"
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r}")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise refuse(f"{name} weights {w.get('type')!r} of {w.get('num_bits')} bits")
        if w.get("strategy") not in ("channel", "tensor"):
            raise refuse(f"{name} weight strategy {w.get('strategy')!r}")
        a = group.get("input_activations")
        if a and (a.get("type"), a.get("num_bits")) != ("float", 8):
            raise refuse(f"{name} input activations {a.get('type')!r} of "
                         f"{a.get('num_bits')} bits")
    return "fp8"
