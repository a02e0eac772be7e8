"""Attention on CUDA with the Triton kernels of engine/kernels.

Per step, `plan` writes the batch's metadata into device buffers allocated once at start-up
(sized for the largest step), so a CUDA graph captured over slices of them stays valid: a replay
only needs `plan_graph` to refill the same buffers. Page tables stay on the device between
steps (engine/attention/page_tables.py): a step copies over what changed, one host-to-device
copy for all its metadata.

    packed rows:  [ decode seqs: 1 token each | extend seqs: prefill chunks (and late 1-token) ]
                    paged_decode_attention      paged_extend_attention
                    (split-KV, GQA-grouped)     (causal over cached prefix + new tokens)

A step whose prompt rows are all whole prompts (no cached prefix) of at least
`dense_min_tokens` each, at most `DENSE_MAX_SEQS` of them, attends them with torch's fused SDPA
(cuDNN's kernel on Hopper) over the step's own contiguous K/V instead (`--prompt-attention`):
on an H200 it runs two prompts of 4,096 tokens 1.12x faster than our paged extend kernel and
one of 16,384 1.24x, but two of 1,024 0.80x and eight of 512 0.21x, one launch a prompt
(docs/benchmarks.md). Only over a cache of q's dtype, whose K/V are the step's K/V exactly:
an fp8 cache keeps the paged kernel, so a prompt attends to the same rounded keys its later
decodes read. Off by default (`paged`): cuDNN builds and caches a graph for each new shape,
which others report at hundreds of milliseconds, so a stream of prompts of ever new lengths
would pay it again and again; the figures above were taken at fixed lengths.
"""

from __future__ import annotations

import torch

from engine.attention.page_tables import PAD_ROW, DevicePageTables
from engine.device import to_device
from engine.kernels.fused import rope_and_store_kv
from engine.kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_extend_attention,
)
from kvcache.forward import ForwardBatch
from kvcache.paged import AttentionBackend

# More whole prompts than this in a step take the paged kernel: SDPA runs one launch a prompt.
DENSE_MAX_SEQS = 8
# `--prompt-attention auto`: SDPA for whole prompts of this many tokens and more (16-bit q)
DENSE_AUTO_MIN_TOKENS = 4096
# Outside fp16/bf16, SDPA falls back to the math kernel, which holds heads x n x n scores:
# whole prompts attend that way only while that stays this small.
_MATH_MAX_SCORES = 1 << 26


class TritonAttentionBackend(AttentionBackend):
    def __init__(
        self,
        device: torch.device | str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        max_seqs: int,
        max_pages_per_seq: int,
        page_size: int,
        dense_min_tokens: int | None = None,
    ):
        self.device = torch.device(device)
        self.dense_min_tokens = dense_min_tokens  # None: whole prompts take the paged kernel
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.max_pages_per_seq = max_pages_per_seq
        self.page_size = page_size
        cuda = self.device.type == "cuda"
        # (on CPU, only under TRITON_INTERPRET=1 in tests: any SM count will do)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if (
            cuda) else 132
        i32 = dict(dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=self.device)
        # The kernels' table, [batch row, page], gathered each step from the rows that stay
        # on the device between steps (engine/attention/page_tables.py).
        self.page_table = torch.zeros(max_seqs, max_pages_per_seq, **i32)
        self.tables = DevicePageTables(2 * max_seqs, max_pages_per_seq, self.device)
        self.kv_lens = torch.ones(max_seqs, **i32)
        self.cu_seqlens = torch.zeros(max_seqs + 1, **i32)
        # Split-KV workspace: splits shrink as the batch grows, so batch x splits stays small.
        rows = max(b * self._splits(b, max_pages_per_seq) for b in range(1, max_seqs + 1))
        self.workspace = torch.empty(rows * num_heads * (head_dim + 1), dtype=torch.float32,
                                     device=self.device)  # fmt: skip
        # per step, set by plan / plan_graph
        self.num_tokens = 0
        self.num_decode = 0  # leading sequences with one new token
        self.num_extend = 0
        self.max_q_len = 0
        self.num_splits = 1
        self.dense: list[tuple[int, int]] = []  # packed rows of whole prompts (attend)

    def _splits(self, batch: int, pages: int) -> int:
        return choose_num_splits(batch, pages * self.page_size, self.num_kv_heads, self.num_sms)

    # ---- planning -----------------------------------------------------------------------------

    def plan(self, batch: ForwardBatch) -> None:
        seqs, ps = batch.seqs, batch.page_size
        assert ps == self.page_size
        n_dec = 0
        while n_dec < len(seqs) and seqs[n_dec].num_new_tokens == 1:
            n_dec += 1
        ext = seqs[n_dec:]
        cu = [0]
        for s in ext:
            cu.append(cu[-1] + s.num_new_tokens)
        slots = batch.slot_mapping()
        # Decode rows first, then extend rows: the table rows follow the same order.
        self._upload(batch, 0, slots, cu if ext else [])
        self.num_tokens = len(slots)
        self.num_decode, self.num_extend = n_dec, len(ext)
        self.max_q_len = max((s.num_new_tokens for s in ext), default=0)
        max_pages = max((-(-s.kv_len // ps) for s in seqs[:n_dec]), default=1)
        self.num_splits = self._splits(n_dec, max_pages) if n_dec else 1
        self.dense = []
        least = self.dense_min_tokens
        if least is not None and 0 < len(ext) <= DENSE_MAX_SEQS and all(
                s.kv_len == s.num_new_tokens >= least for s in ext):
            self.dense = [(n_dec + a, n_dec + b) for a, b in zip(cu, cu[1:])]

    def plan_graph(self, batch: ForwardBatch | None, graph_batch: int) -> None:
        """Decode-only step padded to `graph_batch` rows for a captured graph. Padding rows
        attend one key of page 0 and store nothing (slot -1). With batch None, pads all rows
        (used while capturing)."""
        batch = batch or ForwardBatch([], self.page_size)
        pad = graph_batch - len(batch.seqs)
        self._upload(batch, pad, batch.slot_mapping() + [-1] * pad, [])
        self.num_tokens = self.num_decode = graph_batch
        self.num_extend, self.max_q_len = 0, 0
        self.dense = []
        self.num_splits = self._splits(graph_batch, self.max_pages_per_seq)

    def plan_mixed(self, batch: ForwardBatch | None, graph_batch: int, chunk: int) -> None:
        """A step of decodes and one prompt chunk of at most `chunk` tokens (its last
        sequence) for a captured mixed graph (engine/cuda_graphs.py, MixedGraphs): the decode
        rows padded to `graph_batch` as in `plan_graph`, then the chunk's rows padded to
        `chunk`. The chunk's kv_len grows by its padding, so that its real rows keep their
        positions (new token i sits at kv_len - q_len + i) and attend only to the keys before
        them; its padding rows store nothing and read past its end (page ids its table row
        holds). With batch None (capturing), the chunk is padding too."""
        batch = batch or ForwardBatch([], self.page_size)
        seqs = batch.seqs
        nd = max(len(seqs) - 1, 0)
        real = seqs[-1].num_new_tokens if seqs else 0
        slots = batch.slot_mapping()
        slots = slots[:nd] + [-1] * (graph_batch - nd) + slots[nd:] + [-1] * (chunk - real)
        self._upload(batch, graph_batch - nd, slots, [0, chunk], pad_at=nd,
                     grow_last=chunk - real if seqs else 0, chunk_row=0 if seqs else chunk)
        self.num_tokens = graph_batch + chunk
        self.num_decode, self.num_extend = graph_batch, 1
        self.max_q_len = chunk
        self.dense = []
        self.num_splits = self._splits(graph_batch, self.max_pages_per_seq)

    def _upload(self, batch: ForwardBatch, pad: int, slots: list[int], cu: list[int],
                pad_at: int | None = None, grow_last: int = 0, chunk_row: int = 0) -> None:
        """One host-to-device copy for the step: the page table entries that changed, the
        batch's table rows (then gathered on the device), kv_lens, cu_seqlens, slot_mapping.
        `pad` rows (a CUDA graph's) read the zero row with kv_len 1, after the batch's rows or
        before row `pad_at`; `grow_last` lengthens the last sequence's kv_len (a mixed graph's
        padded chunk); `chunk_row` > 0 adds a padding row of that kv_len (its chunk, when
        capturing)."""
        rows, index, pages = self.tables.sync(batch)
        lens = [s.kv_len for s in batch.seqs]
        if grow_last:
            lens[-1] += grow_last
        at = len(rows) if pad_at is None else pad_at
        rows[at:at] = [PAD_ROW] * pad
        lens[at:at] = [1] * pad
        if chunk_row:
            rows.append(PAD_ROW)
            lens.append(chunk_row)
        b, k, n_cu = len(rows), len(index), len(cu)
        packed = to_device(index + pages + rows + lens + cu + slots, torch.long, self.device)
        if k:
            self.tables.write(packed[:k], packed[k : 2 * k])
        at = 2 * k
        width = max(-(-max(lens, default=1) // self.page_size), 1)
        self.page_table[:b, :width] = self.tables.table[packed[at : at + b], :width]
        self.kv_lens[:b].copy_(packed[at + b : at + 2 * b])
        at += 2 * b
        if n_cu:
            self.cu_seqlens[:n_cu].copy_(packed[at : at + n_cu])
        self.slot_mapping[: len(slots)].copy_(packed[at + n_cu :])

    # ---- per layer -------------------------------------------------------------------------

    def forward(self, kv_layer, q, k, v, positions, cos_sin, qkv_delta=None):
        self.store(kv_layer, q, k, v, positions, cos_sin, self.num_tokens, qkv_delta)
        return self.attend(kv_layer, q, torch.empty_like(q), k, v)

    def store(self, kv_layer, q, k, v, positions, cos_sin, num_tokens: int,
              qkv_delta=None) -> None:
        """RoPE on q and k (in place) and k, v into the cache for the first `num_tokens` rows
        (past the step's tokens, slot -1: nothing stored). Reads only device buffers, so a
        CUDA graph may hold it (engine/cuda_graphs.py, PiecewiseGraphs). `qkv_delta` (one
        token with a LoRA adapter, the model's Attention): its expand goes in the same
        kernel."""
        slots = self.slot_mapping[:num_tokens]
        if qkv_delta is not None and q.shape[0] == 1:
            from engine.lora.kernels import qkv_delta_rope_and_store_kv

            qkv_delta_rope_and_store_kv(qkv_delta.part, qkv_delta.b, qkv_delta.slots, q, k, v,
                                        positions, cos_sin, kv_layer[0], kv_layer[1], slots)
            return
        if qkv_delta is not None:
            qkv_delta.add()
        rope_and_store_kv(q, k, v, positions, cos_sin, kv_layer[0], kv_layer[1], slots)

    def attend(self, kv_layer, q, out, k=None, v=None):
        """Attention of the step's q rows over the cache (their own K/V stored), into out.
        k, v: the step's rotated K/V rows, which whole prompts may attend directly (`plan`)."""
        k_cache, v_cache = kv_layer[0], kv_layer[1]
        t = self.num_tokens
        nd = self.num_decode
        if nd:
            ws = None
            if self.num_splits > 1:
                size = nd * self.num_heads * self.num_splits * (self.head_dim + 1)
                ws = self.workspace[:size].view(nd, self.num_heads, self.num_splits,
                                                self.head_dim + 1)  # fmt: skip
            paged_decode_attention(
                q[:nd], k_cache, v_cache, self.page_table[:nd], self.kv_lens[:nd], self.scale,
                out[:nd], ws, self.num_splits,
            )  # fmt: skip
        if self.dense and k is not None and self._dense_fits(q, k_cache):
            for a, b in self.dense:
                out[a:b] = _causal_sdpa(q[a:b], k[a:b], v[a:b], self.scale)
        elif self.num_extend:
            ne = self.num_extend
            paged_extend_attention(
                q[nd:t], k_cache, v_cache, self.page_table[nd : nd + ne],
                self.cu_seqlens[: ne + 1], self.kv_lens[nd : nd + ne], self.max_q_len,
                self.scale, out[nd:t],
            )  # fmt: skip
        return out

    def _dense_fits(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if k_cache.dtype != q.dtype:  # an fp8 cache: attend to the rounded keys, paged
            return False
        if q.dtype in (torch.float16, torch.bfloat16):
            return True
        return q.shape[1] * max(b - a for a, b in self.dense) ** 2 <= _MATH_MAX_SCORES


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one whole prompt over its own keys: q [n, heads, D], k and v
    [n, kv_heads, D] (views of the step's qkv rows) -> [n, heads, D]."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                           enable_gqa=True)  # fmt: skip
    return out[0].transpose(0, 1)
