"""Adapters in fixed slots, applied to every token of a step at once: y = base(x) + delta(x),
where each token's delta uses the adapter in its slot (none: zero).

Each fused projection of the model (qkv_proj, o_proj, gate_up_proj, down_proj) is wrapped in a
`LoraLinear` holding the stacked weights of every slot, zero where a slot is empty or its
adapter does not target the module. With L slots of rank R and S slices (q, k, v of qkv_proj):

    shrink   mid  = x @ a_t^T                 x [T, in]   a_t [S*L*R, in]  mid [T, S, L, R]
    select   mid *= mask[:T, None, :, None]   mask [T, L]: 1 in the token's slot, else 0
    expand   y[:, slice s] += mid[:, s] @ b_s                b_s [L*R, out_s]

Every slot is computed and the mask keeps the token's own: no per-token indexing, no host
sync, fixed shapes, so a CUDA graph captures it (the mask and the slot weights are static
buffers written in place). It costs L*R/in of the base's FLOPs per projection (8 slots of rank
16 over a 4,096 input: 3%); a segmented kernel (Punica's SGMV) would skip the other slots' work
and is not written yet. The shrink of a token without an adapter multiplies zeros: base tokens
get exactly y = base(x) + 0.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.adapter import TARGET_MODULES, AdapterWeights, module_shapes
from microserve.model_config import ModelConfig

# our fused projection -> the PEFT modules in its output rows, in order
_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
           "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoraBatch:
    """The per-token slot mask every LoraLinear of the model reads: row t is token t's slot
    (one-hot), all zero for the base. Written by `set_slots` before each forward (the
    runner's), sized for the largest step or CUDA graph bucket."""

    def __init__(self, max_loras: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_loras = max_loras
        self.mask = torch.zeros(max_tokens, max_loras, dtype=dtype, device=device)
        self._slot_ids = torch.arange(max_loras, device=device)

    def set_slots(self, slots: torch.Tensor) -> None:
        """slots [T] (long, on the device): each token's slot, -1 for the base. Rows past T
        (a graph's padding) are zeroed."""
        n = slots.shape[0]
        self.mask[:n] = (slots[:, None] == self._slot_ids[None, :]).to(self.mask.dtype)
        self.mask[n:].zero_()


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of every slot (see the module's docstring)."""

    def __init__(self, base: nn.Linear, batch: LoraBatch, slices: list[int], rank: int):
        super().__init__()
        self.base = base
        self.batch = batch
        self.rank = rank
        w = base.weight
        loras = batch.max_loras
        # A of every slice and slot, one row per rank: the layout a projection's weight has,
        # so batch-1 decode's GEMV kernels shrink with it as they project with the base's
        self.a_t = torch.zeros(len(slices) * loras * rank, w.shape[1], dtype=w.dtype,
                               device=w.device)
        self.b = [torch.zeros(loras * rank, size, dtype=w.dtype, device=w.device)
                  for size in slices]
        self.offsets = [sum(slices[:i]) for i in range(len(slices))]

    @property
    def weight(self) -> torch.Tensor:  # the base's: what fused kernels and loaders read
        return self.base.weight

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = self.base(x)
        else:  # a CUDA graph's static buffer (LlamaForCausalLM.forward_piece)
            torch.mm(x, self.base.weight.t(), out=out)
        self.add_delta(x @ self.a_t.t(), out)
        return out

    def add_delta(self, shrunk: torch.Tensor, out: torch.Tensor) -> None:
        """out += each token's adapter delta, given shrunk = x @ a_t^T [T, S*L*R]."""
        t, loras, rank = shrunk.shape[0], self.batch.max_loras, self.rank
        mid = shrunk.view(t, len(self.b), loras, rank) * self.batch.mask[:t, None, :, None]
        for s, (b, offset) in enumerate(zip(self.b, self.offsets)):
            out[:, offset : offset + b.shape[1]] += mid[:, s].reshape(t, loras * rank) @ b

    @torch.no_grad()
    def write_slot(self, slot: int, halves: list[tuple[torch.Tensor, torch.Tensor] | None]):
        """Put one adapter's (A [r, in], B [out, r]) of each slice into `slot` (None: the
        adapter does not target that slice), zeroing what it does not fill."""
        loras, rank = self.batch.max_loras, self.rank
        for s, pair in enumerate(halves):
            cols = slice((s * loras + slot) * rank, (s * loras + slot + 1) * rank)
            rows = slice(slot * rank, (slot + 1) * rank)
            self.a_t[cols].zero_()
            self.b[s][rows].zero_()
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                self.a_t[cols][:r].copy_(a)
                self.b[s][rows][:r].copy_(b.t())


class LoraModel:
    """The LoRA side of one model: its LoraLinears by (layer, projection) and the batch mask.

    Args: model (a LlamaForCausalLM, 16- or 32-bit weights), config, max_loras (slots),
    max_rank, max_tokens (the most tokens in one forward, padding included)."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int,
                 max_tokens: int):
        w = model.model.embed_tokens.weight
        self.batch = LoraBatch(max_loras, max_tokens, w.dtype, w.device)
        shapes = module_shapes(config)
        self.layers: list[dict[str, LoraLinear]] = []
        for layer in model.model.layers:
            wrapped = {}
            for parent in (layer.self_attn, layer.mlp):
                for name, modules in _SLICES.items():
                    base = getattr(parent, name, None)
                    if base is None:
                        continue
                    sizes = [shapes[m][1] for m in modules]
                    wrapped[name] = LoraLinear(base, self.batch, sizes, max_rank)
                    setattr(parent, name, wrapped[name])
            self.layers.append(wrapped)

    def write_slot(self, slot: int, adapter: AdapterWeights | None) -> None:
        """Load `adapter` into `slot` (None: empty it)."""
        for i, wrapped in enumerate(self.layers):
            for name, proj in wrapped.items():
                halves = []
                for module in _SLICES[name]:
                    pair = None if adapter is None else adapter.weights.get((i, module))
                    halves.append(None if pair is None else
                                  (pair[0].to(proj.a_t.dtype), pair[1].to(proj.a_t.dtype)))
                proj.write_slot(slot, halves)


assert set(TARGET_MODULES) == {m for ms in _SLICES.values() for m in ms}
