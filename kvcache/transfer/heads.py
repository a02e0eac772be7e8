"""Which KV heads go where between engines whose pools split the model's KV heads differently
over their tensor-parallel ranks (`KVLayout.rank_heads`): the plan a copy follows, head range by
head range (kvcache/transfer/tp_peer.py for shm and cuda_ipc, tcp.py for tcp)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from microserve.messages import KVLayout


@dataclass(frozen=True)
class HeadRun:
    """Heads `src_heads` of the sender's rank `src_rank`'s pool go to heads `dst_heads` of
    the receiver's rank `dst_rank`'s (positions in each pool, as many on each side)."""

    src_rank: int
    src_heads: range
    dst_rank: int
    dst_heads: range


def whole_layout(layout: KVLayout) -> KVLayout:
    """`layout` unsplit: one pool with every KV head of the model, in order (tcp's frames)."""
    heads = layout.model_kv_heads
    return replace(layout, tensor_parallel_size=1, num_kv_heads=heads, total_kv_heads=heads)


def head_plan(src: KVLayout, dst: KVLayout) -> list[HeadRun]:
    """Every head of every receiver rank, from the first sender rank that holds it, with runs
    of consecutive heads between the same two ranks merged."""
    owner: dict[int, tuple[int, int]] = {}  # model head -> (sender rank, position there)
    for rank in range(src.tensor_parallel_size):
        for i, head in enumerate(src.rank_heads(rank)):
            owner.setdefault(head, (rank, i))
    runs: list[HeadRun] = []
    for rank in range(dst.tensor_parallel_size):
        for j, head in enumerate(dst.rank_heads(rank)):
            s, i = owner[head]
            last = runs[-1] if runs else None
            if (last is not None and (last.src_rank, last.dst_rank) == (s, rank)
                    and last.src_heads.stop == i and last.dst_heads.stop == j):
                runs[-1] = HeadRun(s, range(last.src_heads.start, i + 1), rank,
                                   range(last.dst_heads.start, j + 1))
            else:
                runs.append(HeadRun(s, range(i, i + 1), rank, range(j, j + 1)))
    return runs


def heads_view(x: torch.Tensor, heads: range) -> torch.Tensor:
    """One layer [2, pages, page_size, heads, dim] as [2, slots, len(heads), dim] (a view)."""
    return x.flatten(1, 2)[:, :, heads.start:heads.stop]
