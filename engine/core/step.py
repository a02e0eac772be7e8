"""The engine core's step: launch the next batch on the device, resolve the last one's tokens.

A step launches work on the device and resolves sampled tokens into outputs. With async
scheduling (CUDA), step N is launched before step N-1's tokens are read back, so the host
prepares N while the GPU still runs N-1:

  host:  launch N-1 | resolve N-2 | launch N | resolve N-1 | launch N+1 | ...
  GPU:        [ step N-1 ......... ][ step N ............ ][ step N+1 ...

A token sampled by the step in flight is a placeholder (PENDING) in output_token_ids; the
next step's input for it is filled on the device from the sampled ids. Stopping on eos
is learned one step late: that step's extra token for the sequence is dropped.

A constrained sequence's mask for step N depends on its token of step N-1. When step
N-1 sampled one, step N's forward pass is launched first and its sampling after N-1 is
resolved and the masks computed, so the GPU runs N's forward pass meanwhile:

  host:  launch N-1 | forward N | resolve N-1, masks | sample N | forward N+1 | ...
  GPU:        [ step N-1 ...... ][ forward N ............ ][sample N][ forward N+1 ...

The state that travels from a launch to its resolve is a `LaunchedStep`; what the scheduler's
output becomes on its way to the model runner is a `Batch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.loop_stats import DeviceTimeline
from engine.penalties import StepAdjustments
from engine.sampler import PendingSample
from engine.scheduler import SchedulerOutput
from engine.sequence import PENDING, SeqStatus, Sequence
from kvcache.forward import ForwardBatch, KVSend, SeqForward
from microserve.messages import FinishReason, SamplingParams, TokenOutput

# How long an asynchronous step waits for the KV of sends it computed to land before the
# next step, so their answers go out now and not one step later (KVExchange.await_flushes):
# a step's copy takes 1-5 ms on an H100 (bench.transfer), a step with prefill 30-70 ms.
FLUSH_WAIT_S = 0.02


class Batch(NamedTuple):
    """A scheduled step as the model runner takes it (built by `StepPipeline._build_batch`)."""

    forward: ForwardBatch
    input_ids: list[int]  # every scheduled token, packed
    sample_rows: list[int]  # the rows of input_ids whose logits are sampled
    # (input index, previous sample row) of inputs still pending on the device
    from_last: list[tuple[int, int]]
    sends: list[KVSend]  # the KV sends this step's pages are marked for
    # prompt tokens to score (SamplingParams.prompt_logprobs): (row, (sequence, token index))
    scored: list[tuple[int, tuple[Sequence, int]]]
    lora_slots: list[int] | None  # each input's LoRA slot (-1: the base); None: LoRA off


class SampleArgs(NamedTuple):
    """What the sampled rows are sampled with, taken at launch (a sequence may be removed
    before a deferred sample, and min_tokens counts the outputs before this step's)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    adjust: StepAdjustments | None


@dataclass
class LaunchedStep:
    """A step on its way: what ran, and the tokens it is sampling (slot = the placeholder's
    index in the sequence's output_token_ids; None for a send's token)."""

    scheduled: list[Sequence]
    sampled: list[tuple[Sequence, int | None]]
    length_done: list[Sequence]  # reach max_tokens / max_model_len with this step's token
    sample_args: SampleArgs
    logits: torch.Tensor | None = None  # forward done, sampling deferred (set to None by _sample)
    pending: PendingSample | None = None  # None until sampled (set by _sample), and when no row is
    # prompt tokens this step scores: (sequence, token index) per row, and their logprobs on
    # the way (ModelRunner.score)
    scored: list[tuple[Sequence, int]] = field(default_factory=list)
    scores: list[PendingSample] = field(default_factory=list)
    done: torch.cuda.Event | None = None  # fires once the step ran (DeviceTimeline.end)
    # fires when config.launch_ahead_layers of its layers are left (ModelRunner.near_end);
    # None: none recorded, or already seen fired (launch_ready)
    near_end: torch.cuda.Event | None = None


class StepPipeline:
    """`step()` and what it takes. Mixed into EngineCore, whose fields it reads: runner,
    scheduler, kv, requests, exchange, grammars, penalties, loop, max_model_len, host_swap."""

    _in_flight: LaunchedStep | None  # async: the step launched, not yet resolved
    _pending_rows: dict[str, int]  # seq id -> its row in the last launch's sample
    device_timeline: DeviceTimeline

    def step(self) -> list[TokenOutput]:
        masks_wait = self._in_flight is not None and self._constrains(self._in_flight)
        launched = self._launch(sample_now=not masks_wait)
        if not self.async_scheduling:
            self.stalled = launched is None
            return self._resolve(launched) if launched else []
        previous, self._in_flight = self._in_flight, launched
        self.stalled = launched is None and previous is None
        outputs = self._resolve(previous) if previous else []
        if launched is not None and launched.logits is not None:
            self._sample(launched)
        if launched is not None and previous is not None:  # the device is busy with the next
            sent = [seq.request_id for seq in previous.scheduled if seq.send_only]
            if sent:
                self.exchange.await_flushes(sent, FLUSH_WAIT_S)
        return outputs

    def launch_ready(self) -> bool:
        """Whether the next step should be launched now: False only while the step in flight
        has a near-end mark (config.launch_ahead_layers) the GPU has not reached. The core
        loop takes messages until then (CoreLoop._hold_launch)."""
        launched = self._in_flight
        if launched is None or launched.near_end is None:
            return True
        if not launched.near_end.query():
            return False
        launched.near_end = None
        return True

    def _count(self, sched: SchedulerOutput) -> None:
        loop = self.loop
        loop.steps += 1
        for e in sched.scheduled:
            start = e.seq.num_computed_tokens
            prompt_end = min(start + e.num_new_tokens, e.seq.num_prompt_tokens)
            loop.prompt_tokens_computed += max(0, prompt_end - start)
            loop.tokens_sampled += e.sample

    def _constrains(self, launched: LaunchedStep) -> bool:
        return len(self.grammars) > 0 and any(
            seq.request_id in self.grammars for seq, _ in launched.sampled)

    def _launch(self, sample_now: bool = True) -> LaunchedStep | None:
        """Launch the next step's forward pass and, if `sample_now`, its sampling (else
        `_sample` must follow)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        self._count(sched)
        batch = self._build_batch(sched)
        if self.host_swap is not None:  # KV copied back from the host lands first
            self.host_swap.before_forward([e.seq.request_id for e in sched.scheduled])
        sampled = [e.seq for e in sched.scheduled if e.sample]
        args = SampleArgs([seq.params for seq in sampled], self.requests.generators(sampled),
                          self.penalties.step(sampled))
        decodes = len(sched.scheduled) if all(
            e.num_new_tokens == 1 for e in sched.scheduled) else 0
        # (a step of one-token prompts alone counts as decode-only: the two never overlap)
        prompt_only = sched.num_tokens if sched.prompt_only and not decodes else 0
        started = self.device_timeline.begin(decodes, prompt_only)
        logits = self.runner.forward(batch.forward, batch.input_ids, batch.sample_rows,
                                     from_last=batch.from_last, sends=batch.sends,
                                     lora_slots=batch.lora_slots)
        scores = []
        if batch.scored:
            rows, targets, num_top = zip(*((row, seq.prompt_token_ids[j],
                                            seq.params.prompt_logprobs)
                                           for row, (seq, j) in batch.scored))
            scores = self.runner.score(list(rows), list(targets), list(num_top))
        for seq in self.scheduler.advance(sched):  # sends computed: their pages stay for the flush
            self.scheduler.remove(seq, keep_pages=True)
            self.exchange.computed(seq)
        slots, length_done = [], []
        self._pending_rows = {}
        for row, seq in enumerate(sampled):
            if seq.send_only:  # done sending: its token goes back with the KV (_resolve)
                slots.append(None)
                continue
            seq.output_token_ids.append(PENDING)
            slots.append(len(seq.output_token_ids) - 1)
            self._pending_rows[seq.request_id] = row
            p = seq.params
            if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH  # known now; the scheduler skips it
                length_done.append(seq)
        launched = LaunchedStep(
            scheduled=[e.seq for e in sched.scheduled], sampled=list(zip(sampled, slots)),
            length_done=length_done, sample_args=args, logits=logits,
            scored=[s for _, s in batch.scored], scores=scores, near_end=self.runner.near_end)
        if logits is not None and sample_now:
            self._sample(launched)
        launched.done = self.device_timeline.end(started)
        return launched

    def _sample(self, launched: LaunchedStep) -> None:
        """Sample a launched step's logits, its constrained rows under their grammars' masks
        (computed when their previous tokens were resolved)."""
        mask = None
        if len(self.grammars):
            mask = self.grammars.step_mask([seq.request_id for seq, _ in launched.sampled])
        args = launched.sample_args
        launched.pending = self.runner.sample(launched.logits, args.params, args.generators,
                                              mask, args.adjust)
        launched.logits = None

    def _build_batch(self, sched: SchedulerOutput) -> Batch:
        """The step's Batch: what the model runner takes for `sched`."""
        seqs, input_ids, sample_rows, from_last, sends, scored = [], [], [], [], [], []
        for entry in sched.scheduled:
            seq, n = entry.seq, entry.num_new_tokens
            start = seq.num_computed_tokens
            seqs.append(SeqForward(seq.request_id, start, n, self.kv.page_table(seq.request_id)))
            if seq.prompt_logprobs is not None:  # position p's logits score prompt token p + 1
                first = max(start, seq.prompt_scored - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                row = len(input_ids) - start
                scored += [(row + p, (seq, p + 1)) for p in range(first, last)]
            input_ids.extend(seq.token_at(start, start + n))
            if input_ids[-1] == PENDING:  # only a sequence's newest token can be pending
                from_last.append((len(input_ids) - 1, self._pending_rows[seq.request_id]))
            if entry.sample:
                sample_rows.append(len(input_ids) - 1)
            if seq.send_only and (send := self.exchange.sends_for(seq, start, n)) is not None:
                sends.append(send)
        forward = ForwardBatch(seqs, self.kv.page_size, self.kv.take_table_changes())
        lora_slots = None
        if self.adapters is not None:
            lora_slots = [slot for e in sched.scheduled
                          for slot in [self.adapters.slot_of(e.seq)] * e.num_new_tokens]
        return Batch(forward, input_ids, sample_rows, from_last, sends, scored, lora_slots)

    def _resolve(self, launched: LaunchedStep) -> list[TokenOutput]:
        """Read a launched step's tokens back; emit outputs, finish and free sequences."""
        result = None
        waited = time.perf_counter()
        if launched.pending is not None:
            result = launched.pending.result()
        else:
            # Nothing to read back (a prefill engine's steps sample nothing): wait for the
            # step all the same, so the host stays one step ahead of the device, as it does
            # where tokens are read back. Unbounded, it launched every prompt chunk the moment
            # it arrived, each into a step of its own behind all the others: steps half full
            # where waiting would have filled them, and a queue inside the GPU that the
            # scheduler could neither see nor reorder.
            self.device_timeline.wait(launched.done)
        if launched.scores:
            self._fill_prompt_logprobs(launched)
        self.loop.device_wait_seconds += time.perf_counter() - waited
        outputs, done = [], list(launched.length_done)
        constrained = []  # requests whose grammar goes on: their next masks are computed below
        for k, (seq, slot) in enumerate(launched.sampled):
            if seq.send_only:
                self.exchange.sampled(seq.request_id, result.token_ids[k])
                continue
            if seq.status is SeqStatus.FINISHED:  # aborted, or stopped at an earlier token
                continue
            token = result.token_ids[k]
            seq.output_token_ids[slot] = token
            stop = seq.params.stops_on(token, self.eos_token_ids)
            if not stop and seq.request_id in self.grammars:
                stop = self.grammars.accept(seq.request_id, token)  # the grammar is complete
            if stop:
                seq.finish_reason = FinishReason.STOP
                del seq.output_token_ids[slot + 1 :]  # a token launched after it is dropped
                done.append(seq)
            final = seq in done  # a LENGTH decided by a later launch is not reported yet
            if not final and seq.request_id in self.grammars:
                constrained.append(seq.request_id)
            outputs.append(self._output(seq, [token], result.logprobs[k], final))
        self.grammars.fill_masks(constrained)
        for seq in launched.scheduled:
            if seq.status is not SeqStatus.FINISHED:
                self._cache_new_pages(seq)
        for seq in done:
            if seq.status is not SeqStatus.FINISHED:
                self._remove(seq)
        return outputs

    def _fill_prompt_logprobs(self, launched: LaunchedStep) -> None:
        entries = [e for pending in launched.scores for e in pending.result().logprobs]
        touched = {}
        for (seq, j), entry in zip(launched.scored, entries):
            if seq.prompt_logprobs is not None:  # else its first output went out already
                seq.prompt_logprobs[j] = entry
                touched[id(seq)] = seq
        for seq in touched.values():
            scores, k = seq.prompt_logprobs, seq.prompt_scored
            while k < len(scores) and scores[k] is not None:
                k += 1
            seq.prompt_scored = k
            if k == len(scores):
                self._share_scores(seq)

    def _share_scores(self, scored: Sequence) -> None:
        """Hand a prompt's complete scores to the waiting sequences that score the same prompt
        the same way and hold no KV yet (the other `n` choices of a request: they waited for
        it, Scheduler._waits_for_twin): they then reuse its cached pages instead of computing
        the prompt again to score it."""
        for seq in self.scheduler.waiting:
            if (seq.prompt_logprobs is not None and seq.prompt_scored < seq.num_prompt_tokens
                    and seq.prompt_key == scored.prompt_key
                    and seq.params.prompt_logprobs == scored.params.prompt_logprobs
                    and seq.prompt_token_ids == scored.prompt_token_ids
                    and not self.kv.has(seq.request_id)):
                seq.prompt_logprobs = list(scored.prompt_logprobs)
                seq.prompt_scored = seq.num_prompt_tokens

    def _cache_new_pages(self, seq: Sequence) -> None:
        """Offer newly completed whole pages to the prefix cache (cheap check first). Every
        token whose KV is written is known on the host by now."""
        rid = seq.request_id
        if self.kv.has(rid) and seq.num_computed_tokens // self.kv.page_size > (
            self.kv.num_cached_pages(rid)
        ):
            self.kv.cache_tokens(rid, seq.token_at(0, seq.num_computed_tokens))
