"""Page tables kept on the device between steps (engine/attention/page_tables.py): after any
sequence of steps, the rows a batch reads hold exactly its sequences' page ids, while a step
writes only what changed. Driven by the real KVCacheManager and its change journal."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine.attention.page_tables import PAD_ROW, DevicePageTables  # noqa: E402
from kvcache.forward import ForwardBatch, SeqForward  # noqa: E402
from kvcache.manager import KVCacheManager, TableChanges  # noqa: E402

PS = 4


class Mirror:
    """A KV manager, device tables over it, and what the last step wrote."""

    def __init__(self, num_rows: int = 8, max_pages: int = 16, num_pages: int = 64):
        self.kv = KVCacheManager(num_pages, PS)
        self.tables = DevicePageTables(num_rows, max_pages, "cpu")
        self.written = 0

    def step(self, lens: dict[str, int], history: bool = True) -> list[int]:
        """Plan a batch of the given sequences with kv_len = lens[seq]; check every row read
        and return the rows."""
        seqs = [SeqForward(s, n - 1, 1, self.kv.page_table(s)) for s, n in lens.items()]
        changes = self.kv.take_table_changes() if history else None
        batch = ForwardBatch(seqs, PS, changes)
        rows, index, pages = self.tables.sync(batch)
        self.written = len(index)
        if index:
            self.tables.write(torch.tensor(index), torch.tensor(pages))
        for seq, r in zip(seqs, rows):
            n = -(-seq.kv_len // PS)
            assert self.tables.table[r, :n].tolist() == self.kv.page_table(seq.seq_id)[:n]
        assert len(set(rows)) == len(rows) and PAD_ROW not in rows
        return rows


def test_a_step_writes_only_new_pages_and_rows_stay():
    m = Mirror()
    m.kv.open("a", [])
    m.kv.open("b", [])
    m.kv.allocate("a", 9)  # pages 0-2
    m.kv.allocate("b", 5)  # pages 3-4
    rows = m.step({"a": 9, "b": 5})
    assert m.written == 5
    assert m.step({"a": 10, "b": 6}) == rows and m.written == 0  # same pages: nothing sent
    m.kv.allocate("a", 13)  # a's 4th page
    assert m.step({"a": 13, "b": 7}) == rows and m.written == 1
    assert m.tables.table[rows[0], :4].tolist() == [0, 1, 2, 5]


def test_freed_tables_give_their_rows_back_and_a_reused_id_is_written_afresh():
    m = Mirror(num_rows=2)
    for s in "ab":
        m.kv.open(s, [])
        m.kv.allocate(s, 8)
    ra, rb = m.step({"a": 8, "b": 8})
    m.kv.free("a")  # preempted: its pages go back, its row too
    m.kv.open("c", [])
    m.kv.allocate("c", 8)
    (rc,) = m.step({"c": 8})
    assert rc == ra and m.written == 2
    m.kv.open("a", [])  # the preempted sequence again, with new pages
    m.kv.allocate("a", 4)
    m.kv.free("c")
    m.step({"a": 4, "b": 8})
    assert m.written == 1 and len(m.tables) == 2


def test_pages_replaced_in_place_are_rewritten():
    """Two sequences compute the same prefix; the second to cache it switches to the first's
    pages (KVCacheManager.cache_tokens), and truncation drops pages that later regrow."""
    m = Mirror()
    prompt = list(range(12))
    for s in "ab":
        m.kv.open(s, prompt[:-1])
        m.kv.allocate(s, 12)
    m.step({"a": 12, "b": 12})
    m.kv.cache_tokens("a", prompt)
    m.kv.cache_tokens("b", prompt)  # b now holds a's pages 0-2; its own 3-5 are freed
    assert m.kv.page_table("b") == [0, 1, 2]
    m.step({"a": 12, "b": 12})
    assert m.written == 3
    m.kv.truncate("b", 1)
    m.kv.allocate("b", 12)  # regrows onto other pages
    m.step({"a": 12, "b": 12})
    assert m.written == 2


def test_a_batch_without_history_is_taken_afresh_and_rows_run_short_gracefully():
    m = Mirror(num_rows=2)
    for s in "abc":
        m.kv.open(s, [])
        m.kv.allocate(s, 8)
    m.step({"a": 8, "b": 8})
    m.step({"a": 8, "b": 8}, history=False)
    assert m.written == 4  # forgot everything
    m.step({"c": 8})  # no free row: the rows of a and b (not in the batch) are taken back
    assert len(m.tables) == 1
    with pytest.raises(ValueError, match="needs more than the 2 page table rows"):
        m.step({"a": 8, "b": 8, "c": 8})


def test_too_many_untaken_drops_become_a_reset():
    kv = KVCacheManager(8, PS)
    for i in range(TableChanges.MAX_DROPPED + 1):
        kv.open(f"r{i}", [])
        kv.free(f"r{i}")
    changes = kv.take_table_changes()
    assert changes.reset and not changes.dropped
    assert kv.take_table_changes() == TableChanges()
