"""Scheduling policies (engine/policies.py) in the scheduler, to the exact step: which sequences
run, whom a ranked policy preempts, MLFQ queue levels after joining, demotion and promotion,
and each policy's starvation bound on a fake clock. No model: a step is simulated as in
tests/test_scheduler.py, and a sequence finishes when it has max_tokens outputs."""

import pytest

from engine.background import Background
from engine.policies import (FCFS, PrefillProfile, Priority, SkipJoinMLFQ, make_policy)
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SeqStatus
from kvcache.manager import KVCacheManager
from microserve.messages import SamplingParams

PS = 4


class Clock:
    """A fake clock: each simulated step takes one second."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seq(rid, n_prompt, arrival, priority=0, max_tokens=100, start=None):
    start = arrival * 1000 if start is None else start  # distinct prompts: no prefix sharing
    return Sequence(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens),
                    arrival, priority)


def run_step(sched: Scheduler, clock: Clock | None = None):
    """One step: schedule, compute, sample token 0 where asked, finish at max_tokens, cache
    whole pages; then the clock moves one second. Returns [(id, tokens)] and the output."""
    out = sched.schedule()
    computed = [e.seq.num_computed_tokens for e in out.scheduled]
    sched.advance(out)
    for e, before in zip(out.scheduled, computed):
        s = e.seq
        if e.sample:
            s.output_token_ids.append(0)
        if s.num_computed_tokens // PS > before // PS:
            sched.kv.cache_tokens(s.request_id, s.token_at(0, s.num_computed_tokens))
        if len(s.output_token_ids) >= s.params.max_tokens:
            sched.remove(s)
    if clock is not None:
        clock.now += 1.0
    return [(e.seq.request_id, e.num_new_tokens) for e in out.scheduled], out


def ids(seqs):
    return [s.request_id for s in seqs]


# ---- priority -----------------------------------------------------------------------------------


def test_priority_admits_lower_values_first_ties_by_arrival():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=2, policy=Priority(starvation_s=100))
    s.add(seq("late-low", 2, 0, priority=5))
    s.add(seq("b", 2, 1, priority=1))
    s.add(seq("a", 2, 2, priority=-3))
    s.add(seq("c", 2, 3, priority=1))
    assert run_step(s)[0] == [("a", 2), ("b", 2)]
    assert ids(s.policy.admit_order(s.waiting)) == ["c", "late-low"]


def test_priority_takes_the_seat_of_the_worst_running_sequence():
    """Seats full: a more urgent arrival preempts the lowest-priority running sequence (the
    newest among equals), which keeps its output and is recomputed later."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=2, policy=Priority(starvation_s=100))
    s.add(seq("x", 6, 0, priority=2))
    s.add(seq("y", 6, 1, priority=2))
    run_step(s)
    s.add(seq("urgent", 3, 2, priority=0))
    steps, out = run_step(s)
    # y's decode was packed first, then given back to the budget when it lost its seat
    assert steps == [("x", 1), ("urgent", 3)]
    assert ids(out.preempted) == ["y"]
    y = s.waiting[0]
    assert y.status is SeqStatus.WAITING and y.num_computed_tokens == 0 and not kv.has("y")
    assert y.output_token_ids == [0]
    assert s.preemptions_by_reason == {"priority": 1}
    # y's whole page stayed in the prefix cache: it recomputes only past it once back
    s.remove(s.running[0])
    steps, _ = run_step(s)
    assert steps == [("urgent", 1), ("y", 3)]
    kv.check_integrity()


def test_priority_takes_pages_from_lower_priority_only():
    kv = KVCacheManager(num_pages=6, page_size=PS, enable_prefix_cache=False)  # 24 slots
    s = Scheduler(kv, 64, max_num_seqs=8, policy=Priority(starvation_s=100))
    s.add(seq("low", 8, 0, priority=9))
    s.add(seq("mid", 4, 1, priority=5))
    run_step(s)
    run_step(s)  # decoding: low holds 3 pages, mid 2; 1 is free
    s.add(seq("peer", 12, 2, priority=9))  # 3 pages; outranks no one (low is older)
    steps, out = run_step(s)
    assert steps == [("mid", 1), ("low", 1)] and out.preempted == []  # decodes by rank
    assert not kv.has("peer")  # refused, holding nothing, preempting no one
    s.remove(s.waiting[0])
    s.add(seq("top", 8, 3, priority=0))  # 2 pages: the worst it outranks gives them
    steps, out = run_step(s)
    assert ids(out.preempted) == ["low"]
    assert steps == [("mid", 1), ("top", 8)]
    assert s.preemptions_by_reason == {"priority": 1}
    kv.check_integrity()


def test_priority_never_preempts_a_send_in_progress():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 8, max_num_seqs=1, policy=Priority(starvation_s=100))
    send = Sequence("send", list(range(20)), SamplingParams(1), 0, 9, send_only=True)
    s.add(send)
    assert run_step(s)[0] == [("send", 8)]
    s.add(seq("urgent", 2, 1, priority=0))
    steps, out = run_step(s)
    assert steps == [("send", 8)] and out.preempted == [] and ids(s.waiting) == ["urgent"]


def test_priority_starvation_bound_under_a_stream_of_urgent_requests():
    """One seat; every step a new urgent one-token request arrives. Without the bound "low"
    would never run; with starvation_s = 3 it is promoted at the first step more than 3 s
    after it last ran (it was added at t=0), runs then, and no urgent arrival preempts it."""
    clock = Clock()
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=1, policy=Priority(starvation_s=3, clock=clock))
    s.add(seq("low", 4, 0, priority=10, max_tokens=3))
    s.add(seq("u0", 2, 1, priority=0, max_tokens=1))
    ran = []
    for step in range(8):
        steps, _ = run_step(s, clock)
        ran.append([rid for rid, _ in steps])
        s.add(seq(f"u{step + 1}", 2, step + 2, priority=0, max_tokens=1))
    assert ran == [["u0"], ["u1"], ["u2"], ["u3"], ["low"], ["low"], ["low"], ["u4"]]
    assert s.policy.promotions == 1
    kv.check_integrity()


# ---- skip-join MLFQ -----------------------------------------------------------------------------

# predict(n) = 10 ms + 1 ms per token; base quantum 20 ms: quanta 20, 40, 80, 160 ms
PROFILE = PrefillProfile(fixed_s=0.010, per_token_s=0.001)


def mlfq(clock=None, starvation_s=100.0, levels=4):
    return SkipJoinMLFQ(PROFILE, num_levels=levels, base_quantum_s=0.020,
                        starvation_s=starvation_s, clock=clock or Clock())


def test_mlfq_joins_the_first_queue_whose_quantum_covers_the_first_iteration():
    kv = KVCacheManager(num_pages=256, page_size=PS)
    s = Scheduler(kv, max_num_batched_tokens=100, max_num_seqs=8, policy=mlfq())
    for rid, n in [("short", 5), ("mid", 25), ("long", 60), ("huge", 400)]:
        s.add(seq(rid, n, len(s.waiting)))
    # 15 ms -> 0; 35 ms -> 1; 70 ms -> 2; huge's first chunk is the budget: 110 ms -> 3
    assert {x.request_id: s.policy.level(x) for x in s.waiting} == {
        "short": 0, "mid": 1, "long": 2, "huge": 3}
    assert s.policy.stats() == {"level_0": 1, "level_1": 1, "level_2": 1, "level_3": 1}
    # the shortest first: all fit the budget but huge, which gets what is left
    steps, _ = run_step(s)
    assert steps == [("short", 5), ("mid", 25), ("long", 60), ("huge", 10)]


def test_mlfq_demotes_after_a_quantum_and_preempts_for_a_higher_queue():
    """One seat. "a" joins queue 0 (prefill 3 tokens: 13 ms); each decode charges 11 ms: used
    24 ms after its first decode, past 20 ms, so it drops to queue 1 (40 ms) and so on. A new
    short job joins queue 0 and takes the seat at once."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=1, policy=mlfq())
    a = seq("a", 3, 0)
    s.add(a)
    levels = []
    for _ in range(5):
        run_step(s)
        levels.append(s.policy.level(a))
    # 13 | 24 -> q1 | 11 | 22 | 33 | (44 -> q2 at the 6th)
    assert levels == [0, 1, 1, 1, 1]
    run_step(s)
    assert s.policy.level(a) == 2 and s.policy.demotions == 2
    s.add(seq("b", 3, 1, max_tokens=2))
    steps, out = run_step(s)
    assert steps == [("b", 3)] and ids(out.preempted) == ["a"]
    assert s.preemptions_by_reason == {"priority": 1}
    steps, out = run_step(s)  # b decodes its last token; a waits
    assert steps == [("b", 1)]
    steps, _ = run_step(s)  # a is back: prompt + 6 outputs, 2 whole pages still cached
    assert steps == [("a", 1)] and a.num_computed_tokens == 9
    kv.check_integrity()


def test_mlfq_starvation_bound_promotes_to_the_top_queue():
    """One seat; "long" has sunk to queue 3 when a stream of queue-0 jobs (one new each step,
    two steps each) starts. With starvation_s = 4 it is promoted to queue 0 at the first step
    more than 4 s after it last ran, and then outranks the younger queue-0 jobs."""
    clock = Clock()
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=1, policy=mlfq(clock, starvation_s=4))
    long = seq("long", 3, 0)
    s.add(long)
    while s.policy.level(long) < 3:
        run_step(s, clock)
    assert clock.now == 14  # 13 ms prefill, 11 ms decodes: quanta of 20, 40 and 80 ms used
    ran = []
    for k in range(8):
        s.add(seq(f"j{k}", 2, k + 1, max_tokens=2))
        steps, _ = run_step(s, clock)
        ran.append([rid for rid, _ in steps])
    # j0 preempts long at t=14 (long last ran at t=13); long is starved past 4 s at t=18,
    # runs at queue 0 until its 20 ms are used, then j2 takes the seat
    assert ran == [["j0"], ["j0"], ["j1"], ["j1"], ["long"], ["long"], ["j2"], ["j2"]]
    assert s.policy.promotions == 1
    kv.check_integrity()


# ---- FCFS ---------------------------------------------------------------------------------------


def test_fcfs_bound_no_later_arrival_overtakes_a_sequence_waiting_for_pages():
    """FCFS's bound is the work ahead: "big" waits for pages while small requests keep
    arriving that would fit; none is admitted before it, so it runs the step "a" finishes."""
    kv = KVCacheManager(num_pages=4, page_size=PS, enable_prefix_cache=False)
    s = Scheduler(kv, 64, max_num_seqs=8, policy=FCFS())
    s.add(seq("a", 8, 0, max_tokens=4))  # 2 pages, 3 once decoding
    s.add(seq("big", 12, 1, max_tokens=1))  # 3 pages: not beside a
    ran = []
    for k in range(5):
        s.add(seq(f"s{k}", 2, k + 2, max_tokens=1))
        steps, _ = run_step(s)
        ran.append([rid for rid, _ in steps])
    assert ran == [["a"], ["a"], ["a"], ["a"], ["big", "s0"]]
    kv.check_integrity()


def test_make_policy_names_the_choices():
    assert isinstance(make_policy("fcfs", starvation_s=1), FCFS)
    assert make_policy("priority", starvation_s=2).starvation_s == 2
    with pytest.raises(ValueError, match="needs a prefill-time profile"):
        make_policy("mlfq", starvation_s=1)
    with pytest.raises(ValueError, match="fcfs, priority, mlfq; got 'lifo'"):
        make_policy("lifo", starvation_s=1)


def test_prefill_profile_fit_is_least_squares_and_never_negative():
    fit = PrefillProfile.fit([(1, 0.011), (101, 0.111), (201, 0.211)])
    assert fit.fixed_s == pytest.approx(0.010) and fit.per_token_s == pytest.approx(0.001)
    assert PrefillProfile.fit([(1, 0.5), (100, 0.1)]).per_token_s == 0.0


@pytest.mark.parametrize(("policy", "first_step"), [
    ("fcfs", [("recv", 1)]),
    ("priority", [("recv", 1)]),
    ("mlfq", [("recv", 1), ("small", 2)]),  # small's queue (0) is above big's (1)
])
def test_every_policy_lets_received_kv_overtake_a_head_that_needs_its_pages(policy,
                                                                           first_step):
    """P/D under every policy: D holds KV received for "recv"; "big" waits ahead of it for 4
    pages, with 2 free. "recv" still runs (it only needs room to grow; finishing frees its
    pages) and is not pushed out for "big" (same priority: arrival alone never preempts);
    nothing ranked after "big" overtakes it; "big" runs once "recv" is done."""
    kv = KVCacheManager(num_pages=4, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8, policy=make_policy(
        policy, starvation_s=100, profile=PROFILE, base_quantum_s=0.020))
    s.add(seq("big", 13, 0))
    kv.open("recv", [])
    assert kv.allocate("recv", 7)  # the received prompt[:7], as adopt_for_generate leaves it
    s.add(Sequence("recv", list(range(100, 108)), SamplingParams(1), 1, num_computed_tokens=7))
    s.add(seq("small", 2, 2))
    steps, out = run_step(s)
    assert steps == first_step and out.preempted == []
    # then big takes all 4 pages; under mlfq small holds one, so big waits for it
    second = [("small", 1)] if policy == "mlfq" else [("big", 13)]
    assert run_step(s)[0] == second
    kv.check_integrity()


# ---- background (filler) work ---------------------------------------------------------------------

BG = 100  # the tests' background priority


def test_background_gets_only_its_room_of_a_step_while_live_work_exists():
    """Three batch lines run freely alone; once a live request waits, a step gives them 2 rows
    and 5 tokens at most (b2 waits, holding its KV), and the live prompt runs whole; when it
    has finished, all three run again."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8, background=Background(BG, max_seqs=2, max_tokens=5))
    for i in range(3):
        s.add(seq(f"b{i}", 6, i, priority=BG))
    assert run_step(s)[0] == [("b0", 6), ("b1", 6), ("b2", 6)]
    s.add(seq("L", 8, 3, priority=0, max_tokens=2))
    assert run_step(s)[0] == [("b0", 1), ("b1", 1), ("L", 8)]
    assert run_step(s)[0] == [("b0", 1), ("b1", 1), ("L", 1)]  # L finishes here
    assert run_step(s)[0] == [("b0", 1), ("b1", 1), ("b2", 1)]
    kv.check_integrity()


def test_background_prompts_are_chunked_to_the_room_and_hold_up_no_live_admission():
    """FCFS: a batch line between two live requests is admitted with 3 tokens of its prompt
    (its room), does not block the live request behind it, and finishes its prompt at full
    speed once the live requests are done."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8, background=Background(BG, max_seqs=1, max_tokens=3))
    s.add(seq("L0", 4, 0, max_tokens=3))
    s.add(seq("b", 10, 1, priority=BG))
    s.add(seq("L1", 4, 2, max_tokens=3))
    assert run_step(s)[0] == [("L0", 4), ("b", 3), ("L1", 4)]
    assert run_step(s)[0] == [("L0", 1), ("L1", 1), ("b", 3)]
    assert run_step(s)[0] == [("L0", 1), ("L1", 1), ("b", 3)]  # both live ones finish
    steps, out = run_step(s)
    assert steps == [("b", 1)] and out.scheduled[0].sample
    kv.check_integrity()


def test_background_is_never_promoted_for_starvation():
    """One seat and a stream of urgent requests, as in the starvation test above, but the
    waiting sequence is background: it is not promoted (it would then take the seat from live
    work), and runs once the stream stops."""
    clock = Clock()
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=1, policy=Priority(starvation_s=3, clock=clock),
                  background=Background(BG, max_seqs=1, max_tokens=4))
    s.add(seq("bg", 4, 0, priority=BG, max_tokens=2))
    s.add(seq("u0", 2, 1, max_tokens=1))
    ran = []
    for step in range(6):
        steps, _ = run_step(s, clock)
        ran.append([rid for rid, _ in steps])
        if step < 4:
            s.add(seq(f"u{step + 1}", 2, step + 2, max_tokens=1))
    assert ran == [["u0"], ["u1"], ["u2"], ["u3"], ["u4"], ["bg"]]
    assert s.policy.promotions == 0
    kv.check_integrity()


def test_gathered_background_prompts_run_in_one_step_of_every_n():
    """prompt_every 3, 2 tokens a step: while a live request decodes, a batch line's prompt
    waits two steps and then runs 6 tokens in the third (the room of three steps); decode rows
    ride every step."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8,
                  background=Background(BG, max_seqs=2, max_tokens=2, prompt_every=3))
    s.add(seq("L", 4, 0, max_tokens=10))
    s.add(seq("b0", 14, 1, priority=BG))
    s.add(seq("b1", 3, 2, priority=BG, max_tokens=9))
    assert run_step(s)[0] == [("L", 4)]  # nothing saved yet: no background prompt
    assert run_step(s)[0] == [("L", 1)]
    assert run_step(s)[0] == [("L", 1), ("b0", 6)]  # three steps' room: 6 tokens in one
    assert run_step(s)[0] == [("L", 1)]
    assert run_step(s)[0] == [("L", 1)]
    assert run_step(s)[0] == [("L", 1), ("b0", 6)]
    assert run_step(s)[0] == [("L", 1)]
    assert run_step(s)[0] == [("L", 1)]
    # b0 has 2 prompt tokens left, b1 3: the room's 6 takes both (b1 is admitted behind b0)
    assert run_step(s)[0] == [("L", 1), ("b0", 2), ("b1", 3)]
    assert run_step(s)[0] == [("L", 1), ("b0", 1), ("b1", 1)]  # decode rows every step; L ends
    assert run_step(s)[0] == [("b0", 1), ("b1", 1)]
    kv.check_integrity()


def _b0_ran_alone(max_tokens: int, prompt_every: int):
    """A scheduler with gathered background prompts whose batch line b0 ran its prompt alone."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8, background=Background(
        BG, max_seqs=2, max_tokens=max_tokens, prompt_every=prompt_every))
    s.add(seq("b0", 4, 0, priority=BG, max_tokens=9))
    assert run_step(s)[0] == [("b0", 4)]  # alone: whole
    return kv, s


def test_with_no_live_work_the_gathered_room_is_full_at_once():
    kv, s = _b0_ran_alone(max_tokens=2, prompt_every=4)
    s.add(seq("L", 4, 1, max_tokens=3))
    s.add(seq("b1", 12, 2, priority=BG))
    assert run_step(s)[0] == [("b0", 1), ("L", 4), ("b1", 8)]  # the room saved while alone
    assert run_step(s)[0] == [("b0", 1), ("L", 1)]
    kv.check_integrity()


def test_no_background_tokens_means_none_gathered_either():
    kv, s = _b0_ran_alone(max_tokens=0, prompt_every=4)
    s.add(seq("L", 4, 1, max_tokens=6))
    assert [run_step(s)[0] for _ in range(6)] == [[("L", 4)]] + [[("L", 1)]] * 5
    assert run_step(s)[0] == [("b0", 1)]  # L is done
    kv.check_integrity()


def test_background_limits_are_checked():
    with pytest.raises(ValueError, match="must be >= 0, got -1 sequences and 5 tokens"):
        Background(BG, max_seqs=-1, max_tokens=5)
    with pytest.raises(ValueError, match="prompt_every must be >= 1, got 0"):
        Background(BG, max_seqs=1, max_tokens=5, prompt_every=0)


def test_under_fcfs_a_live_request_takes_the_seat_of_the_newest_background_one():
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=2, background=Background(BG, max_seqs=2, max_tokens=8))
    s.add(seq("b0", 4, 0, priority=BG))
    s.add(seq("b1", 4, 1, priority=BG))
    assert run_step(s)[0] == [("b0", 4), ("b1", 4)]
    s.add(seq("L", 6, 2, max_tokens=1))
    steps, out = run_step(s)
    assert steps == [("b0", 1), ("L", 6)] and ids(out.preempted) == ["b1"]
    assert s.preemptions_by_reason == {"priority": 1}
    assert ids(s.waiting) == ["b1"] and s.waiting[0].num_computed_tokens == 0  # recomputed
    # L finished: b1 comes back; its prompt's whole page is cached, so it computes its token
    assert run_step(s)[0] == [("b0", 1), ("b1", 1)]
    kv.check_integrity()


def test_a_background_sequence_that_finds_no_seat_holds_up_no_live_one():
    """FCFS, two seats, both taken (b0 background, L0 live); a background b1 waits ahead of a
    live L1. b1 gets no seat (it takes none from anyone), and that must not bar L1, which takes
    b0's."""
    kv = KVCacheManager(num_pages=64, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=2, background=Background(BG, max_seqs=2, max_tokens=8))
    s.add(seq("b0", 4, 0, priority=BG))
    s.add(seq("L0", 4, 1, max_tokens=5))
    assert run_step(s)[0] == [("b0", 4), ("L0", 4)]
    s.add(seq("b1", 4, 2, priority=BG))
    s.add(seq("L1", 4, 3, max_tokens=5))
    steps, out = run_step(s)  # b0's decode is taken back with its seat
    assert steps == [("L0", 1), ("L1", 4)] and ids(out.preempted) == ["b0"]
    assert ids(s.waiting) == ["b0", "b1"]
    kv.check_integrity()


def test_among_background_sequences_fcfs_still_bars_overtaking():
    """A background sequence that does not fit bars the background ones after it (FCFS among
    them, as among live ones), while a live one after it is admitted."""
    kv = KVCacheManager(num_pages=6, page_size=PS)
    s = Scheduler(kv, 64, max_num_seqs=8, background=Background(BG, max_seqs=4, max_tokens=64))
    s.add(seq("big", 30, 0, priority=BG))  # 8 pages: never fits in 6
    s.add(seq("small", 4, 1, priority=BG))
    s.add(seq("L", 4, 2, max_tokens=1))
    steps, _ = run_step(s)
    assert steps == [("L", 4)] and ids(s.waiting) == ["big", "small"]
    kv.check_integrity()
