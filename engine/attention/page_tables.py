"""Page tables that stay on the device between steps.

Rebuilding every sequence's whole page table on the host each step, and copying it over, costs
O(sequences x pages): 256 sequences at ~1,400 tokens are ~22,000 entries a step, a nested list
that `torch.tensor` alone takes milliseconds to read. Here each sequence that ran keeps a row
of one device tensor for as long as its KV table lives, and a step sends only what changed:

    rows:   [ 0: zeros (padding) | 1: seq a's pages ... | 2: seq b's pages ... | ... ]
            int32 [rows, max_pages_per_seq], on the device
    step:   new entries (a decoding sequence gains one page per page_size tokens), entries the
            KV manager replaced in place (`TableChanges.rewritten`), a new row's whole table;
            then the batch's rows are gathered into the kernels' [batch, width] table on the
            device (TritonAttentionBackend.plan)

A row is given back when the KV manager frees its table (`TableChanges.dropped`). A batch without
a history (`table_changes` None: one built outside the engine core) makes every row be taken
afresh, so any ForwardBatch plans correctly.
"""

from __future__ import annotations

import torch

from kvcache.forward import ForwardBatch

PAD_ROW = 0  # all zeros: padding rows of a CUDA graph read page 0 and store nothing


class DevicePageTables:
    """Args: num_rows (sequences that may hold a row at once; when a batch needs more, rows of
    sequences outside it are taken back and rewritten when they run again), max_pages (a
    row's length), device."""

    def __init__(self, num_rows: int, max_pages: int, device: torch.device | str):
        self.max_pages = max_pages
        self.table = torch.zeros(num_rows + 1, max_pages, dtype=torch.int32, device=device)
        self._row: dict[str, int] = {}  # seq id -> its row
        self._synced = [0] * (num_rows + 1)  # leading entries of each row that are current
        self._free = list(range(num_rows, PAD_ROW, -1))

    def __len__(self) -> int:
        """Rows held by sequences."""
        return len(self._row)

    def sync(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int]]:
        """The batch's rows (one per sequence, in order), and the flat indices into `table`
        and the page ids that `write` must store before the rows are read."""
        changes = batch.table_changes
        if changes is None or changes.reset:
            self._forget(list(self._row))
        else:
            for seq_id in changes.dropped:
                self._release(seq_id)
            for seq_id, first in changes.rewritten.items():
                r = self._row.get(seq_id)
                if r is not None and self._synced[r] > first:
                    self._synced[r] = first
        ps, width = batch.page_size, self.max_pages
        rows, index, pages = [], [], []
        for s in batch.seqs:
            r = self._row.get(s.seq_id)
            if r is None:
                r = self._assign(s.seq_id, batch)
            need = -(-s.kv_len // ps)
            done = self._synced[r]
            if done < need:
                if need > width:
                    raise ValueError(f"{s.seq_id}: {need} pages exceed the {width} a row holds")
                base = r * width
                index.extend(range(base + done, base + need))
                pages.extend(s.page_table[done:need])
                self._synced[r] = need
            rows.append(r)
        return rows, index, pages

    def write(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """Store `pages` at flat `index` (device tensors, from `sync`'s lists)."""
        self.table.view(-1).index_copy_(0, index, pages.to(torch.int32))

    def _assign(self, seq_id: str, batch: ForwardBatch) -> int:
        if not self._free:  # take back the rows of sequences that are not in this batch
            keep = {s.seq_id for s in batch.seqs}
            self._forget([i for i in self._row if i not in keep])
            if not self._free:
                raise ValueError(f"a batch of {len(batch.seqs)} sequences needs more than the "
                                 f"{len(self._synced) - 1} page table rows")
        r = self._free.pop()
        self._row[seq_id] = r
        self._synced[r] = 0
        return r

    def _release(self, seq_id: str) -> None:
        r = self._row.pop(seq_id, None)
        if r is not None:
            self._free.append(r)

    def _forget(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)
