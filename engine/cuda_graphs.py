"""CUDA graphs for decode steps: the one place that owns them.

A decode step launches a few hundred small kernels; replayed as one CUDA graph, the host cost is
a handful of copies and one launch. Graphs are captured once per batch-size bucket, largest
first so smaller ones reuse its memory pool. A step with B decoding sequences replays the
smallest bucket >= B; the padding rows attend one key and store nothing
(`TritonAttentionBackend.plan_graph`). Steps that prefill, or exceed the largest bucket, run
eagerly.

    static inputs   input_ids[:bucket]  positions[:bucket]   (+ the backend's metadata buffers)
    static output   hidden[:bucket]
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

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
           448, 512)


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
        pool = None
        stream = torch.cuda.Stream(self.backend.device)
        for bucket in reversed(self.buckets):
            self.backend.plan_graph(None, bucket)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and settle allocations first
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
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
