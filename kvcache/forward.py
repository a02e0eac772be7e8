"""What one forward step does to the KV cache, as plain data (no torch).

The scheduler builds a ForwardBatch once per step; `PagedKVCache.begin_forward` hands it to the
attention backend, which turns it into device metadata once for all layers (paper Table 2:
declaration stage). Layer by layer, `attention(layer, q, k, v)` then appends and attends
(computation stage).

Tokens of a step are packed, sequence after sequence, with no padding:

    packed tokens:  | seq A: 5 new (prefill chunk) | seq B: 1 new | seq C: 1 new |
    seq A KV:       [ 0 .......... context_len | new new new new new ]
                                                 ^ positions context_len .. context_len+4
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache.manager import TableChanges

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SeqForward:
    seq_id: str
    context_len: int  # tokens whose KV is already in the cache before this step
    num_new_tokens: int  # tokens appended (and queried) this step, >= 1
    # pages covering at least context_len + num_new_tokens positions (entries past them are
    # not read; it may be the sequence's live table)
    page_table: list[int]

    @property
    def kv_len(self) -> int:
        return self.context_len + self.num_new_tokens


@dataclass(frozen=True)
class KVSend:
    """A transfer declared for the next step (`PagedKVCache.mark_send`): once a layer has
    appended this step's KV, its K and V at local `src_slots` go to the receiver's `dst_slots`
    (flat slots, equal lengths) under transfer job `job_id`."""

    job_id: str
    src_slots: torch.Tensor  # int64, on the host
    dst_slots: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    seqs: list[SeqForward]
    page_size: int
    # Page tables changed in place or freed since the previous batch (KVCacheManager
    # .take_table_changes), for a backend that keeps tables on the device between steps.
    # None: no history; such a backend must take every table afresh.
    table_changes: TableChanges | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def positions(self) -> list[int]:
        out: list[int] = []
        for s in self.seqs:
            out.extend(range(s.context_len, s.kv_len))
        return out

    def slot_mapping(self) -> list[int]:
        """Flat slot (page * page_size + offset) of every new token, in packed order."""
        ps, out = self.page_size, []
        for s in self.seqs:
            table = s.page_table
            out.extend(table[i // ps] * ps + i % ps for i in range(s.context_len, s.kv_len))
        return out

    def kv_slots(self, s: SeqForward) -> list[int]:
        """Flat slots of all of `s`'s KV after this step's append, in position order."""
        ps, table = self.page_size, s.page_table
        return [table[i // ps] * ps + i % ps for i in range(s.kv_len)]
