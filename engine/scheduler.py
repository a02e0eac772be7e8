"""Continuous batching: which sequences run in the next step, and how many tokens each.

One step packs, under a token budget:
  1. every running sequence that is decoding (one token each), oldest first;
  2. running sequences still prefilling (chunked: as much of the prompt as the budget allows);
  3. waiting sequences, in policy order, while the budget, the sequence limit and free KV pages
     last. A new sequence first reuses the longest cached prefix of its prompt. Once one does
     not fit, no later one that needs its KV computed overtakes it; a sequence whose KV is
     already held (received from another engine) still may, since it only needs room to grow
     and finishing it frees its pages (else it could wait for ever behind a preempted sequence
     that needs the very pages it holds).
     A sequence whose prompt another running sequence is computing now (the `n` choices of
     one request) waits for it without holding anyone up: once that prompt's whole pages are
     in the prefix cache (and its scores, when both score it) it reuses them, so a prompt is
     prefilled once and the choices fork from it (`_waits_for_twin`). The same holds for a
     shared head: a sequence whose prompt begins with whole pages a running sequence is still
     computing (a few-shot template, an earlier turn of its conversation) waits until they
     are cached and computes only the rest (`_waits_for_prefix`; SGLang's in-batch prefix
     caching, BlendServe's intra-batch sharing). A live sequence never waits on background
     work, which may advance a few tokens a step.

Admission happens only when pages exist, so the engine never runs out of KV mid-step. When a
running sequence needs a page and none is left, the policy's victim (the newest running
sequence under FCFS) is preempted: its pages are released (whole pages stay in the prefix cache)
and it is recomputed later from prompt + output so far, unless a host KV tier
(`swapper`, engine/host_swap.py) takes its KV: then it waits on the host and, admitted again,
gets pages that its KV is copied back into (but for the whole pages of it the prefix cache
still holds, which it reuses), and resumes where it was. When that happens,
and how no step waits for a copy on a GPU, is engine/swap_scheduling.py's (mixed in here).

Background work (engine/background.py): while live work exists, sequences at or past the
background priority (a batch job's lines) get only a small room in each step, give their seats
and pages to live sequences, and are never promoted for starvation.

The policy (engine/policies.py) orders each group: FCFS keeps the queues' order; a ranked
policy (priority, mlfq) sorts decodes by rank, interleaves prefill chunks and admissions by
rank, and lets a waiting sequence that finds no seat or no pages take those of running
sequences it outranks (worst first; never a send in progress): preemption at iteration
granularity.

    sequence tokens:  [ computed (KV written) | to compute this step | rest ]
                      0                  num_computed          +num_new     num_tokens
    A step samples a token for a sequence when its chunk reaches num_tokens; once the step is
    launched, `advance` moves num_computed past the chunk.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.background import Background, PromptCredit, StepRoom
from engine.policies import FCFS, SchedulingPolicy
from engine.sequence import Sequence, SeqStatus
from engine.swap_scheduling import HostSwapping, KVSwapper
from kvcache.host_tier import HostState
from kvcache.manager import KVCacheManager


class AdapterSlots(Protocol):
    """What the scheduler asks of the LoRA adapters (engine/core/adapters.py): a sequence
    runs only while its adapter sits in a slot, and holds it there."""

    def acquire(self, seq: Sequence) -> bool:
        """Put the sequence's adapter in a slot (loading it, maybe evicting an idle one) and
        count the sequence as running on it. False if no slot can be had now."""

    def release(self, seq: Sequence) -> None:
        """The sequence stopped running (preempted, finished, aborted)."""

    def hold(self, seq: Sequence) -> None:
        """A send-only sequence (a remote_send's) entered the scheduler: its adapter stays
        registered while it is there (a generation's is held by the core's side table)."""

    def let_go(self, seq: Sequence) -> None:
        """That send-only sequence left the scheduler (`hold`'s end)."""


@dataclass
class _Admission:
    """One step's admission state."""

    # prompt key -> running sequences computing that prompt (Scheduler._prompts_computing)
    twins: dict[int, list[Sequence]] | None
    # a prompt's first page -> the same sequences, for heads shared by prompts that differ
    heads: dict[tuple[int, ...], list[Sequence]] | None = None
    # a sequence that must compute its KV did not fit: none ranked after it may be admitted
    blocked: bool = False
    blocked_background: bool = False  # the same for background ones: they bar only each other

    def bars(self, background: bool) -> bool:
        return self.blocked or (background and self.blocked_background)

    def block(self, background: bool) -> None:
        self.blocked_background |= background
        self.blocked |= not background


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    short_of_pages: bool = False  # a running sequence's growth preempted: admit nothing more
    prompt_only: bool = False  # no sequence decodes: the step had max_prefill_step_tokens

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler(HostSwapping):
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: SchedulingPolicy | None = None,
        adapters: AdapterSlots | None = None,
        swapper: KVSwapper | None = None,
        background: Background | None = None,
        max_prefill_step_tokens: int | None = None,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) and max_num_seqs "
                f"({max_num_seqs}) must be >= 1"
            )
        if max_prefill_step_tokens is not None and max_prefill_step_tokens < max_num_batched_tokens:
            raise ValueError(f"max_prefill_step_tokens ({max_prefill_step_tokens}) must be >= "
                             f"max_num_batched_tokens ({max_num_batched_tokens})")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        # the budget of a step with no decoding row: a long step then delays nobody's token
        self.max_prefill_step_tokens = max_prefill_step_tokens or max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy or FCFS()
        self.adapters = adapters  # None: no LoRA (every sequence runs the base)
        self.swapper = swapper  # None: no host KV tier (every preemption recomputes)
        # Copies that run beside compute (a GPU engine's own stream): swap out ahead of need,
        # copy back before admitting (see _swap_out_ahead); synchronous ones gain nothing
        self.proactive = swapper is not None and not swapper.synchronous
        self._prefill_pages = 0  # the running sequences' prompt chunks' growth (a step's)
        self.background = background  # None: no sequence is background
        self._prompt_credit = PromptCredit(background)  # gathered background prompts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0  # counter for /metrics
        # counters for /metrics: "pages" (a running sequence needed a page), "priority" (a
        # waiting sequence the policy ranks higher took the place)
        self.preemptions_by_reason: Counter[str] = Counter()

    def add(self, seq: Sequence) -> None:
        if seq.send_only and seq.lora_id:
            self.adapters.hold(seq)
        first_chunk = min(seq.num_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)
        self.policy.add(seq, first_chunk)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_owed(self) -> int:
        """Pages the first waiting sequence (in the policy's order) that holds no KV needs for
        its tokens: what pages reserved for other engines' transfers must leave it (0 if there
        is none)."""
        first = next((s for s in self.policy.admit_order(self.waiting)
                      if not self.kv.has(s.request_id)), None)
        return 0 if first is None else self.kv.pages_needed(None, first.num_tokens)

    def headroom(self) -> int:
        """Pages the scheduler's own work needs before any may be reserved for another
        engine's transfer: one per running sequence to grow into (the next decode step must
        not preempt), and what the first waiting sequence without KV needs."""
        return len(self.running) + self.pages_owed()

    def remove(self, seq: Sequence, keep_pages: bool = False) -> None:
        """Take a sequence out (finished or aborted) and release its pages, unless
        `keep_pages` (a finished send whose transfer still reads them; the caller frees them).
        A waiting sequence may hold pages too (KV prepared before admission)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release_adapter(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if self.swapper is not None:
            self.swapper.release(seq.request_id)
        if not keep_pages and self.kv.has(seq.request_id):
            self.kv.free(seq.request_id)
        seq.status = SeqStatus.FINISHED
        self.policy.remove(seq)
        if seq.send_only and seq.lora_id:
            self.adapters.let_go(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.swapper is not None:
            for seq_id in self.swapper.poll():  # copied out: their GPU pages are free now
                self.kv.free(seq_id)
            if self.proactive:
                self._note_prefill_growth()
                self._swap_out_ahead(out)
        active = self.policy.run_order([s for s in self.running if s.finish_reason is None])
        room = StepRoom.of(self.background, itertools.chain(active, self.waiting),
                           self._prompt_credit.credit)
        self.policy.refresh(s for s in itertools.chain(self.waiting, self.running)
                            if not self._is_background(s))
        decoding = [s for s in active if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in active if s.num_tokens - s.num_computed_tokens > 1]
        out.prompt_only = not decoding
        budget = self.max_num_batched_tokens if decoding else self.max_prefill_step_tokens
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            budget = self._run(seq, budget, out, room)
        # Prefill chunks, then admissions (FCFS); a ranked policy interleaves them by rank,
        # so a waiting sequence it ranks higher gets the budget before a running one's chunk.
        # No new work in a step that had to preempt for pages.
        waiting = self.policy.admit_order(self.waiting) if not out.short_of_pages else []
        if self.policy.preempts:
            work = sorted(prefilling + waiting, key=self.policy.rank)
        else:
            work = prefilling + waiting
        admission = _Admission(*self._prompts_computing())
        for seq in work:
            if budget == 0:
                break
            if seq.status is SeqStatus.RUNNING:
                budget = self._run(seq, budget, out, room)
            elif not out.short_of_pages and seq not in out.preempted:
                budget = self._admit(seq, budget, out, admission, room)
        self.policy.ran([(e.seq, e.num_new_tokens) for e in out.scheduled])
        self._prompt_credit.settle(room)
        if self.swapper is not None and self.waiting and not out.short_of_pages:
            self._prefetch()
        return out

    def _run(self, seq: Sequence, budget: int, out: SchedulerOutput, room: StepRoom) -> int:
        """Schedule a running sequence's next chunk (or decode token). Returns the budget left."""
        n = room.cap(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
        if n == 0:
            return budget  # background work past the step's room: it waits, holding its KV
        if self._grow_or_preempt(seq, seq.num_computed_tokens + n, out):
            out.scheduled.append(self._entry(seq, n))
            room.take(seq, n)
            budget -= n
        return budget

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The step's chunks are launched: their KV counts as computed. Returns the send-only
        sequences now fully computed (their pages must outlive them: the transfer reads them).
        """
        done = []
        for entry in out.scheduled:
            seq = entry.seq
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.send_only and seq.num_computed_tokens == seq.num_tokens:
                done.append(seq)
        return done

    def _entry(self, seq: Sequence, n: int) -> ScheduledSeq:
        last = seq.num_computed_tokens + n == seq.num_tokens
        return ScheduledSeq(seq, n, last and (not seq.send_only or seq.send_samples))

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Find pages for `seq` to hold `num_tokens`, preempting others as needed.
        Returns False if `seq` itself had to be preempted."""
        while not self.kv.allocate(seq.request_id, num_tokens):
            if self._settle_a_copy_out():
                continue
            candidates = [s for s in self.running if s.finish_reason is None]
            victim = self.policy.preemption_victim(candidates)
            self._preempt(victim, out, "pages")
            out.short_of_pages = True
            if victim is seq:
                return False
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_id:
            self.adapters.release(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, reason: str,
                 need_pages: bool = True, recomputed: int | None = None) -> int:
        """Take a running sequence out and queue it again: its KV swapped to the host, or
        its pages released for it to be recomputed. `need_pages`: the caller needs its pages
        now (else a copy out keeps them until it lands). `recomputed`: what recomputing it
        would compute, if known (see _swap_out). Returns the tokens this step had scheduled
        for it (given back to the budget by the caller)."""
        # first: if it raises, nothing has moved
        swapped = self._swap_out(seq, need_pages, recomputed)
        self.running.remove(seq)
        self._release_adapter(seq)
        if not swapped:
            self.kv.free(seq.request_id)
            seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        freed = sum(e.num_new_tokens for e in out.scheduled if e.seq is seq)
        out.scheduled[:] = [s for s in out.scheduled if s.seq is not seq]
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] += 1
        return freed

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput,
               admission: _Admission, room: StepRoom) -> int:
        """Admit a waiting sequence if it fits (a ranked policy may preempt running sequences
        it outranks to make it fit). Returns the budget left."""
        budget_for_it = room.cap(seq, budget)
        if budget_for_it == 0:
            return budget  # background work past the step's room: its turn is kept
        on_host = None if self.swapper is None else self.swapper.state(seq.request_id)
        if on_host is HostState.COPYING_OUT:  # its GPU pages are still there: keep them,
            if self.proactive and not self._leaves_growth(0):  # unless they are the ones the
                admission.block(self._is_background(seq))  # pool is short of
                return budget
            self.swapper.release(seq.request_id)
            on_host = None
        prepared = self.kv.has(seq.request_id)  # KV received or held since the call came
        background = self._is_background(seq)
        if admission.bars(background) and not prepared:
            return budget
        if not prepared and on_host is None and self._waits_for_twin(seq, admission.twins):
            return budget
        if len(self.running) >= self.max_num_seqs and self._outranked(seq) is None:
            if not prepared:  # no sequence ranked after it gets a seat either
                admission.block(background)
            return budget
        if self.proactive and on_host is HostState.COPYING_IN:
            return budget  # admitted once its copy back has landed (its pages are its own)
        if self.proactive and on_host is HostState.HELD:  # copied back while it waits first
            if not self._copy_back(seq):
                admission.block(background)  # too few pages: it keeps its turn
            return budget
        if not prepared and on_host is None and self._waits_for_prefix(seq, admission.heads):
            return budget
        if seq.lora_id and not self.adapters.acquire(seq):
            return budget  # every slot's adapter is running: it waits, holding no one up
        loaded = 0  # tokens of its cached prefix loaded from the host tier
        if prepared:
            reused = seq.num_computed_tokens
        elif on_host is HostState.HELD:  # its KV is copied below into fresh pages, after
            reused = seq.num_computed_tokens  # those of it the prefix cache still holds
            self.kv.open(seq.request_id, seq.token_at(0, reused), seq.lora_id)
        else:  # reuse cached KV for all but the last token: its logits are needed
            end = seq.num_tokens - 1
            if seq.prompt_logprobs is not None:  # nor any prompt token not yet scored
                end = min(end, seq.prompt_scored - 1)
            reused, loaded = self.kv.open_from_tiers(seq.request_id, seq.token_at(0, end),
                                                     seq.lora_id)
        n = min(seq.num_tokens - reused, budget_for_it)
        if (self.proactive and not prepared
                and not self._leaves_growth(self.kv.pages_needed(seq.request_id, reused + n))
                and not self._preemptable(seq, for_pages=True)):
            freed = None  # it would take pages the running sequences grow into next step
        else:
            freed = self._allocate_or_preempt(seq, reused + n, out)
        if freed is None:
            self._release_adapter(seq)
            if not prepared:
                self.kv.free(seq.request_id)
                admission.block(background)  # in policy order among those computing KV
            return budget
        budget += freed
        if len(self.running) >= self.max_num_seqs:  # the seat of one it outranks (see above)
            budget += self._preempt(self._outranked(seq), out, "priority", need_pages=False)
        if on_host is HostState.HELD:
            held = self.kv.page_table(seq.request_id)[: -(-reused // self.kv.page_size)]
            self.swapper.swap_in(seq.request_id, list(held),
                                 self.kv.num_cached_pages(seq.request_id))
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(reused, seq.num_prompt_tokens)
            # the host's pages come after the device's: the part of them within the prompt
            seq.num_host_cached_tokens = max(0, seq.num_cached_tokens - (reused - loaded))
        seq.num_computed_tokens = reused
        seq.status, seq.admitted = SeqStatus.RUNNING, True
        self.waiting.remove(seq)
        self.running.append(seq)
        out.scheduled.append(self._entry(seq, n))
        room.take(seq, n)
        if admission.twins is not None and self._computes_prompt(seq):
            self._add_computing(seq, admission.twins, admission.heads)
        return budget - n

    def _is_background(self, seq: Sequence) -> bool:
        return self.background is not None and self.background.of(seq)

    def _preemptable(self, seq: Sequence, for_pages: bool = False) -> list[Sequence]:
        """Running sequences waiting `seq` may preempt, worst first: those a ranked policy says
        it outranks (`for_pages`: to take their pages, only where the policy
        `takes_pages_to_admit`), and under any policy
        background ones if it is not background (background work gives way to live work). Not
        a send in progress (its transfer reads its pages as they are written) nor one whose
        last step is not resolved yet."""
        live = self.background is not None and not self.background.of(seq)
        ranked = self.policy.preempts and (not for_pages or self.policy.takes_pages_to_admit)
        if not ranked and not live:
            return []
        victims = [r for r in self.running if r.finish_reason is None and not r.send_only
                   and ((ranked and self.policy.outranks(seq, r))
                        or (live and self._is_background(r)))]
        return sorted(victims, key=self.policy.rank, reverse=True)

    def _outranked(self, seq: Sequence) -> Sequence | None:
        """The running sequence `seq` may take the seat of, if any."""
        return next(iter(self._preemptable(seq)), None)

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int,
                             out: SchedulerOutput) -> int | None:
        """Pages for waiting `seq` to hold `num_tokens`, preempting running sequences it
        outranks (worst first) when their pages would make it fit. Returns the tokens this
        step had scheduled for those preempted (back to the budget); None, preempting
        nothing, if it cannot fit."""
        if self.kv.allocate(seq.request_id, num_tokens):
            return 0
        victims = self._preemptable(seq, for_pages=True)
        if not victims:
            return None
        stats = self.kv.stats()  # an upper bound: pages shared with others are not freed
        reachable = stats.free_pages + stats.cached_pages + sum(
            len(self.kv.page_table(v.request_id)) for v in victims)
        if reachable < self.kv.pages_needed(seq.request_id, num_tokens):
            return None
        freed = 0
        for victim in victims:
            freed += self._preempt(victim, out, "priority")
            if self.kv.allocate(seq.request_id, num_tokens):
                return freed
        return None  # the victims' pages were shared after all; they are recomputed later

    # ---- the n choices of a prompt: one prefill -----------------------------------------------
    #
    # Choices arrive together and would all be admitted before any page of their prompt is
    # cached (a step's budget holds several short prompts; a long one is chunked and its
    # twins are admitted beside its last chunk), each computing the whole prompt. So a waiting
    # sequence whose prompt a running one is still computing is skipped (its turn is kept: it
    # does not block the sequences behind it) until that prompt's whole pages are cached; it
    # then computes only the tail past the last whole page. Scores (prompt_logprobs) are
    # handed over by the core the moment the twin's are complete (EngineCore._share_scores).

    def _prompts_computing(self) -> tuple[dict[int, list[Sequence]] | None,
                                          dict[tuple[int, ...], list[Sequence]] | None]:
        """Running sequences still computing their prompts, by prompt key and by first page;
        (None, None) without a prefix cache (nothing would be shared: no sequence waits)."""
        if not self.kv.enable_prefix_cache or not self.waiting:
            return None, None
        twins: dict[int, list[Sequence]] = {}
        heads: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in self.running:
            if seq.finish_reason is None and self._computes_prompt(seq):
                self._add_computing(seq, twins, heads)
        return twins, heads

    def _add_computing(self, seq: Sequence, twins: dict[int, list[Sequence]],
                       heads: dict[tuple[int, ...], list[Sequence]]) -> None:
        """List `seq`, which is computing its prompt, by prompt key and (past a page) by head."""
        twins.setdefault(seq.prompt_key, []).append(seq)
        if seq.num_prompt_tokens > self.kv.page_size:
            heads.setdefault(self._head(seq), []).append(seq)

    def _head(self, seq: Sequence) -> tuple[int, ...]:
        return tuple(seq.prompt_token_ids[: self.kv.page_size])

    def _waits_for_prefix(self, seq: Sequence,
                          heads: dict[tuple[int, ...], list[Sequence]] | None) -> bool:
        """Whether a running sequence is computing whole pages at the head of `seq`'s prompt
        that the prefix cache does not hold yet: `seq` would compute them again beside it.
        Not for a sequence scoring its prompt (it reuses no KV), nor for a live sequence
        behind background work."""
        ps = self.kv.page_size
        if not heads or seq.prompt_logprobs is not None or seq.num_prompt_tokens <= ps:
            return False
        candidates = heads.get(self._head(seq))
        if not candidates:
            return False
        prompt, background = seq.prompt_token_ids, self._is_background(seq)
        reusable = (seq.num_prompt_tokens - 1) // ps  # pages: all but the last token's
        for t in candidates:
            if t.lora_id != seq.lora_id or (not background and self._is_background(t)):
                continue
            cached = self.kv.num_cached_pages(t.request_id)
            if cached >= min(reusable, (t.num_prompt_tokens - 1) // ps):
                continue  # nothing more of its prompt that `seq` could reuse
            # Does `seq` share the page t computes next (t caches in order)? Its first page
            # and that one are compared, not all between: a page-sized compare per candidate
            # however long the head, for every waiting sequence a step looks at. A false
            # match (prompts equal at both pages, not between) only delays `seq` until t has
            # cached that page; admission then reuses what the cache really holds.
            start = cached * ps
            if t.prompt_token_ids[start : start + ps] == prompt[start : start + ps]:
                return True
        return False

    def _computes_prompt(self, seq: Sequence) -> bool:
        """Whether a sequence holding pages has not yet cached the whole pages of its prompt
        that a twin reuses (all but the last token's: they are cached once the step computing
        them is resolved) or not yet scored its prompt."""
        if seq.send_only:  # a remote_send's tokens may be a prompt's head only
            return False
        reusable_pages = (seq.num_prompt_tokens - 1) // self.kv.page_size
        return self.kv.num_cached_pages(seq.request_id) < reusable_pages or (
            seq.prompt_logprobs is not None and seq.prompt_scored < seq.num_prompt_tokens)

    @staticmethod
    def _waits_for_twin(seq: Sequence, twins: dict[int, list[Sequence]] | None) -> bool:
        """Whether a running sequence computes the very prompt `seq` needs, and what it
        leaves (cached pages; scores of the same number of top tokens) is what `seq` reuses."""
        if not twins or seq.prompt_key not in twins:
            return False
        scores = seq.params.prompt_logprobs
        return any(t.prompt_token_ids == seq.prompt_token_ids and t.lora_id == seq.lora_id
                   and (scores is None or t.params.prompt_logprobs == scores)
                   for t in twins[seq.prompt_key])
