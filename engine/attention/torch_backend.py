"""Reference attention over the paged KV cache in plain torch (CPU, and the GPU kernels' oracle).

Single-token queries (decode) are gathered into one padded batch and attended in one call per
layer; multi-token queries (prefill chunks) are attended one sequence at a time with a causal
mask offset by the sequence's cached context. KV is gathered a whole page at a time (one index
per page, not per token). All index tensors are built once per step in `plan`; `forward` only
writes, gathers and calls scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.fp8 import FP8, FP8_MAX
from engine.models.llama import apply_rope
from kvcache.forward import ForwardBatch
from kvcache.paged import AttentionBackend


@dataclass
class _Prefill:
    token_start: int  # first row of this sequence in the packed q
    token_end: int
    pages: torch.Tensor  # [num_pages] its page table
    kv_len: int
    mask: torch.Tensor | None  # [new, kv_len] bool, None when the context is empty (is_causal)


@dataclass
class _Decode:
    rows: torch.Tensor  # [B] packed row of each single-token query
    pages: torch.Tensor  # [B, max_pages] page tables, padded with page 0
    mask: torch.Tensor  # [B, 1, 1, max_pages * page_size] bool, True where a key is real


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._slot_mapping: torch.Tensor | None = None
        self._prefills: list[_Prefill] = []
        self._decode: _Decode | None = None

    def plan(self, batch: ForwardBatch) -> None:
        dev, ps = self.device, batch.page_size
        self._slot_mapping = torch.tensor(batch.slot_mapping(), dtype=torch.long, device=dev)
        self._prefills, decode_rows, decode_seqs = [], [], []
        row = 0
        for s in batch.seqs:
            if s.num_new_tokens == 1:
                decode_rows.append(row)
                decode_seqs.append(s)
            else:
                mask = None
                if s.context_len:
                    q_pos = torch.arange(s.context_len, s.kv_len, device=dev)[:, None]
                    mask = torch.arange(s.kv_len, device=dev)[None, :] <= q_pos
                pages = torch.tensor(s.page_table[: -(-s.kv_len // ps)], device=dev)
                self._prefills.append(
                    _Prefill(row, row + s.num_new_tokens, pages, s.kv_len, mask)
                )
            row += s.num_new_tokens
        self._decode = None
        if decode_rows:
            self._decode = self._plan_decode(decode_rows, decode_seqs, ps)

    def _plan_decode(self, rows: list[int], seqs: list, ps: int) -> _Decode:
        n_pages = [-(-s.kv_len // ps) for s in seqs]
        max_pages = max(n_pages)
        tables = [s.page_table[:n] + [0] * (max_pages - n) for s, n in zip(seqs, n_pages)]
        kv_lens = torch.tensor([s.kv_len for s in seqs])
        mask = torch.arange(max_pages * ps)[None, :] < kv_lens[:, None]
        dev = self.device
        return _Decode(
            torch.tensor(rows, dtype=torch.long, device=dev),
            torch.tensor(tables, dtype=torch.long, device=dev),
            mask[:, None, None, :].to(dev),
        )

    def forward(self, kv_layer, q, k, v, positions, cos_sin, qkv_delta=None):
        if qkv_delta is not None:  # an adapter's delta still to be added (the model's Attention)
            qkv_delta.add()
        q, k = apply_rope(q, k, positions, cos_sin)
        heads_dim = kv_layer.shape[-2:]
        k_cache, v_cache = kv_layer[0], kv_layer[1]  # [pages, page_size, kv_heads, head_dim]
        store(k_cache, self._slot_mapping, k)
        store(v_cache, self._slot_mapping, v)
        out = torch.empty_like(q)
        for p in self._prefills:
            qs = q[p.token_start : p.token_end].transpose(0, 1)  # [heads, new, dim]
            ks = k_cache[p.pages].view(-1, *heads_dim)[: p.kv_len].transpose(0, 1).to(q.dtype)
            vs = v_cache[p.pages].view(-1, *heads_dim)[: p.kv_len].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, enable_gqa=True
            )
            out[p.token_start : p.token_end] = o.transpose(0, 1)
        if self._decode is not None:
            d = self._decode
            batch = d.pages.shape[0]
            qs = q[d.rows].unsqueeze(2)  # [B, heads, 1, dim]
            ks = k_cache[d.pages].view(batch, -1, *heads_dim).transpose(1, 2).to(q.dtype)
            vs = v_cache[d.pages].view(batch, -1, *heads_dim).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, enable_gqa=True)
            out[d.rows] = o.squeeze(2)
        return out


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, kv_heads, head_dim] into slots of one layer's K or V cache [pages, page_size,
    kv_heads, head_dim], in the cache's dtype. An fp8 cache takes x with scale 1, saturated at
    +-448 then rounded to nearest even: the bytes the Triton kernel `rope_and_store_kv` writes.
    (torch has no CPU `index_copy_` for float8; the bytes are copied as uint8.)"""
    rows = cache.view(-1, *cache.shape[2:])
    if cache.dtype == FP8:
        x8 = x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
        rows.view(torch.uint8).index_copy_(0, slots, x8.view(torch.uint8))
    else:
        rows.index_copy_(0, slots, x.to(cache.dtype))
