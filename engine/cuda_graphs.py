"""CUDA graphs for the forward pass: the one place that owns them.

A step launches a few hundred small kernels, and launching them from Python costs more than
the GPU spends on a short step: on an H100 (2026-11-24) an eager step of Llama-3.1-8B took
~20 ms whatever its size up to a few hundred tokens (each Triton launch ~55 us of host time),
against ~6 ms of GPU work for 16 tokens. Two kinds of graphs take the launches off the host:

- `DecodeGraphs`: decode-only steps, the whole forward pass as one graph per batch-size
  bucket. A step with B decoding sequences replays the smallest bucket >= B; the padding
  rows attend one key and store nothing (`TritonAttentionBackend.plan_graph`).

      static inputs   input_ids[:bucket]  positions[:bucket]   (+ the backend's metadata)
      static output   hidden[:bucket]

- `MixedGraphs`: decodes beside one prompt chunk of at most 32 tokens (a batch job's room in a
  live step), also the whole pass as one graph per decode bucket, the chunk padded.

- `PiecewiseGraphs`: other steps with prompt tokens (prefill chunks, alone or beside decodes), up to
  `max_piecewise_tokens`. Attention's grid and tiles depend on how the step's tokens split
  into sequences, so it stays eager; everything between two attentions is one graph per
  token-count bucket (vLLM's piecewise graphs, cut by hand at the model's attention calls):

      piece 0        embeddings .. layer 0's q, k, v (RoPE + KV write included)
      attention 0    eager: the backend's decode and extend kernels
      piece 1        o_proj, norm, MLP of layer 0 .. layer 1's q, k, v
      ...
      piece L        layer L-1's o_proj, norm, MLP, the final norm -> hidden

  Padding rows (bucket - tokens) compute garbage that stays in their own rows and store
  nothing (slot -1); attention runs on the real rows only.

Each kind captures its buckets largest first, so the smaller ones reuse the memory pool. Steps
larger than every bucket run eagerly: at ~8,000 tokens their GPU time hides the launches, but
at the CUDA default step budget (2,048) it does not always. An fp8 8B step of 2,048 tokens beside
~200 decodes takes ~40 ms of GPU time, and its eager launches took 40-48 ms of host time on one
H100 host and less on another (2026-11-25, docs/benchmarks.md), hence buckets up to 2,048.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.triton_backend import TritonAttentionBackend
from engine.device import to_device
from kvcache.forward import ForwardBatch
from kvcache.paged import PagedKVCache

log = logging.getLogger(__name__)

# Piecewise buckets up to 512 tokens; above it they come every `piecewise_bucket_step` tokens
# (piece_buckets). A step pads to its bucket, and above ~512 tokens every padded row costs GEMM
# time like a real one: with buckets 256 apart, 1,024 prompt tokens beside 19 decodes computed
# 1,280 rows (docs/benchmarks.md, "Piecewise buckets 64 tokens apart").
PIECE_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
           448, 512)


def piece_buckets(max_tokens: int, step: int) -> list[int]:
    """The token counts piecewise graphs are captured for: PIECE_BUCKETS, then every `step`
    tokens above 512, up to and including max_tokens."""
    small = [b for b in PIECE_BUCKETS if b < max_tokens]
    return small + list(range(PIECE_BUCKETS[-1] + step, max_tokens, step)) + [max_tokens]


class _Capturer:
    """Captures graphs one after another on a side stream, all in one memory pool (so a graph
    captured later reuses what an earlier, larger one allocated)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.pool = None

    def __call__(self, fn) -> tuple[torch.cuda.CUDAGraph, object]:
        """A graph of fn() and what the captured call returned (its static output)."""
        # The side stream must see what the caller queued before: the static buffers' zero
        # fill, the step metadata plan_graph uploads. Without this wait the warm-up could read
        # a buffer before its fill ran (an engine once failed to start on garbage token ids:
        # docs/benchmarks.md, "Seen once").
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # compile Triton kernels and settle allocations first
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        self.pool = graph.pool()
        return graph, out


class DecodeGraphs:
    def __init__(self, model, kv: PagedKVCache, backend: TritonAttentionBackend, max_batch: int):
        self.model, self.kv, self.backend = model, kv, backend
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [max_batch]
        if self.buckets[-1] < max_batch and max_batch <= BUCKETS[-1]:
            self.buckets.append(next(b for b in BUCKETS if b >= max_batch))
        n = self.buckets[-1]
        dev = backend.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        capture = _Capturer(self.backend.device)
        for bucket in reversed(self.buckets):
            self.backend.plan_graph(None, bucket)
            self.graphs[bucket], self.outputs[bucket] = capture(lambda: self._forward(bucket))
        torch.cuda.synchronize(self.backend.device)
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs),
                 self.buckets, time.monotonic() - start)  # fmt: skip

    def _forward(self, bucket: int) -> torch.Tensor:
        self.kv.begin_forward_static()
        try:
            return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv)
        finally:
            self.kv.end_forward()

    def can_run(self, batch: ForwardBatch) -> bool:
        return len(batch.seqs) <= self.max_batch and all(
            s.num_new_tokens == 1 for s in batch.seqs
        )

    def run(self, batch: ForwardBatch, input_ids: list[int], fill=None) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step. `fill` = (rows, device ids)
        overrides inputs whose value is still on the device (ModelRunner.execute)."""
        n = len(batch.seqs)
        bucket = next(b for b in self.buckets if b >= n)
        self.backend.plan_graph(batch, bucket)
        pad = bucket - n
        dev = self.backend.device
        self.input_ids[:bucket].copy_(to_device(input_ids + [0] * pad, torch.long, dev))
        self.positions[:bucket].copy_(to_device(batch.positions() + [0] * pad, torch.long, dev))
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]


# Prompt tokens a mixed graph holds beside its decodes: a step's background room
# (--background-max-tokens' default), and the last piece of a chunked prompt often fits too.
MIXED_CHUNK = 32


class MixedGraphs:
    """Steps of decodes beside one prompt chunk of at most `chunk` tokens (a batch job's room in
    a live step, a prompt's last few tokens), the whole forward pass as one graph per decode
    bucket, as `DecodeGraphs` does for decode-only steps. Without them such a step ran the
    piecewise graphs (attention eager between them) for a handful of prompt tokens.

        rows:  [ decodes | padding to the bucket | the chunk | padding to `chunk` ]

    The decode rows are padded as in a decode graph; the chunk's rows are padded to `chunk`,
    its kv_len grown by as much (TritonAttentionBackend.plan_mixed), so its real rows keep
    their positions and attend only to the keys before them, and the padding rows store
    nothing. `use_graphs` False runs the same padded pass eagerly (tests the layout without a
    GPU)."""

    def __init__(self, model, kv: PagedKVCache, backend: TritonAttentionBackend, max_batch: int,
                 chunk: int = MIXED_CHUNK, use_graphs: bool = True):
        self.model, self.kv, self.backend = model, kv, backend
        self.chunk, self.use_graphs = chunk, use_graphs
        rows, tokens = backend.page_table.shape[0], backend.slot_mapping.shape[0]
        self.buckets = [b for b in BUCKETS if b <= max_batch and b + 1 <= rows
                        and b + chunk <= tokens]
        n = (self.buckets[-1] if self.buckets else 0) + chunk
        dev = backend.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        capture = _Capturer(self.backend.device)
        for bucket in reversed(self.buckets):
            self.backend.plan_mixed(None, bucket, self.chunk)
            self.graphs[bucket], self.outputs[bucket] = capture(lambda: self._forward(bucket))
        torch.cuda.synchronize(self.backend.device)
        log.info("captured %d mixed graphs (batch %s beside a chunk of %d) in %.1f s",
                 len(self.graphs), self.buckets, self.chunk, time.monotonic() - start)

    def _forward(self, bucket: int) -> torch.Tensor:
        t = bucket + self.chunk
        self.kv.begin_forward_static()
        try:
            return self.model(self.input_ids[:t], self.positions[:t], self.kv)
        finally:
            self.kv.end_forward()

    def can_run(self, batch: ForwardBatch) -> bool:
        seqs = batch.seqs
        if not seqs or not self.buckets or len(seqs) - 1 > self.buckets[-1]:
            return False
        last = seqs[-1]
        if not 1 < last.num_new_tokens <= self.chunk:
            return False
        if any(s.num_new_tokens != 1 for s in seqs[:-1]):
            return False
        grown = last.kv_len + self.chunk - last.num_new_tokens  # its padded kv_len
        return -(-grown // batch.page_size) <= self.backend.max_pages_per_seq

    def run(self, batch: ForwardBatch, input_ids: list[int], fill=None) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's T packed tokens; `fill` as for
        DecodeGraphs.run (its input indices are the packed ones)."""
        nd = len(batch.seqs) - 1
        real = batch.seqs[-1].num_new_tokens
        bucket = next(b for b in self.buckets if b >= max(nd, 1))
        gap, tail = bucket - nd, self.chunk - real
        self.backend.plan_mixed(batch, bucket, self.chunk)
        dev, t = self.backend.device, bucket + self.chunk
        positions = batch.positions()
        self.input_ids[:t].copy_(to_device(
            input_ids[:nd] + [0] * gap + input_ids[nd:] + [0] * tail, torch.long, dev))
        self.positions[:t].copy_(to_device(
            positions[:nd] + [0] * gap + positions[nd:] + [0] * tail, torch.long, dev))
        if fill is not None:
            rows = fill[0]
            self.input_ids[torch.where(rows >= nd, rows + gap, rows)] = fill[1]
        if self.use_graphs:
            self.graphs[bucket].replay()
            out = self.outputs[bucket]
        else:
            out = self._forward(bucket)
        return torch.cat([out[:nd], out[bucket : bucket + real]])


class _StepBuffers:
    """The static tensors piecewise graphs read and write, sized for the largest bucket."""

    def __init__(self, config, tokens: int, dtype: torch.dtype, device: torch.device):
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.residual = torch.zeros(tokens, config.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(tokens, config.hidden_size, dtype=dtype, device=device)
        self.qkv = torch.zeros(tokens, q + 2 * kv, dtype=dtype, device=device)
        self.attn_out = torch.zeros(tokens, q, dtype=dtype, device=device)


class PiecewiseGraphs:
    """Args: model (a LlamaForCausalLM with the Triton kernels on), kv, backend, max_tokens
    (the largest step to run this way; buckets up to it), bucket_step (the buckets' spacing
    above 512 tokens: piece_buckets), use_graphs (False: run the pieces eagerly, which tests the
    cut without a GPU)."""

    def __init__(self, model, kv: PagedKVCache, backend: TritonAttentionBackend,
                 max_tokens: int, bucket_step: int = 64, use_graphs: bool = True):
        self.model, self.kv, self.backend = model, kv, backend
        self.buckets = piece_buckets(max_tokens, bucket_step)
        self.num_layers = model.config.num_layers
        weight = model.model.embed_tokens.weight
        self.bufs = _StepBuffers(model.config, max_tokens, weight.dtype, weight.device)
        self.cos_sin = model.model.rotary_emb.cos_sin
        self.use_graphs = use_graphs
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.near_end: torch.cuda.Event | None = None  # the last run's mark (run)
        c = model.config
        self._q_size, self._heads, self._head_dim = c.num_heads * c.head_dim, c.num_heads, c.head_dim

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.monotonic()
        self.backend.slot_mapping[: self.max_tokens].fill_(-1)  # capturing stores nothing
        capture = _Capturer(self.backend.device)
        for bucket in reversed(self.buckets):
            self.graphs[bucket] = [capture(lambda: self._piece(i, bucket))[0]
                                   for i in range(self.num_layers + 1)]  # fmt: skip
        torch.cuda.synchronize(self.backend.device)
        log.info("captured %d piecewise graphs (%d tokens and below, %d buckets) in %.1f s",
                 len(self.graphs) * (self.num_layers + 1), self.max_tokens, len(self.buckets),
                 time.monotonic() - start)  # fmt: skip

    def _piece(self, i: int, t: int) -> None:
        self.model.forward_piece(i, self.bufs, t, lambda layer, q, k, v: self.backend.store(
            self.kv.kv[layer], q, k, v, self.bufs.positions[:t], self.cos_sin, t))

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens <= self.max_tokens

    def run(self, batch: ForwardBatch, input_ids: list[int], fill=None,
            mark_layers_left: int = 0) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's T packed tokens (any mix of prefill chunks
        and decodes); `fill` as for DecodeGraphs.run. With `mark_layers_left` K > 0, a CUDA
        event is recorded when K layers are left to run (`near_end`; None without one)."""
        self.near_end = None
        mark = self.num_layers - mark_layers_left if mark_layers_left > 0 else -1
        n = len(input_ids)
        bucket = next(b for b in self.buckets if b >= n)
        pad, bufs, dev = bucket - n, self.bufs, self.backend.device
        self.kv.begin_forward(batch)
        try:
            if pad:
                self.backend.slot_mapping[n:bucket].fill_(-1)
            bufs.input_ids[:bucket].copy_(to_device(input_ids + [0] * pad, torch.long, dev))
            bufs.positions[:bucket].copy_(to_device(batch.positions() + [0] * pad, torch.long,
                                                    dev))  # fmt: skip
            if fill is not None:
                bufs.input_ids[fill[0]] = fill[1]
            q = bufs.qkv[:n, : self._q_size].view(n, self._heads, self._head_dim)
            kv_size = (bufs.qkv.shape[1] - self._q_size) // 2
            k, v = (bufs.qkv[:n, self._q_size + i * kv_size : self._q_size + (i + 1) * kv_size]
                    .view(n, -1, self._head_dim) for i in (0, 1))  # fmt: skip
            out = bufs.attn_out[:n].view(n, self._heads, self._head_dim)
            for i in range(self.num_layers + 1):
                if self.use_graphs:
                    self.graphs[bucket][i].replay()
                else:
                    self._piece(i, bucket)
                if i < self.num_layers:
                    self.kv.attend_stored(i, q, out, k, v)
                if i == mark and self.use_graphs:
                    self.near_end = torch.cuda.Event()
                    self.near_end.record()
        finally:
            self.kv.end_forward()
        return bufs.hidden[:n]
