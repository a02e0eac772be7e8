"""Exact scheduling decisions: token budget, chunked prefill, decode first, admission only when
pages exist, preemption by recompute, prefix reuse. No model: a step is simulated by
`Scheduler.advance` and appending token 0 where the scheduler asked for a sample."""

from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from kvcache.manager import KVCacheManager
from microserve.messages import SamplingParams

PS = 4


def seq(rid, n_prompt, arrival, start=0, max_tokens=100):
    return Sequence(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens), arrival)


def run_step(sched: Scheduler):
    out = sched.schedule()
    computed = [e.seq.num_computed_tokens for e in out.scheduled]
    sched.advance(out)
    for e, before in zip(out.scheduled, computed):
        if e.sample:
            e.seq.output_token_ids.append(0)
        if e.seq.num_computed_tokens // PS > before // PS:
            sched.kv.cache_tokens(e.seq.request_id, e.seq.token_at(0, e.seq.num_computed_tokens))
    return [(e.seq.request_id, e.num_new_tokens, e.sample) for e in out.scheduled], out


def test_chunked_prefill_under_budget_then_decode_first():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    s.add(seq("a", 10, 0))
    s.add(seq("b", 3, 1, start=100))
    assert run_step(s)[0] == [("a", 8, False)]  # a's first chunk fills the budget
    assert run_step(s)[0] == [("a", 2, True), ("b", 3, True)]  # rest of a, then b
    assert run_step(s)[0] == [("a", 1, True), ("b", 1, True)]  # both decode
    kv.check_integrity()


def test_decodes_go_before_a_long_prefill_chunk():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=6, max_num_seqs=8)
    s.add(seq("a", 2, 0))
    run_step(s)  # a prefilled, now decoding
    s.add(seq("b", 20, 1, start=100))
    assert run_step(s)[0] == [("a", 1, True), ("b", 5, False)]
    assert run_step(s)[0] == [("a", 1, True), ("b", 5, False)]


def test_a_step_with_no_decoding_row_takes_the_prefill_step_budget():
    """Prompt chunks alone take up to max_prefill_step_tokens; once a sequence decodes, a
    step is back to max_num_batched_tokens (its decode first), and a step after the last
    decode ends takes the larger budget again."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=6, max_num_seqs=8, max_prefill_step_tokens=16)
    s.add(seq("a", 10, 0, max_tokens=2))
    s.add(seq("b", 12, 1, start=100))
    steps, out = run_step(s)
    assert steps == [("a", 10, True), ("b", 6, False)] and out.prompt_only  # 16: nothing decodes
    steps, out = run_step(s)
    assert steps == [("a", 1, True), ("b", 5, False)] and not out.prompt_only  # a decodes: 6
    s.remove(s.running[0])  # a reached max_tokens
    assert run_step(s)[0] == [("b", 1, True)]  # the rest of b's prompt
    s.add(seq("c", 30, 2, start=200))
    assert run_step(s)[0] == [("b", 1, True), ("c", 5, False)]
    s.remove(s.running[0])
    assert run_step(s)[0] == [("c", 16, False)]  # prompt-only again: 16
    assert run_step(s)[0] == [("c", 9, True)]
    kv.check_integrity()


def test_the_prefill_step_budget_is_never_below_the_step_budget():
    import pytest

    kv = KVCacheManager(num_pages=8, page_size=PS)
    with pytest.raises(ValueError, match=r"max_prefill_step_tokens \(4\) must be >= "
                                         r"max_num_batched_tokens \(6\)"):
        Scheduler(kv, max_num_batched_tokens=6, max_num_seqs=8, max_prefill_step_tokens=4)
    assert Scheduler(kv, 6, 8).max_prefill_step_tokens == 6  # None: the step budget


def test_admission_waits_for_pages_and_respects_fcfs():
    kv = KVCacheManager(num_pages=4, page_size=PS)  # 16 slots
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add(seq("a", 12, 0))  # 3 pages
    s.add(seq("b", 8, 1, start=100))  # 2 pages: does not fit next to a
    s.add(seq("c", 2, 2, start=200))  # would fit, but must not overtake b
    assert run_step(s)[0] == [("a", 12, True)]
    assert [x.request_id for x in s.waiting] == ["b", "c"]
    assert not kv.has("b") and not kv.has("c")  # a refused admission holds nothing
    kv.check_integrity()


def test_preemption_frees_the_newest_and_recomputes_it_later():
    kv = KVCacheManager(num_pages=4, page_size=PS, enable_prefix_cache=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add(seq("a", 8, 0))
    s.add(seq("b", 8, 1, start=100))
    assert run_step(s)[0] == [("a", 8, True), ("b", 8, True)]  # all 4 pages used
    # Both need a new page for their 9th token: b (newest) is preempted, a continues.
    steps, out = run_step(s)
    assert steps == [("a", 1, True)]
    assert [x.request_id for x in out.preempted] == ["b"]
    b = s.waiting[0]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0 and not kv.has("b")
    assert b.output_token_ids == [0]  # its output so far is kept and recomputed later
    s.remove(s.running[0])  # a finishes
    assert run_step(s)[0] == [("b", 9, True)]  # prompt + its one output token
    kv.check_integrity()


def test_a_sequence_that_alone_lacks_pages_preempts_itself():
    kv = KVCacheManager(num_pages=2, page_size=PS, enable_prefix_cache=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add(seq("a", 8, 0))
    run_step(s)
    steps, out = run_step(s)  # needs a third page; there is none
    assert steps == [] and [x.request_id for x in out.preempted] == ["a"]
    kv.check_integrity()


def test_new_request_reuses_cached_prefix_but_recomputes_last_token():
    kv = KVCacheManager(num_pages=16, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add(seq("a", 8, 0))
    run_step(s)
    s.remove(s.running[0])
    s.add(seq("b", 8, 1))  # same 8 tokens: page 0 reused, page 1 would hold the last token
    steps, _ = run_step(s)
    assert steps == [("b", 4, True)]
    b = s.running[0]
    assert b.num_cached_tokens == 4 and kv.page_table("b")[0] == 0
    # b's second page was cached as soon as its prefill filled it, while b still runs.
    s.add(seq("c", 13, 2))
    steps, _ = run_step(s)
    assert ("c", 5, True) in steps and s.running[1].num_cached_tokens == 8
    assert kv.page_table("c")[:2] == kv.page_table("b")[:2]
    kv.check_integrity()


def test_max_num_seqs_limits_admission():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 2, i, start=10 * i))
    assert [r for r, _, _ in run_step(s)[0]] == ["r0", "r1"]
    assert [x.request_id for x in s.waiting] == ["r2"]


def test_a_sequence_holding_received_kv_overtakes_a_head_that_needs_its_pages():
    """D holds KV received for "recv" (8 tokens, 2 pages); the head of the queue ("big", a
    preempted or plain request) needs 4 pages and only 2 are free. FCFS for computed KV would
    wait for ever: "recv" only needs room for its last token, runs, finishes, frees its pages."""
    kv = KVCacheManager(num_pages=4, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    s.add(seq("big", 13, 0))
    kv.open("recv", [])
    assert kv.allocate("recv", 7)  # the received prompt[:7], as adopt_for_generate leaves it
    recv = Sequence("recv", list(range(100, 108)), SamplingParams(1), 1, num_computed_tokens=7)
    s.add(recv)
    s.add(seq("small", 2, 2, start=200))  # needs computing: does not overtake "big"
    assert s.pages_owed() == 4  # what receives must leave "big"
    assert run_step(s)[0] == [("recv", 1, True)]
    assert [x.request_id for x in s.waiting] == ["big", "small"]
    s.remove(recv)
    assert run_step(s)[0] == [("big", 13, True)]
    kv.check_integrity()


def test_the_n_choices_of_a_prompt_prefill_it_once_and_let_others_by():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    for i in range(3):  # one request's 3 choices: the same 22-token prompt
        s.add(seq(f"c{i}", 22, i))
    s.add(seq("short", 2, 3, start=100))
    # c1 and c2 wait for c0's prompt without holding up the short request behind them.
    assert run_step(s)[0] == [("c0", 8, False)]
    assert run_step(s)[0] == [("c0", 8, False)]
    assert run_step(s)[0] == [("c0", 6, True), ("short", 2, True)]
    assert [x.request_id for x in s.waiting] == ["c1", "c2"] and not kv.has("c1")
    # c0's 5 whole pages a twin reuses (all but the last token's) are cached: the twins
    # compute the last 2 tokens only, on c0's pages.
    assert run_step(s)[0] == [("c0", 1, True), ("short", 1, True), ("c1", 2, True),
                              ("c2", 2, True)]
    assert [x.num_cached_tokens for x in s.running[2:]] == [20, 20]
    assert kv.page_table("c1")[:5] == kv.page_table("c2")[:5] == kv.page_table("c0")[:5]
    kv.check_integrity()


def test_a_prompt_in_one_step_is_still_computed_once():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(3):  # would all fit in the first step's budget
        s.add(seq(f"c{i}", 10, i))
    assert run_step(s)[0] == [("c0", 10, True)]
    assert run_step(s)[0] == [("c0", 1, True), ("c1", 2, True), ("c2", 2, True)]
    kv.check_integrity()


def test_without_a_prefix_cache_no_choice_waits_for_another():
    kv = KVCacheManager(num_pages=64, page_size=PS, enable_prefix_cache=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(2):
        s.add(seq(f"c{i}", 10, i))
    assert run_step(s)[0] == [("c0", 10, True), ("c1", 10, True)]
    kv.check_integrity()


# ---- shared heads: a prefix another running sequence is computing is computed once ----------


def test_a_shared_head_is_computed_once_and_the_tails_go_on_from_it():
    """Two few-shot lines over one 12-token template (3 pages), then a question each. q1
    would fit in q0's step; it waits while q0 computes the template (not holding up the
    unrelated request behind it), then reuses q0's three pages and computes its 4 tokens."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    template = list(range(1000, 1012))
    s.add(Sequence("q0", template + [1, 2, 3, 4], SamplingParams(5), 0))
    s.add(Sequence("q1", template + [5, 6, 7, 8], SamplingParams(5), 1))
    s.add(seq("other", 3, 2, start=500))
    assert run_step(s)[0] == [("q0", 16, True), ("other", 3, True)]
    assert [x.request_id for x in s.waiting] == ["q1"] and not kv.has("q1")
    assert run_step(s)[0] == [("q0", 1, True), ("other", 1, True), ("q1", 4, True)]
    q1 = s.running[2]
    assert q1.num_cached_tokens == 12
    assert kv.page_table("q1")[:3] == kv.page_table("q0")[:3]
    assert kv.page_table("q1")[3] != kv.page_table("q0")[3]
    kv.check_integrity()


def test_a_later_turn_waits_for_the_turn_before_it():
    """Turn 2's prompt is turn 1's and 6 more tokens: admitted in the same step it would
    compute turn 1's 10 tokens again; it waits, then computes 8 (from turn 1's 2 whole pages)."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    turn1 = list(range(300, 310))
    s.add(Sequence("t1", turn1, SamplingParams(3), 0))
    s.add(Sequence("t2", turn1 + list(range(900, 906)), SamplingParams(3), 1))
    assert run_step(s)[0] == [("t1", 10, True)]
    assert run_step(s)[0] == [("t1", 1, True), ("t2", 8, True)]
    assert s.running[1].num_cached_tokens == 8
    kv.check_integrity()


def test_no_wait_for_less_than_a_page_another_adapter_or_background_work():
    """A shared head shorter than a page saves nothing; KV of another adapter is not shared;
    a live request never waits for a batch line (it may move a few tokens a step)."""
    class Slots:  # every adapter always has a slot
        def acquire(self, seq):
            return True

        def release(self, seq):
            pass

    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, adapters=Slots())
    s.add(Sequence("a", [1, 2, 3, 10, 11, 12, 13, 14], SamplingParams(2), 0))
    s.add(Sequence("b", [1, 2, 3, 20, 21, 22, 23, 24], SamplingParams(2), 1))  # 3 shared
    head = list(range(40, 52))
    s.add(Sequence("base", head + [1], SamplingParams(2), 2))
    s.add(Sequence("lora", head + [2], SamplingParams(2), 3, lora_id=1))
    assert [r for r, _, _ in run_step(s)[0]] == ["a", "b", "base", "lora"]
    kv.check_integrity()

    from engine.background import Background
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8,
                  background=Background(100, max_seqs=4, max_tokens=64))
    s.add(Sequence("batch", head + [7, 7, 7, 7], SamplingParams(2), 0, priority=100))
    s.add(Sequence("live", head + [8, 8], SamplingParams(2), 1))
    assert run_step(s)[0] == [("batch", 16, True), ("live", 14, True)]
    kv.check_integrity()

    # and a batch line does wait for a live request computing its head
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8,
                  background=Background(100, max_seqs=4, max_tokens=64))
    s.add(Sequence("live2", list(range(60, 80)), SamplingParams(2), 0))
    s.add(Sequence("batch2", list(range(60, 72)) + [5], SamplingParams(2), 1, priority=100))
    assert run_step(s)[0] == [("live2", 20, True)]
    assert run_step(s)[0] == [("live2", 1, True), ("batch2", 1, True)]
    assert s.running[1].num_cached_tokens == 12
    kv.check_integrity()


def test_a_prefill_engines_sends_run_first_come_first_served():
    """P of balanced P/D: each remote_send's head (here 10 tokens, a budget of 8) runs in the
    order the calls came, each finished before the next one starts; none is spread over more
    steps than its own tokens need."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    for i in range(3):
        q = seq(f"p{i}", 10, i, start=100 * i, max_tokens=1)
        q.send_only = q.send_samples = True
        s.add(q)
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append([(e.seq.request_id, e.num_new_tokens) for e in out.scheduled])
        for done in s.advance(out):
            s.remove(done)
    assert steps == [[("p0", 8)], [("p0", 2), ("p1", 6)], [("p1", 4), ("p2", 4)], [("p2", 6)]]
    kv.check_integrity()
