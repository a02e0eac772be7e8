"""The KV tensor and the two-stage forward interface over it (paper Table 2).

One allocation holds every layer's K and V pages:

    kv[layer, 0 (K) | 1 (V), page, slot in page, kv_head, head_dim]

One allocation is what CUDA IPC and NVSHMEM export need (docs/microserving.md, "KV transfer").
Attention itself is an `AttentionBackend` (torch reference on CPU, Triton on GPU) behind one
interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from kvcache.forward import ForwardBatch, KVSend
from kvcache.manager import PageCopy

if TYPE_CHECKING:
    from kvcache.transfer.sender import KVSender


class AttentionBackend(ABC):
    """Appends a step's K/V to the paged cache and computes attention.

    `plan` is called once per step before any layer runs and may build device tensors from the
    batch (slot mapping, page tables); `forward` is called once per layer with that plan active.
    """

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-step metadata for all layers. Must not read or write the KV tensor."""

    @abstractmethod
    def forward(
        self,
        kv_layer: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] by `positions` (RoPE
        with the fp32 `cos_sin` table), write k, v into their slots of `kv_layer`
        [2, pages, page_size, kv_heads, head_dim], then return causal attention of q over each
        sequence's whole KV, as [T, heads, head_dim]. May modify q, k in place."""


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: AttentionBackend,
        pool: torch.Tensor | None = None,
    ):
        """`pool`: an allocated KV tensor of the shape below to use instead of a fresh one
        (a transfer backend's shared or exported memory)."""
        self.page_size = page_size
        self.backend = backend
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        if pool is None:
            pool = torch.zeros(shape, dtype=dtype, device=device)
        assert pool.shape == shape and pool.dtype == dtype, (pool.shape, shape, pool.dtype)
        self.kv = pool
        self.sender: KVSender | None = None  # set by the owner when this engine sends KV
        # A tensor-parallel engine's rank 0 hands a step's KV over once the step is over: only
        # then are the other ranks' pools written too (kvcache/transfer/tp_peer.py).
        self.send_after_step = False
        self._batch: ForwardBatch | None = None
        self._marked: list[KVSend] = []  # declared by mark_send for the next step
        self._sends: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # the open step's

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem

    def mark_send(self, sends: list[KVSend]) -> None:
        """Declare that the next step's attention sends these slots to peers (paper Table 2).
        Each layer's share is handed to `sender` right after the layer appends its KV, so the
        transfer of layer L runs while layers L+1.. compute (a GPU peer takes the whole step
        after its last layer, and copies it while the next step computes: `Peer.whole_steps`)."""
        assert self._batch is None, "mark_send must come before begin_forward"
        assert self.sender is not None or not sends, "mark_send without a sender"
        self._marked.extend(sends)

    @property
    def has_marked_sends(self) -> bool:
        return bool(self._marked)

    def begin_forward(self, batch: ForwardBatch) -> None:
        assert self._batch is None, "begin_forward while a step is open"
        self._batch = batch
        self.backend.plan(batch)
        dev = self.kv.device
        self._sends = [(s.job_id, _upload(s.src_slots, dev), _upload(s.dst_slots, dev))
                       for s in self._marked]
        for s, (job_id, _, dst) in zip(self._marked, self._sends):
            self.sender.check_destinations(job_id, s.dst_slots, dst)
        self._marked = []

    def begin_forward_static(self) -> None:
        """Open a step whose metadata the backend already holds (a CUDA graph capture)."""
        assert self._batch is None, "begin_forward while a step is open"
        self._batch = ForwardBatch([], self.page_size)

    def attention(self, layer: int, q, k, v, positions, cos_sin, qkv_delta=None):
        out = self.backend.forward(self.kv[layer], q, k, v, positions, cos_sin, qkv_delta)
        self._layer_written(layer)
        return out

    def attend_stored(self, layer: int, q: torch.Tensor, out: torch.Tensor, k=None,
                      v=None) -> torch.Tensor:
        """The second half of `attention` when the first (RoPE and the KV write, the
        backend's `store`) ran inside a CUDA graph piece: attend into `out`, then hand the
        layer's KV to the sends (engine/cuda_graphs.py, PiecewiseGraphs). k, v: the step's
        rotated K/V rows, for a backend that may attend them directly."""
        self.backend.attend(self.kv[layer], q, out, k, v)
        self._layer_written(layer)
        return out

    def _layer_written(self, layer: int) -> None:
        if self.send_after_step:
            return
        for job_id, src, dst in self._sends:  # this layer's KV is in the pool now
            self.sender.layer_written(job_id, layer, src, dst)

    def end_forward(self) -> None:
        """Close the step. A tensor-parallel rank 0 hands its sends over here, after the last
        layer's all-reduce, which no rank passes before every rank wrote its KV (an exception
        in the step ends the engine; the copy of its pages is then moot)."""
        assert self._batch is not None, "end_forward without begin_forward"
        if self.send_after_step:
            for job_id, src, dst in self._sends:
                self.sender.write_all_layers(job_id, src, dst)
        self._batch = None
        self._sends = []

    def copy_pages(self, copies: list[PageCopy]) -> None:
        """Execute fork copies (partial pages) for all layers before the next forward."""
        for c in copies:
            self.kv[:, :, c.dst, : c.num_tokens] = self.kv[:, :, c.src, : c.num_tokens]


def _upload(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`slots` on `device` without making the host wait: a copy from pageable memory would
    block until the GPU finished the step before (engine/device.py says more)."""
    if device.type != "cuda":
        return slots.to(device)
    return slots.pin_memory().to(device, non_blocking=True)
