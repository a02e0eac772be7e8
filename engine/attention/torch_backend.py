"""Reference attention over the paged KV cache in plain torch (CPU, and the GPU kernels' oracle).

Single-token queries (decode) are gathered into one padded batch and attended in one call per
layer; multi-token queries (prefill chunks) are attended one sequence at a time with a causal
mask offset by the sequence's cached context. All index tensors are built once per step in
`plan`; `forward` only gathers, writes and calls scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.forward import ForwardBatch
from kvcache.paged import AttentionBackend


@dataclass
class _Prefill:
    token_start: int  # first row of this sequence in the packed q
    token_end: int
    slots: torch.Tensor  # [kv_len] flat slots of all its KV
    mask: torch.Tensor | None  # [new, kv_len] bool, None when the context is empty (is_causal)


@dataclass
class _Decode:
    rows: torch.Tensor  # [B] packed row of each single-token query
    slots: torch.Tensor  # [B, max_kv] flat slots, padded with 0
    mask: torch.Tensor  # [B, 1, 1, max_kv] bool, True where a key is real


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._slot_mapping: torch.Tensor | None = None
        self._prefills: list[_Prefill] = []
        self._decode: _Decode | None = None

    def plan(self, batch: ForwardBatch) -> None:
        dev = self.device
        self._slot_mapping = torch.tensor(batch.slot_mapping(), dtype=torch.long, device=dev)
        self._prefills, decode_rows, decode_slots = [], [], []
        row = 0
        for s in batch.seqs:
            slots = batch.kv_slots(s)
            if s.num_new_tokens == 1:
                decode_rows.append(row)
                decode_slots.append(slots)
            else:
                mask = None
                if s.context_len:
                    q_pos = torch.arange(s.context_len, s.kv_len, device=dev)[:, None]
                    mask = torch.arange(s.kv_len, device=dev)[None, :] <= q_pos
                t_slots = torch.tensor(slots, dtype=torch.long, device=dev)
                self._prefills.append(_Prefill(row, row + s.num_new_tokens, t_slots, mask))
            row += s.num_new_tokens
        self._decode = self._plan_decode(decode_rows, decode_slots) if decode_rows else None

    def _plan_decode(self, rows: list[int], slots: list[list[int]]) -> _Decode:
        max_kv = max(len(s) for s in slots)
        padded = torch.zeros(len(slots), max_kv, dtype=torch.long)
        mask = torch.zeros(len(slots), max_kv, dtype=torch.bool)
        for i, s in enumerate(slots):
            padded[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
        dev = self.device
        return _Decode(
            torch.tensor(rows, dtype=torch.long, device=dev),
            padded.to(dev),
            mask[:, None, None, :].to(dev),
        )

    def forward(self, kv_layer, q, k, v):
        k_flat = kv_layer[0].view(-1, *kv_layer.shape[-2:])  # [pages * page_size, heads, dim]
        v_flat = kv_layer[1].view(-1, *kv_layer.shape[-2:])
        k_flat.index_copy_(0, self._slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, self._slot_mapping, v.to(v_flat.dtype))
        out = torch.empty_like(q)
        for p in self._prefills:
            qs = q[p.token_start : p.token_end].transpose(0, 1)  # [heads, new, dim]
            ks = k_flat[p.slots].transpose(0, 1)  # [kv_heads, kv_len, dim]
            vs = v_flat[p.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
            )
            out[p.token_start : p.token_end] = o.transpose(0, 1)
        if self._decode is not None:
            d = self._decode
            qs = q[d.rows].unsqueeze(2)  # [B, heads, 1, dim]
            ks = k_flat[d.slots].permute(0, 2, 1, 3)  # [B, kv_heads, max_kv, dim]
            vs = v_flat[d.slots].permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, enable_gqa=True)
            out[d.rows] = o.squeeze(2)
        return out
