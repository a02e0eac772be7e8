"""Llama-family causal LM (Llama 2/3/3.1/3.2, SmolLM2) over packed sequences.

Tokens of every sequence in a step are concatenated into one [T] batch with no padding; each
token carries its own position, and attention (which needs to know where sequences start and
which KV they see) is delegated to the `attn` object the runner passes in. Everything else —
norms, projections, RoPE, MLP — is per token, so it does not care how tokens are grouped.

Numerics follow transformers' LlamaModel so greedy tokens match it: RMSNorm in fp32 then cast
back, `weight * x`; RoPE cos/sin from fp32 inv_freq, rotate_half layout; llama3 frequency
scaling as `_compute_llama3_parameters` does. Q/K/V and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.layers import LoraLinear, OneRowDelta
from engine.models.fp8 import Fp8Activation, Fp8Linear, Fp8Output
from engine.models.parallel import TensorParallel
from microserve.model_config import ModelConfig


class Attention(Protocol):
    def attention(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        qkv_delta: OneRowDelta | None = None,
    ) -> torch.Tensor:
        """Rotate q and k by `positions` (RoPE, `apply_rope`), store this layer's k/v for the
        packed tokens, and attend. RoPE lives here so a GPU backend can fuse it with the
        KV-cache write; q, k, v may be modified in place.

        q: [T, num_heads, head_dim], k and v: [T, num_kv_heads, head_dim], not yet rotated;
        positions [T]; cos_sin the fp32 table of `RotaryEmbedding`. Returns [T, heads, head_dim].
        qkv_delta (batch-1 decode with a LoRA adapter): the adapter's delta, not yet in q, k,
        v; the backend adds it (`qkv_delta.add()`) before using them, or fuses it.
        """


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (vLLM's pattern):

        norm(x)              -> normed
        norm(x, residual)    -> (normed(x + residual), x + residual)

    `use_triton` (set by `LlamaForCausalLM.use_triton_kernels`) runs the Triton kernel, which
    works in place on x and residual; the torch path allocates. `quant_fp8` (also set there,
    when an fp8 projection follows) returns the normed rows quantized, as an `Fp8Activation`.
    x may be an fp8 projection's `Fp8Output`, whose scales the kernel applies first.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = False
        self.quant_fp8 = False

    def forward(self, x: torch.Tensor | Fp8Output, residual: torch.Tensor | None = None):
        if isinstance(x, Fp8Output):  # an fp8 projection left its scales to this kernel
            from engine.kernels.fused import rms_norm_scaled

            if residual is not None:
                normed = rms_norm_scaled(x, residual, self.weight, self.eps, self.quant_fp8)
                return (Fp8Activation(*normed) if self.quant_fp8 else normed), residual
            x = x.materialize()
        if self.quant_fp8:
            from engine.kernels.fused import rms_norm_fp8

            normed = Fp8Activation(*rms_norm_fp8(x, residual, self.weight, self.eps))
            return normed if residual is None else (normed, residual)
        if self.use_triton:
            from engine.kernels.fused import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, plain or llama3-scaled.

    Raises ValueError for other rope types: serving them with plain RoPE would be silently wrong.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise ValueError(
            f"rope_type {scaling['rope_type']!r} is not supported (supported: default, llama3)"
        )
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp
    between (same arithmetic as transformers, so the fp32 values are identical)."""
    try:
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"rope_scaling (llama3) is missing field {e.args[0]!r}") from None
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position_embeddings, computed once in fp32.

    The table is a non-persistent buffer: a model built on the meta device must call
    `reset_cache()` after `to_empty()` (the loader does).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        table = torch.empty(config.max_position_embeddings, 2, config.head_dim)
        self.register_buffer("cos_sin", table, persistent=False)
        if table.device.type != "meta":
            self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        inv_freq = rope_inv_freq(self.config).to(self.cos_sin.device)
        positions = torch.arange(self.config.max_position_embeddings, device=inv_freq.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, KV, D] by their tokens' positions [T]."""
        return apply_rope(q, k, positions, self.cos_sin)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of RoPE (transformers' arithmetic): rotate_half layout, cos/sin
    looked up in the fp32 table and cast to q's dtype."""
    rows = cos_sin[positions].to(q.dtype)
    cos, sin = rows[:, 0, None, :], rows[:, 1, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    """config: this rank's shapes (TensorParallel.local_config): its heads only; o_proj's
    partial products are summed over the ranks."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # rows: [ q (heads * head_dim) | k (kv_heads * head_dim) | v (kv_heads * head_dim) ]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: Attention
    ) -> torch.Tensor:
        qkv = _project(self.qkv_proj, x)
        return self.tp.all_reduce(_project(self.o_proj, self.attend(qkv, positions, rotary, attn)))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attn: Attention,
        qkv_delta: OneRowDelta | None = None,
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] (before o_proj) of the projected qkv [T, .]
        (qkv_delta: an adapter's delta still to be added to it, see Attention)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if qkv_delta is None:  # an Attention of before the keyword need not take it
            out = attn.attention(self.layer_idx, q, k, v, positions, rotary.cos_sin)
        else:
            out = attn.attention(self.layer_idx, q, k, v, positions, rotary.cos_sin,
                                 qkv_delta=qkv_delta)
        return out.reshape(-1, self.q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp  # config has this rank's rows; down's partial products are summed
        # rows: [ gate (intermediate) | up (intermediate) ]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.use_triton = False  # set by LlamaForCausalLM.use_triton_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the MLP's output, before the sum over the ranks."""
        gate_up = _project(self.gate_up_proj, x)
        if isinstance(self.down_proj, Fp8Linear):  # SiLU·mul inside its input's quantization
            return self.down_proj(gate_up, gated=True)
        if self.use_triton:
            from engine.kernels.fused import silu_and_mul

            return _project(self.down_proj, silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # one-token steps through the Triton GEMV kernels (set by use_triton_kernels)
        self.use_gemv = False

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        attn: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the previous layer's MLP output (or the embeddings, residual None); returns
        this layer's MLP output and the residual stream before it."""
        if self.use_gemv and positions.shape[0] == 1:  # x may be an Fp8Output
            return self._forward_one_row(x, residual, positions, rotary, attn)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rotary, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_one_row(self, x, residual, positions, rotary, attn):
        """The same layer for one token (batch-1 decode) in four GEMV kernels: each norm runs
        inside the projection after it, SiLU·mul inside the down projection. With an adapter
        each GEMV also computes the adapter's shrink (a few more rows: the same input); the
        expand of qkv's runs inside the attention's RoPE kernel, the others' in one small
        kernel after their GEMV."""
        from engine.kernels.gemv import gemv, rms_norm_gemv

        sa, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        lora = _lora_shrink(sa.qkv_proj)
        qkv, summed = rms_norm_gemv(x, residual, norm1.weight, norm1.eps, lora=lora,
                                    **_gemv_weight(sa.qkv_proj))  # fmt: skip
        delta = None
        if lora is not None:  # the expand goes into the attention's RoPE kernel
            delta = sa.qkv_proj.one_row_delta(lora, qkv)
        else:
            _lora_finish(sa.qkv_proj, lora, summed, qkv, norm=(norm1.weight, norm1.eps))
        x, residual = sa.attend(qkv, positions, rotary, attn, delta), summed
        lora = _lora_shrink(sa.o_proj)
        out = gemv(x, lora=lora, **_gemv_weight(sa.o_proj))
        _lora_finish(sa.o_proj, lora, x, out)
        x = sa.tp.all_reduce(out)
        lora = _lora_shrink(mlp.gate_up_proj)
        gate_up, summed = rms_norm_gemv(x, residual, norm2.weight, norm2.eps, lora=lora,
                                        **_gemv_weight(mlp.gate_up_proj))  # fmt: skip
        _lora_finish(mlp.gate_up_proj, lora, summed, gate_up, norm=(norm2.weight, norm2.eps))
        lora = _lora_shrink(mlp.down_proj)
        out = gemv(gate_up, gated=True, lora=lora, **_gemv_weight(mlp.down_proj))
        _lora_finish(mlp.down_proj, lora, gate_up, out, gated=True)
        return mlp.tp.all_reduce(out), summed


def _add_norm(norm: RMSNorm, x, residual: torch.Tensor):
    """norm(x, residual), the residual stream updated in `residual` itself (a view of rows of
    the whole stream): the Triton kernels do it in place, the torch path returns a new one."""
    normed, summed = norm(x, residual)
    if summed is not residual:
        residual.copy_(summed)
    return normed


def _add_norm_sum(norm: RMSNorm, summing, residual: torch.Tensor):
    """_add_norm of a sum under way (TensorParallel.all_reduce_async). Where the other rank's
    partial arrived by copy engine (engine/tp/exchange.py), the Triton norm kernel adds it
    itself instead of an add kernel before it."""
    x, theirs = summing.parts()
    if theirs is not None and norm.use_triton and not norm.quant_fp8:
        from engine.kernels.fused import fused_add_rms_norm

        fused_add_rms_norm(x, residual, norm.weight, norm.eps, peer=theirs)
    else:
        if theirs is not None:
            x.add_(theirs)
        x = _add_norm(norm, x, residual)
    summing.release()
    return x


def _lora_shrink(proj: nn.Module):
    """What a batch-1 GEMV needs to compute `proj`'s adapter shrink too (LoraLinear's
    `one_row_shrink`), or None."""
    return proj.one_row_shrink() if isinstance(proj, LoraLinear) else None


def _lora_finish(proj: nn.Module, shrink, x: torch.Tensor, out: torch.Tensor, **form) -> None:
    """out += the adapter's delta of a LoraLinear `proj` for one row: the expand of the shrink
    its GEMV computed, or (the torch path) the whole delta from x, in the form
    `LoraLinear.add_delta` takes; nothing for another projection."""
    if shrink is not None:
        proj.one_row_expand(shrink, out)
    elif isinstance(proj, LoraLinear):
        proj.add_delta(x, out, **form)


def _gemv_weight(proj: nn.Module) -> dict:
    """A projection's weight for the GEMV; fp8 weights bring their scales."""
    return {"weight": proj.weight,
            "scale": proj.weight_scale if isinstance(proj, Fp8Linear) else None}


def _project(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """proj(x); a step of 2..proj.few_rows rows through the few-rows kernel, where
    use_triton_kernels turned it on for this projection (plain 16-bit weights on CUDA)."""
    if 2 <= x.shape[0] <= getattr(proj, "few_rows", 0):
        from engine.kernels.few_rows import few_rows_linear

        return few_rows_linear(x, proj.weight)
    return proj(x)


def _project_into(proj: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = proj(x), written into out (a CUDA graph's static buffer)."""
    if isinstance(proj, (Fp8Linear, LoraLinear)):
        proj(x, out=out)
    else:
        torch.mm(x, proj.weight.t(), out=out)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # replicated
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # steps of at least this many tokens (and two) take _forward_overlapped (0: none), unless
        # a CUDA graph is being captured; set by the model runner for a tensor-parallel engine
        # (EngineConfig.tp_overlap_tokens)
        self.overlap_tokens = 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        if (self.overlap_tokens and input_ids.shape[0] >= max(self.overlap_tokens, 2)
                and not (input_ids.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self._forward_overlapped(input_ids, positions, attn)
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, attn)
        x, _ = self.norm(x, residual)
        return x

    def _forward_overlapped(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        """The same forward for a large step of a tensor-parallel model, its rows cut in two
        halves so that each all-reduce runs (NCCL, on its own stream) while the GPU computes
        the other half: everything but attention is row by row, so
        - o(half 2) runs beside the sum of o(half 1);
        - the MLP of half 1 beside the sum of o(half 2);
        - the MLP of half 2 beside the sum of down(half 1);
        - the next layer's norm and qkv of half 1 beside the sum of down(half 2).
        Attention runs on all the rows at once, as it must. Summed one after the other, the
        all-reduces of an 8,192-token step of an 8B model at TP 2 take 16% of its GPU time.
        Overlapped, NCCL's kernels slow the GEMMs beside them by about as much as they stop
        costing (0.2-0.7% gained); the copy-engine exchange (engine/tp/exchange.py) needs no
        SM, and with it the halves run 5-6% faster than the same sums after each GEMM
        (docs/benchmarks.md). Its other rank's partial is added inside the norm kernel."""
        t = input_ids.shape[0]
        halves = (slice(0, t // 2), slice(t // 2, t))
        residual = self.embed_tokens(input_ids)
        pending = None  # the previous layer's down partials per half, being summed
        for layer in self.layers:
            sa, mlp = layer.self_attn, layer.mlp
            qkv = torch.empty(t, sa.qkv_proj.weight.shape[0], dtype=residual.dtype,
                              device=residual.device)  # fmt: skip
            for i, rows in enumerate(halves):
                if pending is None:
                    x = layer.input_layernorm(residual[rows])
                else:
                    x = _add_norm_sum(layer.input_layernorm, pending[i], residual[rows])
                _project_into(sa.qkv_proj, x, qkv[rows])
            out = sa.attend(qkv, positions, self.rotary_emb, attn)
            summing = [sa.tp.all_reduce_async(sa.o_proj(out[rows])) for rows in halves]
            pending = []
            for i, rows in enumerate(halves):
                x = _add_norm_sum(layer.post_attention_layernorm, summing[i], residual[rows])
                pending.append(mlp.tp.all_reduce_async(mlp.partial(x)))
        hidden = torch.empty_like(residual)
        for i, rows in enumerate(halves):
            hidden[rows] = _add_norm_sum(self.norm, pending[i], residual[rows])
        return hidden


class LlamaForCausalLM(nn.Module):
    """Module names mirror transformers' (`model.layers.N.self_attn...`) so checkpoint names map
    one to one, except the fused `qkv_proj` and `gate_up_proj` (see loader.py).

    With `tp` of more than one rank the model is this rank's share (engine/models/parallel.py):
    `config` is then the rank's shapes (`TensorParallel.local_config` of the model's)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.config = config = tp.local_config(config)
        self.model = LlamaModel(config, tp)
        # tied: compute_logits reads the embedding matrix, so there is one weight to load
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, tp.vocab_per_rank(config.vocab_size), bias=False)
        )
        self.gemv_logits = False  # one-row logits through the Triton GEMV (use_triton_kernels)
        self.few_rows_logits = 0  # 2..this many rows through the few-rows kernel (the same)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the packed tokens input_ids [T] at
        positions [T]; `attn` owns which tokens belong to which sequence."""
        return self.model(input_ids, positions, attn)

    def forward_piece(self, i: int, bufs, t: int, store_kv) -> None:
        """Piece i of the forward pass cut at each layer's attention, for piecewise CUDA graphs
        (engine/cuda_graphs.py): from layer i-1's attention output (i = 0: the token ids) to
        layer i's q, k, v, which `store_kv(i, q, k, v)` rotates and writes to the cache; piece
        num_layers ends with the final-normed hidden states. Reads and writes only the first
        t rows of bufs' input_ids, residual, attn_out, qkv and hidden. Needs the fused Triton
        norms, which update the residual in place."""
        m = self.model
        residual = bufs.residual[:t]
        if i == 0:
            x = m.embed_tokens(bufs.input_ids[:t])
            residual.copy_(x)
            x = m.layers[0].input_layernorm(x)
        else:
            prev = m.layers[i - 1]
            attn = prev.self_attn
            out = attn.tp.all_reduce(attn.o_proj(bufs.attn_out[:t]))
            x, _ = prev.post_attention_layernorm(out, residual)
            last = i == len(m.layers)
            x, _ = (m.norm if last else m.layers[i].input_layernorm)(prev.mlp(x), residual)
            if last:
                bufs.hidden[:t].copy_(x)
                return
        sa = m.layers[i].self_attn
        qkv = bufs.qkv[:t]
        _project_into(sa.qkv_proj, x, qkv)
        q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        store_kv(i, q.view(t, sa.num_heads, sa.head_dim), k.view(t, sa.num_kv_heads, sa.head_dim),
                 v.view(t, sa.num_kv_heads, sa.head_dim))  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the hidden rows [N, hidden] the runner samples from
        (under tensor parallelism a collective: every rank calls it and gets the whole rows)."""
        vocab, tp = self.config.vocab_size, self.tp
        if self.lm_head is None:  # tied: this rank's rows of the (replicated) embedding
            weight = self.model.embed_tokens.weight[tp.vocab_rows(vocab)]
        else:
            weight = self.lm_head.weight
        if self.gemv_logits and hidden.shape[0] == 1:
            from engine.kernels.gemv import gemv

            logits = gemv(hidden, weight, torch.empty(1, weight.shape[0], dtype=torch.float32,
                                                      device=hidden.device))
        elif 2 <= hidden.shape[0] <= self.few_rows_logits and weight.dtype == hidden.dtype:
            from engine.kernels.few_rows import few_rows_linear

            logits = few_rows_linear(hidden, weight, torch.empty(
                hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device))
        else:
            logits = F.linear(hidden, weight).float()
        return tp.gather_vocab(logits, vocab)

    def use_triton_kernels(self, enabled: bool = True, gemv: bool = False,
                           few_rows: int = 0) -> None:
        """Run norms and SiLU*mul as the fused Triton kernels (CUDA); attention and RoPE are
        the attention backend's choice. `gemv`: one-row projections (batch-1 decode) through
        the Triton GEMV, for 16-bit weights (fp32 keeps cuBLAS and its exact greedy tokens).
        fp8 projections on CUDA quantize their inputs with Triton kernels: the norm before
        qkv and gate_up, the down projection's own (with SiLU·mul), o's own. `few_rows`: steps
        of 2..few_rows rows (at most 16) run the plain 16-bit projections and the LM head
        through the few-rows kernel (engine/kernels/few_rows.py); 0: cuBLAS."""
        from engine.kernels.fused import rms_norm_fp8_fits

        half = self.model.embed_tokens.weight.dtype in (torch.bfloat16, torch.float16)
        gemv = enabled and gemv and half
        few_rows = min(few_rows, 16) if enabled and half else 0
        for layer in self.model.layers:  # plain projections only: not fp8, not an adapter's
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.few_rows = few_rows if type(proj) is nn.Linear else 0
        self.few_rows_logits = few_rows
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.use_triton = enabled
            elif isinstance(module, Fp8Linear):
                module.use_triton = enabled and module.weight.is_cuda
            elif isinstance(module, LlamaDecoderLayer):
                module.use_gemv = gemv
        for layer in self.model.layers:  # the norms before fp8 projections quantize for them
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                norm.quant_fp8 = (isinstance(proj, Fp8Linear) and proj.use_triton
                                  and rms_norm_fp8_fits(norm.weight.shape[0]))
        # o's and down's outputs go to a Triton norm (post-attention, the next layer's input
        # norm, the final one), which applies their scales at decode sizes (fp8.Fp8Output)
        for layer in self.model.layers:
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                if isinstance(proj, Fp8Linear):  # (not across ranks: the sum needs the values)
                    proj.defer_scales = (proj.use_triton and self.tp.size == 1
                                         and rms_norm_fp8_fits(proj.weight.shape[0]))
        self.gemv_logits = gemv

    def reset_cache(self) -> None:
        """Recompute non-weight buffers (the RoPE table) after `to_empty()`."""
        self.model.rotary_emb.reset_cache()
