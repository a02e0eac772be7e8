"""The host KV tier's copies and its use by the scheduler and the engine (--kv-host-memory-gb):
pages come back byte-equal, the swap-or-recompute choice at its exact threshold, a swapped
request's greedy tokens equal Hugging Face's, aborts in every host state free everything."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB, hf_greedy
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.host_swap import HostSwap, _runs
from engine.policies import Priority
from engine.scheduler import Scheduler
from engine.sequence import SeqStatus
from kvcache.host_tier import HostState
from kvcache.manager import KVCacheManager
from microserve.messages import SamplingParams
from test_engine_core import random_prompts
from test_scheduling_policies import run_step, seq

# a GPU pool's shape: [layers, K|V, pages, page_size, kv_heads, head_dim]; a page is 512 bytes
SHAPE = (2, 2, 8, 4, 2, 4)
PAGE_BYTES = 2 * 2 * 4 * 2 * 4 * 4


def pool(device="cpu"):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(device)


def test_runs_of_adjacent_pages():
    assert _runs([7, 8, 9, 3, 4]) == [(0, 3, 7), (3, 5, 3)]
    assert _runs([5]) == [(0, 1, 5)]
    assert _runs([2, 1]) == [(0, 1, 2), (1, 2, 1)]
    assert _runs([7, 8, 9, 3, 4], 2) == [(0, 2, 7), (2, 3, 9), (3, 5, 3)]
    assert _runs([1, 2, 3, 4, 5], 1) == [(k, k + 1, k + 1) for k in range(5)]


def round_trip(kv: torch.Tensor, copy_programs: int | None = None,
               dma_pages: int | None = None) -> None:
    """Swap pages [5, 2, 7] out, spoil them, swap the KV into pages [1, 3, 4]: byte-equal."""
    swap = HostSwap(kv, memory_gb=4 * PAGE_BYTES / 2**30, copy_programs=copy_programs,
                    dma_pages=dma_pages)
    assert swap.tier.pool.num_pages == 4
    before = kv[:, :, [5, 2, 7]].clone()
    assert swap.swap_out("a", [5, 2, 7], 10)
    swap.settle_out("a")
    assert swap.state("a") is HostState.HELD
    kv[:, :, [1, 2, 3, 4, 5, 7]] = 0
    assert swap.swap_in("a", [1, 3, 4]) == 10
    swap.before_forward(["a"])
    if kv.is_cuda:
        torch.cuda.synchronize()
        assert swap.poll() == []  # the copy in landed: its host pages are freed
    assert torch.equal(kv[:, :, [1, 3, 4]], before)
    assert swap.state("a") is None and swap.tier.pool.num_free == 4
    assert swap.stats() == {"kv_swap_outs": 1, "kv_swap_ins": 1,
                            "kv_swap_out_bytes": 3 * PAGE_BYTES,
                            "kv_swap_in_bytes": 3 * PAGE_BYTES, "kv_swap_recomputes": 0,
                            "kv_swap_copies_beside": 0,
                            "kv_host_prefix_demoted_pages": 0, "kv_host_prefix_loaded_pages": 0,
                            "kv_host_pages_total": 4, "kv_host_pages_free": 4}
    swap.check_integrity(set())


def test_pages_come_back_byte_equal_into_other_pages():
    round_trip(pool())


def test_pages_come_back_byte_equal_in_one_page_dmas():
    round_trip(pool(), dma_pages=1)


def test_pages_come_back_byte_equal_through_the_copy_kernel():
    """The copy kernel (engine/kernels/host_pages.py) under Triton's interpreter, its grid
    smaller than the fragments to copy (3 programs, 3 pages x 4 fragments each way)."""
    round_trip(pool(), copy_programs=3)


def test_copies_beside_steps_take_the_narrow_grid(monkeypatch):
    """A copy that steps run beside takes `beside_programs` programs, one the GPU waits for
    `copy_programs`; both move the same bytes (under Triton's interpreter)."""
    import engine.host_swap as host_swap

    grids = []

    def spy(gpu_kv, host, pages, to_host, num_programs):
        grids.append((to_host, num_programs))
        host_swap_copy(gpu_kv, host, pages, to_host, num_programs)

    host_swap_copy = host_swap.copy_host_pages
    monkeypatch.setattr(host_swap, "copy_host_pages", spy)
    kv = pool()
    swap = HostSwap(kv, memory_gb=4 * PAGE_BYTES / 2**30, copy_programs=3, beside_programs=2)
    before = kv[:, :, [5, 2]].clone()
    assert swap.swap_out("a", [5, 2], 8, beside=True)
    swap.settle_out("a")
    kv[:, :, [5, 2]] = 0
    assert swap.swap_in("a", [5, 2]) == 8
    assert torch.equal(kv[:, :, [5, 2]], before)
    assert swap.swap_out("b", [1], 3) and swap.swap_in("b", [1], beside=True) == 3
    assert grids == [(True, 2), (False, 3), (True, 3), (False, 2)]
    assert swap.counters["kv_swap_copies_beside"] == 2


def test_the_narrow_grid_is_checked():
    with pytest.raises(ValueError, match=r"beside_programs must be in \[1, copy_programs 3\], "
                                         "got 4"):
        HostSwap(pool(), memory_gb=PAGE_BYTES / 2**30, copy_programs=3, beside_programs=4)
    with pytest.raises(ValueError, match="got 0"):
        HostSwap(pool(), memory_gb=PAGE_BYTES / 2**30, copy_programs=3, beside_programs=0)
    assert HostSwap(pool(), memory_gb=PAGE_BYTES / 2**30, copy_programs=3).beside_programs == 3
    assert HostSwap(pool(), memory_gb=PAGE_BYTES / 2**30, copy_programs=16).beside_programs == 4
    assert HostSwap(pool(), memory_gb=PAGE_BYTES / 2**30).beside_programs == 0  # staged (CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("copy_programs, dma_pages", [(None, None), (0, None), (0, 1)])
def test_pages_come_back_byte_equal_on_cuda(copy_programs, dma_pages):
    """The copy kernel (the default), staged, staged in one-page DMAs."""
    round_trip(pool("cuda"), copy_programs, dma_pages)


def test_a_full_host_pool_means_recompute():
    swap = HostSwap(pool(), memory_gb=2 * PAGE_BYTES / 2**30)
    assert not swap.swap_out("a", [0, 1, 2], 9)  # 3 pages, 2 free: nothing taken
    assert swap.state("a") is None and swap.tier.pool.num_free == 2
    assert swap.counters["kv_swap_recomputes"] == 1


def test_swap_or_recompute_at_the_exact_threshold():
    """On CPU both copies are on the sequence's path: 2 x 10 tokens x 128 bytes = 2,560 bytes
    against a 10 ms recompute (1 ms a token): 256,000 B/s is the tie, which recomputes."""
    swap = HostSwap(pool(), memory_gb=4 * PAGE_BYTES / 2**30, copy_gbps=256_000 / 1e9)
    assert not swap.wants(10, 10)  # no profile yet: recompute
    swap.prefill_s = lambda n: n / 1000
    assert not swap.wants(10, 10)  # a tie
    swap.copy_bytes_per_s = 256_001
    assert swap.wants(10, 10)
    assert not swap.wants(10, 0)  # all of it cached: nothing to save
    assert not swap.wants(10, 6)  # 6 ms to recompute the uncached part beats 9.99 ms
    assert swap.counters["kv_swap_recomputes"] == 4


class FakeEvent:
    """A copy's event that completes when the test says (as a CUDA event does when the copy
    stream gets there)."""

    def __init__(self, swap):
        self.swap = swap

    def query(self) -> bool:
        return self.swap.landed

    def synchronize(self) -> None:
        pass


class DeferredSwap(HostSwap):
    """CPU copies whose landing is deferred like CUDA's, so the scheduler meets COPYING_OUT
    and COPYING_IN (the bytes are copied at once; the bookkeeping waits for `landed`)."""

    def __init__(self, kv):
        super().__init__(kv, memory_gb=8 * PAGE_BYTES / 2**30, copy_gbps=1e6)
        self.prefill_s = lambda n: 1.0  # a second to recompute: always swap
        self.synchronous, self.landed = False, False
        self.besides = []  # each copy: ("out" | "in", seq id, beside)

    def _record(self):
        return FakeEvent(self)

    def swap_out(self, seq_id, gpu_pages, num_tokens, beside=False):
        self.besides.append(("out", seq_id, beside))
        return super().swap_out(seq_id, gpu_pages, num_tokens, beside)

    def swap_in(self, seq_id, gpu_pages, skip=0, beside=False):
        self.besides.append(("in", seq_id, beside))
        return super().swap_in(seq_id, gpu_pages, skip, beside)


def seat_preemption():
    """One seat: `low` (priority 5) runs two steps, then `high` (priority 0) takes its seat."""
    kv = KVCacheManager(8, 4)
    swap = DeferredSwap(pool())
    sched = Scheduler(kv, 64, 1, Priority(starvation_s=1000), swapper=swap)
    low = seq("low", 6, 0, priority=5)
    sched.add(low)
    run_step(sched)
    run_step(sched)  # low: 7 tokens computed, 2 pages
    high = seq("high", 5, 1, priority=0, max_tokens=1)
    sched.add(high)
    return kv, swap, sched, low, high


def check_nothing_held(kv, swap, sched):
    kv.check_integrity()
    swap.check_integrity({s.request_id for s in (*sched.running, *sched.waiting)})
    assert swap.tier.pool.num_free == 8
    assert kv.stats().used_pages == 0


def test_a_seat_preemption_keeps_the_gpu_pages_until_the_copy_out_lands():
    kv, swap, sched, low, high = seat_preemption()
    run_step(sched)  # high admitted, low preempted: its copy out is in flight
    assert swap.state("low") is HostState.COPYING_OUT
    assert low.status is SeqStatus.WAITING and low.num_computed_tokens == 7
    assert kv.page_table("low") == [0, 1] and swap.tier.pages("low") == [0, 1]
    swap.landed = True
    # high finished before; the copy out landed: GPU pages freed, and low's copy back starts
    # while it waits (a step never waits for a copy)
    assert run_step(sched)[0] == []
    assert swap.counters["kv_swap_ins"] == 1 and swap.state("low") is HostState.COPYING_IN
    assert run_step(sched)[0] == [("low", 1)]  # landed: admitted with its KV
    assert low.status is SeqStatus.RUNNING and low.num_computed_tokens == 8  # no recompute
    # high's steps ran beside the copy out; nothing ran beside the copy back
    assert swap.besides == [("out", "low", True), ("in", "low", False)]
    sched.remove(low)
    check_nothing_held(kv, swap, sched)


def test_the_next_sequence_to_run_is_prefetched_while_it_waits():
    """`high` runs three steps; once `low`'s copy out lands, its GPU pages are freed and, as the
    policy's next, with a seat and free pages but no token budget left, its KV is copied back
    while it still waits: its first page, which the prefix cache kept, is reused as it is, and
    only its partial second page is copied."""
    kv, swap, sched, low, high = seat_preemption()
    high.params = SamplingParams(max_tokens=3)
    before = swap.gpu_kv[:, :, [0, 1]].clone()
    assert run_step(sched)[0] == [("high", 5)]
    sched.max_num_seqs, sched.max_num_batched_tokens = 2, 1  # a seat, but high's decode
    # takes the step's whole budget
    assert swap.state("low") is HostState.COPYING_OUT and kv.page_table("low") == [0, 1]
    swap.landed = True
    assert run_step(sched)[0] == [("high", 1)]
    assert swap.state("low") is HostState.COPYING_IN and low.status is SeqStatus.WAITING
    assert kv.page_table("low") == [0, 1]
    assert torch.equal(swap.gpu_kv[:, :, [0, 1]], before)
    assert swap.counters["kv_swap_in_bytes"] == PAGE_BYTES
    assert run_step(sched)[0] == [("high", 1)]  # high finishes; the copy landed
    assert swap.state("low") is None and swap.tier.pool.num_free == 8
    assert run_step(sched)[0] == [("low", 1)]  # admitted with its KV: one decode token
    assert low.num_computed_tokens == 8 and swap.counters["kv_swap_ins"] == 1
    assert swap.besides == [("out", "low", True), ("in", "low", True)]  # high ran beside both
    sched.remove(low)
    check_nothing_held(kv, swap, sched)


def test_no_prefetch_for_a_sequence_without_a_seat():
    kv, swap, sched, low, high = seat_preemption()
    high.params = SamplingParams(max_tokens=3)
    run_step(sched)
    swap.landed = True
    run_step(sched)  # the one seat is high's, which low does not outrank: it waits on the host
    assert swap.state("low") is HostState.HELD and not kv.has("low")
    sched.remove(high)
    sched.remove(low)
    check_nothing_held(kv, swap, sched)


def test_a_sequence_copying_back_waits_for_its_copy_and_keeps_its_pages():
    """Copied back while it waits, a sequence runs only once the copy has landed (the step
    before would have waited for it), and an urgent arrival meanwhile runs beside it without
    touching its pages; nothing is lost or held twice."""
    kv, swap, sched, low, high = seat_preemption()
    run_step(sched)  # low preempted: copy out in flight
    swap.landed = True
    sched.remove(high)
    assert run_step(sched)[0] == []  # the copy out landed; low's copy back started
    assert swap.state("low") is HostState.COPYING_IN and low.status is SeqStatus.WAITING
    pages = kv.page_table("low")
    swap.landed = False  # the copy back has not landed when...
    urgent = seq("urgent", 5, 2, priority=0, max_tokens=1)
    sched.add(urgent)
    assert run_step(sched)[0] == [("urgent", 5)]  # ...urgent runs; low still waits for it
    assert swap.state("low") is HostState.COPYING_IN and kv.page_table("low") == pages
    swap.landed = True
    assert run_step(sched)[0] == [("low", 1)]  # landed: admitted with its 7 tokens of KV
    assert low.status is SeqStatus.RUNNING and low.num_computed_tokens == 8
    assert swap.counters["kv_swap_outs"] == 1 and swap.counters["kv_swap_ins"] == 1
    sched.remove(low)
    check_nothing_held(kv, swap, sched)


def test_admission_before_the_copy_out_lands_keeps_the_gpu_pages():
    kv, swap, sched, low, high = seat_preemption()
    run_step(sched)
    sched.remove(high)
    run_step(sched)  # the copy out is still in flight: it is dropped, the GPU pages kept
    assert swap.state("low") is None and swap.tier.pool.num_free == 8
    assert low.status is SeqStatus.RUNNING and low.num_computed_tokens == 8
    assert kv.page_table("low") == [0, 1]
    assert swap.counters["kv_swap_ins"] == 0
    sched.remove(low)
    check_nothing_held(kv, swap, sched)


def two_decoding(a_tokens: int):
    """FCFS over 8 GPU pages of 4 tokens: `a` (6-token prompt, `a_tokens` to generate) and
    `b` (6 tokens, 20 to generate) run side by side until, after step 8, they hold all 8
    pages."""
    kv = KVCacheManager(8, 4)
    swap = DeferredSwap(pool())
    sched = Scheduler(kv, 64, 4, swapper=swap)
    a, b = seq("a", 6, 0, max_tokens=a_tokens), seq("b", 6, 1, max_tokens=20)
    sched.add(a)
    sched.add(b)
    for _ in range(8):
        assert run_step(sched)[0] in ([("a", 6), ("b", 6)], [("a", 1), ("b", 1)])
    assert kv.page_table("a") == [0, 1, 4, 6] and kv.page_table("b") == [2, 3, 5, 7]
    assert kv.num_available_pages() == 0
    return kv, swap, sched, a, b


def test_the_next_victim_is_copied_out_before_a_page_is_short():
    """No page is free and the next step may need one: the newest sequence is copied out
    ahead (beside compute, its pages held until the copy lands), not when a page is short
    (when the step would wait for the copy). It is not taken back while the pool is short,
    and comes back, copied in while it waits, once `a` has finished."""
    kv, swap, sched, a, b = two_decoding(a_tokens=12)
    steps, out = run_step(sched)
    assert steps == [("a", 1)] and out.preempted == [b]
    assert sched.preemptions_by_reason == {"ahead": 1}
    assert swap.state("b") is HostState.COPYING_OUT and kv.page_table("b") == [2, 3, 5, 7]
    assert b.num_computed_tokens == 13
    assert run_step(sched)[0] == [("a", 1)]  # b not taken back: its pages are the short ones
    assert swap.state("b") is HostState.COPYING_OUT
    swap.landed = True
    assert run_step(sched)[0] == [("a", 1)]  # landed: b's GPU pages freed
    assert swap.state("b") is HostState.HELD and not kv.has("b")
    assert run_step(sched)[0] == [("a", 1)] and a.status is SeqStatus.FINISHED
    assert run_step(sched)[0] == []  # b's copy back starts while it waits
    assert swap.state("b") is HostState.COPYING_IN
    assert run_step(sched)[0] == [("b", 1)]  # landed: it resumes with its 13 tokens of KV
    assert b.num_computed_tokens == 14
    while sched.has_work():
        run_step(sched)
    assert sched.preemptions_by_reason == {"ahead": 1}
    assert swap.counters["kv_swap_outs"] == 1 and swap.counters["kv_swap_ins"] == 1
    check_nothing_held(kv, swap, sched)


def test_a_page_short_waits_for_the_copy_out_in_flight_instead_of_preempting():
    """The copy out started ahead has not landed when `a` needs a page: the scheduler waits
    for that copy and takes a page of b's, instead of preempting another sequence."""
    kv, swap, sched, a, b = two_decoding(a_tokens=30)
    run_step(sched)  # b copied out ahead
    run_step(sched)
    assert run_step(sched)[0] == [("a", 1)]  # a: 16 tokens of KV, its 4 pages full
    assert swap.state("b") is HostState.COPYING_OUT
    assert run_step(sched)[0] == [("a", 1)]  # a's 17th token: a page of b's
    assert swap.state("b") is HostState.HELD and not kv.has("b")
    assert kv.page_table("a") == [0, 1, 4, 6, 7]
    assert sched.preemptions_by_reason == {"ahead": 1}  # none for "pages"
    sched.remove(a)
    sched.remove(b)
    check_nothing_held(kv, swap, sched)


def test_the_swapped_sequences_admitted_next_are_all_copied_back_while_they_wait():
    """`b` and `c` wait on the host behind nothing but seats and pages, and `a`'s decode takes
    the step's whole budget: both copies back start in that step, in the policy's order, and
    both are admitted together once they land."""
    from engine.scheduler import SchedulerOutput
    kv = KVCacheManager(8, 4)
    swap = DeferredSwap(pool())
    sched = Scheduler(kv, 64, 4, swapper=swap)
    a, b, c = (seq(r, 3, i) for i, r in enumerate("abc"))
    for s in (a, b, c):
        sched.add(s)
    assert run_step(sched)[0] == [("a", 3), ("b", 3), ("c", 3)]
    for s in (c, b):  # as a policy giving their seats away would
        sched._preempt(s, SchedulerOutput(), "priority", need_pages=False)
    assert [swap.state(r) for r in "bc"] == [HostState.COPYING_OUT] * 2
    swap.landed = True
    sched.max_num_batched_tokens = 1
    assert run_step(sched)[0] == [("a", 1)]
    assert [swap.state(r) for r in "bc"] == [HostState.COPYING_IN] * 2
    assert swap.counters["kv_swap_ins"] == 2
    sched.max_num_batched_tokens = 64
    assert run_step(sched)[0] == [("a", 1), ("b", 1), ("c", 1)]
    assert [s.num_computed_tokens for s in (a, b, c)] == [5, 4, 4]
    for s in (a, b, c):
        sched.remove(s)
    check_nothing_held(kv, swap, sched)


def test_admission_leaves_the_pages_running_sequences_grow_into():
    """With copies beside compute, a new sequence is admitted only if it leaves a page for
    each running sequence (with itself): taking the last ones would make it the next one
    copied out. Synchronous copies (a CPU engine's) admit it: nothing is copied ahead."""
    for proactive in (True, False):
        kv = KVCacheManager(8, 4)
        swap = DeferredSwap(pool())
        sched = Scheduler(kv, 64, 4, swapper=swap)
        sched.proactive = proactive
        a, c = seq("a", 16, 0, max_tokens=2), seq("c", 12, 1, max_tokens=1)
        sched.add(a)
        assert run_step(sched)[0] == [("a", 16)]
        sched.add(c)  # 3 pages of the 4 available, leaving 1 for a and c to grow into
        if proactive:
            assert run_step(sched)[0] == [("a", 1)] and not kv.has("c")
            assert run_step(sched)[0] == [("c", 12)]  # a finished: room
        else:
            assert run_step(sched)[0] == [("a", 1), ("c", 12)]
        while sched.has_work():
            run_step(sched)
        check_nothing_held(kv, swap, sched)


@pytest.mark.parametrize("when", ["copying_out", "held", "copying_in"])
def test_an_abort_in_any_host_state_frees_everything(when):
    kv, swap, sched, low, high = seat_preemption()
    run_step(sched)
    if when != "copying_out":
        swap.landed = True
        sched.remove(high)  # nothing runs: `low` comes back next step
        if when == "held":
            swap.poll()
            sched.kv.free("low")
        else:
            sched.schedule()  # landed: GPU pages freed; admitted: new pages, copy in started
            swap.landed = False
            assert swap.state("low") is HostState.COPYING_IN
    assert swap.state("low").value == when
    sched.remove(low)
    if high.status is not SeqStatus.FINISHED:
        sched.remove(high)
    check_nothing_held(kv, swap, sched)


# ---- the engine --------------------------------------------------------------------------------

LONG, SHORT = 40, 6


def serve(core: EngineCore, snapshots: list | None = None):
    """Four long low-priority requests fill the seats; two steps later an urgent one takes the
    newest one's seat. Returns each request's tokens."""
    prompts = random_prompts([30, 25, 20, 35, 12], seed=3, vocab=TINY_VOCAB)
    params = lambda n: dict(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    for i, prompt in enumerate(prompts[:4]):
        core.add_request(f"batch{i}", prompt, SamplingParams(**params(LONG)), priority=5)
    tokens, steps = {}, 0
    while core.has_work():
        if steps == 2:
            core.add_request("urgent", prompts[4], SamplingParams(**params(SHORT)), priority=0)
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
        core.check_integrity()
    return prompts, tokens


@pytest.fixture(scope="module")
def swapped_run(tiny_model_dir):
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=256,
                                   max_num_seqs=4, scheduling_policy="priority",
                                   max_num_batched_tokens=64,  # a shorter start-up profile
                                   kv_host_memory_gb=0.01, kv_host_copy_gbps=1000.0,
                                   # with it, the victim's whole pages stay cached and only
                                   # its last partial page would be recomputed: cheaper
                                   enable_prefix_cache=False))
    swap, kv = core.host_swap, core.runner.kv.kv
    out_pages, in_pages = [], []
    swap_out, swap_in = swap.swap_out, swap.swap_in
    core.besides = []  # each copy's `beside`, in order: ("out" | "in", beside)

    def spy_out(seq_id, gpu_pages, num_tokens, beside=False):
        out_pages.append(kv[:, :, gpu_pages].clone())
        core.besides.append(("out", beside))
        return swap_out(seq_id, gpu_pages, num_tokens, beside)

    def spy_in(seq_id, gpu_pages, skip=0, beside=False):
        tokens = swap_in(seq_id, gpu_pages, skip, beside)
        in_pages.append(kv[:, :, gpu_pages].clone())
        core.besides.append(("in", beside))
        return tokens

    swap.swap_out, swap.swap_in = spy_out, spy_in
    prompts, tokens = serve(core)
    return core, prompts, tokens, out_pages, in_pages


def test_a_swapped_request_resumes_with_its_pages_and_hf_tokens(swapped_run, tiny_model_dir):
    core, prompts, tokens, out_pages, in_pages = swapped_run
    stats = core.stats()
    assert stats.preemptions_by_reason == {"priority": 1}
    assert (stats.kv_swap_outs, stats.kv_swap_ins, stats.kv_swap_recomputes) == (1, 1, 0)
    # the urgent request's steps ran beside the copy out; the copy back was the admission's
    # (copies on CPU are synchronous: no prefetch), which its step waits for
    assert core.besides == [("out", True), ("in", False)]
    assert len(out_pages) == len(in_pages) == 1
    assert torch.equal(out_pages[0], in_pages[0])  # byte-equal KV in its new pages
    pages = out_pages[0].shape[2]
    assert stats.kv_swap_out_bytes == stats.kv_swap_in_bytes == pages * core.host_swap.page_bytes
    assert stats.kv_host_pages_free == stats.kv_host_pages_total > 0
    assert core.kv.stats().used_pages == 0
    ref = hf_greedy(tiny_model_dir, prompts, LONG)
    for i in range(4):
        assert tokens[f"batch{i}"] == ref[i], i
    assert tokens["urgent"] == ref[4][:SHORT]


def test_the_swap_counters_are_in_metrics(swapped_run):
    from engine.frontend.core_client import format_core_stats

    core = swapped_run[0]
    text = format_core_stats(core.stats(), core.info)
    assert "microserve_engine_kv_swap_outs_total 1" in text.splitlines()
    assert "microserve_engine_kv_swap_ins_total 1" in text.splitlines()
    assert "microserve_engine_kv_swap_recomputes_total 0" in text.splitlines()
    assert f"microserve_engine_kv_host_pages_total {core.host_swap.tier.pool.num_pages}" in text


class LateEvent:
    """A CPU copy's event that lands at its `polls`-th query, as a CUDA copy lands some steps
    after it was issued (the bytes were copied at once)."""

    def __init__(self, polls: int):
        self.left = polls

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def synchronize(self) -> None:
        self.left = 0


@pytest.mark.parametrize("device, copies", [("cpu", "synchronous"), ("cpu", "late"),
                                            pytest.param("cuda", "beside", marks=pytest.mark.gpu)])
def test_requests_swapped_for_pages_equal_hf(tiny_model_dir, device, copies):
    """FCFS with too few pages for three growing requests: the newest is preempted for the
    pages and comes back from the host, and every request's greedy tokens still equal
    Hugging Face's. Synchronous copies (CPU) preempt when a page is short. Copies beside
    compute (CUDA; on CPU `late`: each copy lands at the third step after it was issued) copy
    the victim out ahead of need, and back before it is admitted. On CUDA: the copy stream,
    events, async scheduling and CUDA graphs, in fp32 to compare with Hugging Face."""
    core = EngineCore(EngineConfig(model=tiny_model_dir, device=device, dtype="float32",
                                   page_size=4, num_pages=24, max_num_seqs=4,
                                   kv_host_memory_gb=0.01, kv_host_copy_gbps=1000.0))
    if copies == "late":
        core.host_swap.synchronous = False
        core.host_swap._record = lambda: LateEvent(3)
        core.scheduler.proactive = True
    ahead = copies != "synchronous"
    prompts = random_prompts([20, 18, 16], seed=5, vocab=TINY_VOCAB)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens = {}
    while core.has_work():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        core.check_integrity()
    stats = core.stats()
    assert stats.preemptions_by_reason["ahead" if ahead else "pages"] >= 1
    assert stats.kv_swap_outs == stats.kv_swap_ins == stats.preemptions
    if device == "cpu":  # its leading pages were still cached on the device: not copied back
        assert 0 < stats.kv_swap_in_bytes < stats.kv_swap_out_bytes
    assert stats.kv_swap_recomputes == 0
    # no sequence holds host pages: those not free are prefix-cache pages demoted there
    assert stats.kv_host_pages_free + stats.kv_host_pages_cached == stats.kv_host_pages_total
    assert core.kv.stats().used_pages == 0
    ref = hf_greedy(tiny_model_dir, prompts, 24)
    assert [tokens[f"r{i}"] for i in range(3)] == ref


def test_prefix_pages_demote_and_load_back_byte_equal_in_chunks():
    """The prefix cache's copies (HostSwap.demote, load) move pages in chunks that bound the
    staging tensor: pages [5, 2, 7] to host pages [3, 0, 1] in chunks of 2, back into
    [1, 3, 4], byte-equal."""
    kv = pool()
    swap = HostSwap(kv, memory_gb=4 * PAGE_BYTES / 2**30)
    swap.PREFIX_COPY_PAGES = 2
    before = kv[:, :, [5, 2, 7]].clone()
    swap.demote([5, 2, 7], [3, 0, 1])
    kv[:, :, [1, 2, 3, 4, 5, 7]] = 0
    swap.load([3, 0, 1], [1, 3, 4])
    assert torch.equal(kv[:, :, [1, 3, 4]], before)
    assert swap.counters["kv_host_prefix_demoted_pages"] == 3
    assert swap.counters["kv_host_prefix_loaded_pages"] == 3


@pytest.mark.parametrize("tier", [False, True])
def test_mlfq_short_of_pages_waits_for_them_with_or_without_a_host_tier(tier):
    """MLFQ, 4 pages of 4 tokens: `old` (8-token prompt) sinks to queue 1 after its first
    decode and holds 3 pages; `new` (9 tokens: 3 pages, 1 free) joins queue 0. It waits for
    pages, host tier or not: taking old's, by recompute or by swap, made every arrival push
    out a sequence that had not finished (the thrash of docs/benchmarks.md, 2026-11-28)."""
    from test_scheduling_policies import mlfq
    kv = KVCacheManager(4, 4)
    swap = DeferredSwap(pool()) if tier else None
    sched = Scheduler(kv, 64, 8, mlfq(), swapper=swap)
    old = seq("old", 8, 0)
    sched.add(old)
    assert run_step(sched)[0] == [("old", 8)]
    assert run_step(sched)[0] == [("old", 1)]
    assert sched.policy.level(old) == 1 and len(kv.page_table("old")) == 3
    new = seq("new", 9, 1, max_tokens=1)
    sched.add(new)
    steps, out = run_step(sched)
    assert steps == [("old", 1)] and out.preempted == [] and not kv.has("new")
    assert sched.preemptions_by_reason == {}
    assert new.status is SeqStatus.WAITING
    assert swap is None or swap.counters["kv_swap_outs"] == 0
    for s in (*sched.running, *sched.waiting):
        sched.remove(s)
    kv.check_integrity()
    assert kv.stats().used_pages == 0


def test_the_copies_order_across_streams_as_on_cuda(monkeypatch):
    """The CUDA paths' stream order, with torch.cuda's streams and events recorded (the bytes
    still move, on the CPU): a demotion's DMA goes on its own stream after the compute
    stream's work; a load makes the compute stream wait for it; a copy out waits for the
    compute stream and the demotions before it; a copy back waits for the compute stream
    alone (never behind demotions). Pages come back byte-equal along the way."""
    import contextlib
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "waits for", other.name))

        def wait_event(self, event):
            log.append((self.name, "waits for", event.name))

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.name = f"event {Event.count}"

        def record(self, stream=None):
            log.append((self.name, "on", stream.name if stream else "compute"))

        def query(self):
            return True

        def synchronize(self):
            pass

    compute = Stream("compute")

    @contextlib.contextmanager
    def on(stream):
        log.append(("runs on", stream.name))
        yield

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append(("staging kept for", stream.name)),
                        raising=False)
    swap = HostSwap(pool(), memory_gb=8 * PAGE_BYTES / 2**30, copy_gbps=1e6)
    swap.cuda, swap.synchronous, swap.prefill_s = True, False, lambda n: 1.0
    swap.stream, swap.demotion_stream = Stream("copy"), Stream("demotions")
    before = swap.gpu_kv[:, :, [0, 1]].clone()

    swap.demote([0, 1], [3, 4])
    assert log == [("demotions", "waits for", "compute"), ("runs on", "demotions"),
                   ("staging kept for", "demotions"), ("event 1", "on", "demotions"),
                   ("event 2", "on", "compute")]
    log.clear()
    swap.demote([5], [6])
    assert swap.swap_out("s", [0, 1], 8)
    assert log[-4:] == [("copy", "waits for", "compute"), ("copy", "waits for", "event 3"),
                        ("runs on", "copy"), ("event 5", "on", "copy")]
    log.clear()
    swap.poll()
    swap.load([3, 4], [5, 7])
    assert log[0] == ("compute", "waits for", "event 3")
    assert torch.equal(swap.gpu_kv[:, :, [5, 7]], before)
    log.clear()
    assert swap.swap_in("s", [2, 3]) == 8
    assert log == [("copy", "waits for", "compute"), ("runs on", "copy"),
                   ("event 7", "on", "copy")]
    assert torch.equal(swap.gpu_kv[:, :, [2, 3]], before)
