"""The scheduler's half of the host KV tier (engine/host_swap.py): when a preempted sequence's
KV goes to the host, when it comes back, and, where copies run beside compute (a GPU engine's
own stream), how no step waits for one. Mixed into engine/scheduler.py's Scheduler, whose
fields it uses (`kv`, `swapper`, `running`, `waiting`, `policy`, `max_num_seqs`,
`max_prefill_step_tokens`, `proactive`, `_prefill_pages`) and whose `_preempt` and `_outranked`
it calls.

Proactive swapping (FastServe's), where copies run beside compute:

    before a step   pages an allocation could take + pages copies out in flight give back
                    < what the running sequences may take next step (a page each, and a
                    step's budget of prompt chunks)
                    -> the policy's next victim is copied out now ("ahead"); its GPU pages are
                       freed when the copy lands, steps later
    a page short    wait for the oldest copy out in flight and take its pages; only with none
                    in flight preempt, and wait for that copy
    coming back     the swapped sequences the policy admits next get fresh pages and their
                    copies back start while they wait; each is admitted once its copy landed
    admitting       a sequence's pages must leave the running sequences their next step's
                    growth, or it waits: the one admitted into the last free pages would be
                    the next one copied out

Where copies are synchronous (CPU; tensor parallel on GPUs) none of this gains anything: a
sequence is swapped out when preempted and copied back at its admission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.sequence import Sequence
from kvcache.host_tier import HostState

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput


class KVSwapper(Protocol):
    """What the scheduler asks of the host KV tier (engine/host_swap.py's HostSwap)."""

    synchronous: bool  # a copy has landed when its call returns (CPU, tensor parallel)

    def state(self, seq_id: str) -> HostState | None:
        """Where the sequence's KV is on the host; None: it has none there."""

    def would_swap(self, num_tokens: int, recompute_tokens: int) -> bool:
        """Whether swapping a sequence beats recomputing it (counts nothing)."""

    def wants(self, num_tokens: int, recompute_tokens: int) -> bool:
        """Whether swapping a preempted sequence beats recomputing it."""

    def copying_out(self) -> list[str]:
        """The sequences whose copy out is in flight, oldest first."""

    def swap_out(self, seq_id: str, gpu_pages: list[int], num_tokens: int,
                 beside: bool = False) -> bool:
        """Start the copy out (COPYING_OUT; HELD at once where copies are synchronous). The
        GPU pages must stay held until it lands. `beside`: steps run while it does (it may
        copy slower, and slow them less). False, copying nothing: host pool full."""

    def settle_out(self, seq_id: str) -> None:
        """Wait for the copy out to land (now HELD)."""

    def swap_in(self, seq_id: str, gpu_pages: list[int], skip: int = 0,
                beside: bool = False) -> int:
        """Start the copy of a HELD sequence's KV into `gpu_pages`, but for the first `skip`
        (held on the GPU already); `beside` as swap_out's. Returns its tokens."""

    def poll(self) -> list[str]:
        """Settle the copies that landed; returns those whose copy out did."""

    def release(self, seq_id: str) -> int:
        """Free its host pages, in any state (waits out a copy in flight)."""


class HostSwapping:
    """Swapping to the host tier, for the Scheduler (see the module's docstring)."""

    def _prefetch(self) -> None:
        """Start copying back the KV of the waiting sequence the policy admits next, if it is
        on the host, will find a seat (one is free, or it outranks a running sequence) and
        free pages hold it beside a page of growth per running sequence: the copy then
        overlaps this step, and the sequence is admitted later as one whose KV is held (as a
        received one is). Where copies run beside compute: `_prefetch_in_order`."""
        if self.proactive:
            self._prefetch_in_order()
            return
        first = next(iter(self.policy.admit_order(self.waiting)))
        rid = first.request_id
        if self.swapper.state(rid) is not HostState.HELD:
            return
        if len(self.running) >= self.max_num_seqs and self._outranked(first) is None:
            return  # it would hold its pages while it waits for a seat
        need = self.kv.pages_needed(None, first.num_computed_tokens)
        if self.kv.stats().free_pages < need + len(self.running):
            return
        self._start_copy_back(first)

    def _prefetch_in_order(self) -> None:
        """Copies back beside compute: start those of the swapped sequences the policy admits
        next, in its order, while seats and pages (beyond the next step's growth) hold them.
        Stops at the first sequence that would compute KV (its turn comes first) or that
        does not fit."""
        seats = self.max_num_seqs - len(self.running)
        for seq in self.policy.admit_order(self.waiting):
            state = self.swapper.state(seq.request_id)
            if state is HostState.COPYING_IN or self.kv.has(seq.request_id):
                seats -= 1  # KV held or on its way: it takes the next seat
                continue
            if state is not HostState.HELD:
                return
            if seats <= 0 and self._outranked(seq) is None:
                return  # it would hold its pages while it waits for a seat
            if not self._copy_back(seq):
                return
            seats -= 1

    def _start_copy_back(self, seq: Sequence) -> None:
        """Pages for a HELD sequence's KV, and the copy back into them (it waits on): the
        leading ones the prefix cache still holds on the GPU are reused, not copied. The
        running sequences' steps go on beside it, if any."""
        rid = seq.request_id
        self.swapper.swap_in(rid, self._open_for_copy_back(seq),
                             self.kv.num_cached_pages(rid), beside=bool(self.running))

    def _open_for_copy_back(self, seq: Sequence) -> list[int]:
        """A page table for a HELD sequence's KV: the whole pages of it still cached on the
        GPU (its own, unless evicted since), then fresh ones. Returns it."""
        rid, n = seq.request_id, seq.num_computed_tokens
        self.kv.open(rid, seq.token_at(0, n), seq.lora_id)
        self.kv.allocate(rid, n)
        return list(self.kv.page_table(rid))

    # ---- proactive swapping, where copies run beside compute ----------------------------------

    def _note_prefill_growth(self) -> None:
        """The pages the running sequences' prompt chunks may take in the next step (at most a
        step's budget of them), once a step: O(running)."""
        prefill = sum(s.num_tokens - s.num_computed_tokens - 1 for s in self.running
                      if s.num_tokens - s.num_computed_tokens > 1)
        self._prefill_pages = self.kv.pages_needed(None, min(prefill, self.max_prefill_step_tokens))

    def _growth_pages(self) -> int:
        """Pages the running sequences may take in the next step, at most: a page each, and
        their prompt chunks'."""
        return len(self.running) + self._prefill_pages

    def _leaves_growth(self, need: int) -> bool:
        """Whether taking `need` pages now leaves the next step's growth (of one more
        running sequence) available."""
        return self.kv.num_available_pages() - need >= self._growth_pages() + 1

    def _swap_out_ahead(self, out: SchedulerOutput) -> None:
        """While the pages allocations can take, with those the copies out in flight will give
        back, are fewer than the next step's growth, copy the policy's next victim out now,
        beside compute, instead of waiting for its copy in the step that runs short. Only a
        victim that swapping suits (a page short would recompute it) and never the last one
        running."""
        while len(self.running) > 1:
            coming = sum(len(self.kv.page_table(s)) for s in self.swapper.copying_out()
                         if self.kv.has(s))
            if self.kv.num_available_pages() + coming >= self._growth_pages():
                return
            candidates = [s for s in self.running if s.finish_reason is None]
            if not candidates:
                return
            victim = self.policy.preemption_victim(candidates)
            computed = victim.num_computed_tokens
            if (victim.send_only or computed == 0
                    or self.swapper.state(victim.request_id) is not None
                    or not self.swapper.would_swap(computed, computed)):
                return
            self._preempt(victim, out, "ahead", need_pages=False, recomputed=computed)

    def _copy_back(self, seq: Sequence) -> bool:
        """Start copying a HELD sequence's KV back if pages for it leave the next step's
        growth (its pages still cached count as free: they are among the evictable).
        False: too few pages."""
        if not self._leaves_growth(self.kv.pages_needed(None, seq.num_computed_tokens)):
            return False
        self._start_copy_back(seq)
        return True

    def _settle_a_copy_out(self) -> bool:
        """A page is short: wait for the oldest copy out in flight and free its GPU pages
        (sooner than preempting another). False if none is in flight."""
        if self.swapper is None:
            return False
        for seq_id in self.swapper.copying_out():
            self.swapper.settle_out(seq_id)
            if self.kv.has(seq_id):
                self.kv.free(seq_id)
            return True
        return False

    def _swap_out(self, seq: Sequence, need_pages: bool, recomputed: int | None = None
                  ) -> bool:
        """Swap a sequence being preempted to the host if that beats recomputing it. Its GPU
        pages are released once the copy lands: now if `need_pages`. False: recompute it.

        What a recompute would compute (unless `recomputed` says): for a seat given up
        (`need_pages` False) the pages stay in the prefix cache and only what it did not
        cache is recomputed; when its pages are taken because they are short (now, or ahead
        of need), the cache gives them away next (eviction), so all of it would be."""
        rid, computed = seq.request_id, seq.num_computed_tokens
        if self.swapper is None or seq.send_only or computed == 0:
            return False
        if self.swapper.state(rid) is not None:  # its copy back has not landed yet: wait for
            self.swapper.release(rid)  # it (the GPU pages then hold the KV), free the host's
        if recomputed is None:
            cached = 0 if need_pages else self.kv.num_cached_pages(rid) * self.kv.page_size
            recomputed = computed - min(cached, computed)
        if not self.swapper.wants(computed, recomputed):
            return False
        pages = self.kv.page_table(rid)[: self.kv.pages_needed(None, computed)]
        # unless its pages are needed now (the copy then waited for), steps run beside it
        if not self.swapper.swap_out(rid, list(pages), computed, beside=not need_pages):
            return False
        if need_pages:
            self.swapper.settle_out(rid)
        if self.swapper.state(rid) is HostState.HELD:
            self.kv.free(rid)
        return True
