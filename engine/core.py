"""The engine core: requests in, one step at a time, token ids out.

Single-threaded and synchronous on purpose. It runs in its own process (engine/core_proc.py),
so HTTP parsing, JSON and detokenization in the frontend process never sit on the step loop's
critical path; tests also drive it in-process.

Every request the engine knows is in one table (engine/requests.py), in one state. The core
moves generations (GENERATING) and is the only one to add sequences to the scheduler or take
them out; the KV exchange moves the transfer states and returns the send-only sequences to
schedule or drop. So the calls that start or stop scheduled work come through the core
(`add_request`, `remote_send`, `abort_request`, `poll`); the receiver's calls (`prep_recv`,
`commit`) and the lease and wait bookkeeping are the exchange's alone.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarMatchers
from engine.kv_exchange import Answer, KVExchange
from engine.kv_sender import queue_timeout
from engine.loop_stats import LoopCounters
from engine.model_runner import ModelRunner, resolve_dtype
from engine.models import fp8
from engine.penalties import PenaltyPool, StepAdjustments
from engine.requests import RequestState, RequestTable
from engine.sampler import PendingSample, make_generator
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PENDING, SeqStatus, Sequence
from engine.validation import check_request, resolve_index
from kvcache.forward import ForwardBatch, SeqForward
from kvcache.manager import KVCacheManager
from kvcache.transfer import KVLayout, make_backend
from kvcache.transfer.sender import KVSender
from microserve.backend import MicroservingError
from microserve.messages import (EngineInfo, EngineStats, FinishReason, KVAddr, SamplingParams,
                                 TokenOutput)

# How long an asynchronous step waits for the KV of sends it computed to land before the
# next step, so their answers go out now and not one step later (KVExchange.await_flushes):
# a step's copy takes 1-5 ms on an H100 (bench.transfer), a step with prefill 30-70 ms.
FLUSH_WAIT_S = 0.02

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step on its way: what ran, and the tokens it is sampling (slot = the placeholder's
    index in the sequence's output_token_ids)."""

    scheduled: list[Sequence]
    sampled: list[tuple[Sequence, int]]
    pending: PendingSample | None  # None until sampled, and when no row is
    length_done: list[Sequence]  # reach max_tokens / max_model_len with this step's token
    logits: torch.Tensor | None = None  # forward done, sampling deferred (see step)
    # the sampled rows' params, generators and logit adjustments
    sample_args: tuple[list, list, StepAdjustments | None] = ([], [], None)
    # prompt tokens this step scores (SamplingParams.prompt_logprobs): (sequence, token
    # index) per row, and their logprobs on the way (ModelRunner.score)
    scored: list[tuple[Sequence, int]] = field(default_factory=list)
    scores: list[PendingSample] = field(default_factory=list)


class EngineCore:
    """Args:
        config: what to run.
        transfer_key: the deployment's KV transfer key (microserve/transfer_auth.py). Without
            it this engine neither receives KV (`--kv-transfer auto` means none) nor sends it.
    """

    def __init__(self, config: EngineConfig, transfer_key: bytes | None = None):
        self.config = config
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        dtype = resolve_dtype(config.dtype, config.device)
        self.runner = ModelRunner(config, dtype)
        mc = self.runner.config
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, mc)
        num_pages = self.runner.num_pages_for(self.max_model_len)
        kv_dtype = str(self.runner.kv_dtype).removeprefix("torch.")
        layout = KVLayout(mc.name, kv_dtype, config.page_size,
                          mc.num_layers, mc.num_kv_heads, mc.head_dim)  # fmt: skip
        kind = config.resolved_kv_transfer(has_key=transfer_key is not None)
        if kind != config.resolved_kv_transfer(has_key=True):
            log.info("KV transfer off: no engine key (--api-key) to authenticate it with")
        self.transfer = make_backend(
            kind, layout, num_pages, self.runner.device,
            host=config.kv_transfer_host, port=config.kv_transfer_port,
            advertise_host=config.kv_transfer_advertise_host, key=transfer_key,
            nvshmem_group=config.nvshmem_group,
        )  # fmt: skip
        num_pages = self.transfer.kv.shape[2]  # nvshmem: the group's smallest pool
        self.runner.allocate_kv(num_pages, self.max_model_len, pool=self.transfer.kv)
        self.kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs)
        self.requests = RequestTable()
        # The transfer thread wakes the step loop through this pipe when a send completes.
        self.wakeup_fd, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_w, False)
        sender = KVSender(self.transfer.kv, layout, notify=self._wake, key=transfer_key)
        self.runner.kv.sender = sender
        self.exchange = KVExchange(self.kv, self.requests, self.scheduler.headroom,
                                   mc.vocab_size, self.transfer, sender, layout,
                                   config.kv_lease_s, config.kv_lease_max_s,
                                   config.kv_recv_wait_s, config.kv_recv_wait_max_s)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammars = GrammarMatchers(config.model, mc.vocab_size, sorted(self.eos_token_ids))
        self.penalties = PenaltyPool(mc.vocab_size, self.runner.device, sorted(self.eos_token_ids))
        self._arrivals = itertools.count()
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None
            else self.runner.cuda
        )  # fmt: skip
        self._in_flight: _Launched | None = None  # async: the step launched, not yet resolved
        # The last step found work but could schedule none of it (waiting for KV pages that
        # only a message, a finished send or a lease's end can free): the loop then waits.
        self.stalled = False
        self._pending_rows: dict[str, int] = {}  # seq id -> its row in the last launch's sample
        self.counters = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0,
                         "generate_queue_timeouts": 0}
        # generations failed before a step started on them (their queue_s passed), for the
        # core process to answer: taken by `take_rejected`
        self._rejected: list[tuple[str, MicroservingError]] = []
        self.loop = LoopCounters()  # steps and tokens here; the core process adds its time
        self.info = EngineInfo(
            model_name=mc.name,
            model_dir=str(config.model),
            device=config.device,
            dtype=str(dtype).removeprefix("torch."),
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=sorted(self.eos_token_ids),
            page_size=config.page_size,
            num_pages=num_pages,
            kv_capacity_tokens=num_pages * config.page_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            kv_transfer=self.transfer.kind,
            quantization="fp8" if fp8.is_quantized(self.runner.model) else None,
            kv_cache_dtype=kv_dtype,
        )
        if self.runner.cuda and config.warmup:
            log.info("warmed up in %.1f s", self.warm_up())
        log.info("engine core ready: %s", self.info)

    # The start-up requests' prompt lengths, each alone in a step: one per extend tile height
    # the kernels pick by the longest chunk (16 / 64 / 128 query rows) and a long prompt; then
    # a batch over the step's token budget (an eager step, a chunk over its own prefix) with
    # sampled rows beside greedy ones. On an H100 each first request of such a shape waited
    # ~1 s for Triton's compiles without it (docs/benchmarks.md).
    WARMUP_LENGTHS = (10, 40, 300, 1024)

    def warm_up(self) -> float:
        """Serve the start-up requests (random prompts, 3 tokens each), then forget them: their
        cached pages are dropped and the counters zeroed. Returns the seconds it took."""
        start = time.monotonic()
        vocab = self.runner.config.vocab_size
        rng = random.Random(0)
        capacity = self.kv.pool.num_pages * self.config.page_size
        limit = min(self.max_model_len, capacity // 4)  # a small pool: short prompts
        fits = [n for n in self.WARMUP_LENGTHS if n + 3 <= limit] or [max(1, limit - 3)]
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=20,
                                 logprobs=2, seed=0, ignore_eos=True)  # its own generator
        mid = fits[min(2, len(fits) - 1)]
        batch = [(mid, greedy)] * max(1, min(8, self.config.max_num_seqs - 2,
                                             capacity // (2 * (mid + 3))))
        batch += [(fits[0], sampled)] * 2
        for r, requests in enumerate([[(n, greedy)] for n in fits] + [batch]):
            for i, (n, params) in enumerate(requests):
                self.add_request(f"warmup-{r}-{i}", [rng.randrange(vocab) for _ in range(n)],
                                 params)  # fmt: skip
            while self.has_work():
                self.step()
        self.kv.evict_cached()
        self.counters = dict.fromkeys(self.counters, 0)
        self.loop.reset()
        self.scheduler.num_preemptions = 0
        return time.monotonic() - start

    @staticmethod
    def _resolve_max_model_len(asked: int | None, mc) -> int:
        if asked is None:
            return mc.max_position_embeddings
        if not 1 <= asked <= mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {asked} must be in [1, {mc.max_position_embeddings}] "
                f"(the model's max_position_embeddings)"
            )
        return asked

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    begin: int = 0, first_token: int | None = None,
                    queue_s: float | None = None,
                    received_at: float | None = None) -> TokenOutput | None:
        """Queue a request. Raises RequestRejected (naming the field and numbers) on bad input.

        `begin` > 0 (microserving start_generate): the KV of prompt[:begin] is already on this
        engine, received under request_id after a prep_recv or in the prefix cache; a
        MicroservingError says why not. A prep_recv reservation is consumed even at begin 0;
        a request_id in any other state is in use (409).

        `first_token`: the first output, sampled by the engine that sent the KV of the whole
        prompt (begin = len(prompt)). Returns its output, to emit now: no step computes it.

        `queue_s`: a step must start on it within this long of `received_at` (the frontend's
        time.perf_counter() when the call came; default now), else it fails with a 503, code
        queue_timeout (`expire`); raised here, holding nothing, if that time has passed.
        """
        entry = self.requests.get(request_id)
        if entry is not None and entry.state is not RequestState.RESERVED:
            raise MicroservingError(409, f"request_id {request_id!r} is already in use",
                                    "request_id")  # fmt: skip
        check_request(prompt, params, self.info)
        begin = resolve_index(begin, len(prompt), "begin")
        if first_token is not None:
            self._check_first_token(prompt, params, begin, first_token)
        elif begin >= len(prompt):
            raise MicroservingError(
                400, f"begin {begin} leaves no prompt token to prefill: it must be below the "
                f"prompt length {len(prompt)}", "begin")  # fmt: skip
        if params.prompt_logprobs is not None and (begin or entry is not None):
            raise MicroservingError(
                400, "prompt_logprobs needs the whole prompt computed by this engine: begin "
                f"must be 0 without a prep_recv, got begin {begin}", "prompt_logprobs")
        start_by = None
        if queue_s is not None and first_token is None:  # a handed-over token starts at once
            waited = time.perf_counter() - received_at if received_at else 0.0
            if waited > queue_s:  # the core took it up too late
                self.counters["generate_queue_timeouts"] += 1
                raise queue_timeout(request_id, queue_s)
            start_by = time.monotonic() + queue_s - waited
        generator = make_generator(params.seed, self.runner.device)
        arrival, held = next(self._arrivals), None
        try:
            if params.grammar is not None:
                self.grammars.add(request_id, params.grammar)  # RequestRejected: no grammar
            self.penalties.add(request_id, params)  # nothing unless it adjusts logits
            if begin or entry is not None:
                held = self.exchange.adopt_for_generate(request_id, prompt, begin,
                                                        whole=first_token is not None)
        except BaseException:
            self.grammars.remove(request_id)
            self.penalties.remove(request_id)
            raise
        seq = Sequence(request_id, list(prompt), params, arrival, num_computed_tokens=held or 0,
                       num_cached_tokens=held, queue_s=queue_s, start_by=start_by)  # fmt: skip
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(prompt)
        self.requests.generate(request_id, seq, generator)
        self.scheduler.add(seq)
        if first_token is None:
            return None
        seq.output_token_ids.append(first_token)
        final = self._finishes(seq, first_token)
        out = self._output(seq, [first_token], None, final)
        if final:
            self._remove(seq)
        return out

    def _check_first_token(self, prompt: list[int], params: SamplingParams, begin: int,
                           first_token: int) -> None:
        n = len(prompt)
        if begin != n:
            raise MicroservingError(
                400, f"first_token comes with the KV of the whole prompt: begin must be the "
                f"prompt length {n}, got {begin}", "begin")  # fmt: skip
        if not 0 <= first_token < self.info.vocab_size:
            raise MicroservingError(400, f"first_token {first_token} out of range [0, "
                                    f"{self.info.vocab_size})", "first_token")  # fmt: skip
        if params.logprobs is not None or params.grammar is not None or params.adjusts_logits:
            raise MicroservingError(
                400, "a handed-over first_token has no logprobs, follows no grammar and had no "
                "logit_bias, min_tokens or penalties applied: sample it here (begin below the "
                "prompt length)", "first_token")  # fmt: skip

    def _finishes(self, seq: Sequence, token: int) -> bool:
        """Whether `token`, just added to `seq`'s output, ends it: sets its finish reason."""
        p = seq.params
        if p.stops_on(token, self.eos_token_ids):
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        return seq.finish_reason is not None

    def remote_send(self, request_id: str, prompt: list[int], begin: int, end: int,
                    kv_addr: KVAddr | None, sampling: SamplingParams | None = None,
                    received_at: float | None = None, queue_s: float | None = None) -> None:
        """Start a remote_send (KVExchange.remote_send); the answer comes from `poll()`. The KV
        not cached here is computed by a send-only sequence in the scheduler, which also
        samples the first output token with `sampling` if given (the whole prompt is sent).
        Without `kv_addr` nothing is sent until `exchange.send_to` names the destination.
        `received_at` (time.perf_counter()): when the frontend took the call; default now.
        `queue_s`: how long it may wait for a step to start on it (`expire`)."""
        generator = None
        if sampling is not None:
            check_request(prompt, sampling, self.info)
            if sampling.prompt_logprobs is not None:
                raise MicroservingError(400, "prompt_logprobs is for a generation, not a "
                                        "remote_send's first token", "prompt_logprobs")
            generator = make_generator(sampling.seed, self.runner.device)
        seq = self.exchange.remote_send(request_id, prompt, begin, end, kv_addr,
                                        next(self._arrivals), sampling, generator, received_at,
                                        queue_s)
        if seq is not None:
            self.scheduler.add(seq)

    def expire(self, now: float) -> int:
        """What is due by `now` (time.monotonic()): leases and parked sends
        (KVExchange.expire_leases), and sends and generations no step started on within their
        queue time, which leave the scheduler (a generation's 503 from `take_rejected`).
        Returns how many."""
        expired = self.exchange.expire_leases(now)
        for seq in self.exchange.expire_unstarted(now):
            self.scheduler.remove(seq)
            expired += 1
        for seq in [s for s in self.scheduler.waiting if _late(s, now)]:
            seq.finish_reason = FinishReason.ABORT
            self._remove(seq)
            self.counters["generate_queue_timeouts"] += 1
            self._rejected.append((seq.request_id, queue_timeout(seq.request_id, seq.queue_s)))
            expired += 1
        return expired

    def next_deadline(self) -> float | None:
        """When `expire` has something to do next (KVExchange.next_deadline, and the queue
        time of generations no step started on)."""
        starts = [s.start_by for s in self.scheduler.waiting if _late(s, float("inf"))]
        exchange = self.exchange.next_deadline()
        return min(starts + [exchange] if exchange is not None else starts, default=None)

    def take_rejected(self) -> list[tuple[str, MicroservingError]]:
        """The generations `expire` failed since the last call, with their errors."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def poll(self) -> list[tuple[str, Answer]]:
        """Answers for the deferred calls now settled (KVExchange.poll). Sends whose transfer
        failed leave the scheduler first."""
        for seq in self.exchange.drop_failed_sends():
            self.scheduler.remove(seq)
        return self.exchange.poll()

    def abort_request(self, request_id: str) -> TokenOutput | None:
        """Drop a request wherever it is and release its pages. Returns the final output of a
        generation; None for a transfer (no token stream) or an unknown id."""
        entry = self.requests.get(request_id)
        if entry is None:
            self.exchange.forget_address(request_id)  # a send_to ahead of its remote_send
            return None
        if entry.state is not RequestState.GENERATING:
            if (seq := self.exchange.abort(request_id)) is not None:
                self.scheduler.remove(seq)
            return None
        seq = entry.seq
        seq.finish_reason = FinishReason.ABORT
        self._remove(seq)
        return self._output(seq, [], None, final=True)

    def fail_requests(self, why: str) -> list[str]:
        """After a step raised: drop every request the step may have touched, so the engine
        goes on with a consistent state. Generations are removed and their ids returned (the
        caller tells their clients); sends still computing, or flushing but waiting for the
        token they sample, fail with `why` (answered by `poll()`). Reservations, waiting
        prep_recv calls and other flushing sends are untouched: no step works on them."""
        self._in_flight, self._pending_rows = None, {}
        for request_id in list(self.requests.in_state(RequestState.SENDING)):
            self.scheduler.remove(self.exchange.fail_send(request_id, MicroservingError(500, why)))
        for request_id in self.exchange.unsampled():  # their token's step is lost
            self.exchange.fail_send(request_id, MicroservingError(500, why))
        dropped = []
        for request_id, entry in list(self.requests.in_state(RequestState.GENERATING).items()):
            entry.seq.finish_reason = FinishReason.ABORT
            self._remove(entry.seq)
            dropped.append(request_id)
        return dropped

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def _wake(self) -> None:
        try:
            os.write(self._wakeup_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop is woken anyway
            pass

    def close(self) -> None:
        self.exchange.sender.close()
        self.transfer.close()
        os.close(self._wakeup_w)
        os.close(self.wakeup_fd)

    # ---- the step ---------------------------------------------------------------------------
    #
    # A step launches work on the device and resolves sampled tokens into outputs. With async
    # scheduling (CUDA), step N is launched before step N-1's tokens are read back, so the host
    # prepares N while the GPU still runs N-1:
    #
    #   host:  launch N-1 | resolve N-2 | launch N | resolve N-1 | launch N+1 | ...
    #   GPU:        [ step N-1 ......... ][ step N ............ ][ step N+1 ...
    #
    # A token sampled by the step in flight is a placeholder (PENDING) in output_token_ids; the
    # next step's input for it is filled on the device from the sampled ids. Stopping on eos
    # is learned one step late: that step's extra token for the sequence is dropped.
    #
    # A constrained sequence's mask for step N depends on its token of step N-1. When step
    # N-1 sampled one, step N's forward pass is launched first and its sampling after N-1 is
    # resolved and the masks computed, so the GPU runs N's forward pass meanwhile:
    #
    #   host:  launch N-1 | forward N | resolve N-1, masks | sample N | forward N+1 | ...
    #   GPU:        [ step N-1 ...... ][ forward N ............ ][sample N][ forward N+1 ...

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

    def _count(self, sched: SchedulerOutput) -> None:
        loop = self.loop
        loop.steps += 1
        for e in sched.scheduled:
            start = e.seq.num_computed_tokens
            prompt_end = min(start + e.num_new_tokens, e.seq.num_prompt_tokens)
            loop.prompt_tokens_computed += max(0, prompt_end - start)
            loop.tokens_sampled += e.sample

    def _constrains(self, launched: "_Launched") -> bool:
        return len(self.grammars) > 0 and any(
            seq.request_id in self.grammars for seq, _ in launched.sampled)

    def _launch(self, sample_now: bool = True) -> "_Launched | None":
        """Launch the next step's forward pass and, if `sample_now`, its sampling (else
        `_sample` must follow)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        self._count(sched)
        batch, input_ids, sample_rows, from_last, sends, scored = self._build_batch(sched)
        sampled = [e.seq for e in sched.scheduled if e.sample]
        # Params, generators and adjustments now: a sequence may be removed before a deferred
        # sample (a send's leaves the scheduler below), and min_tokens counts the outputs
        # before this step's.
        args = ([seq.params for seq in sampled], self.requests.generators(sampled),
                self.penalties.step(sampled))
        logits = self.runner.forward(batch, input_ids, sample_rows, from_last=from_last,
                                     sends=sends)
        scores = []
        if scored:
            rows, targets, num_top = zip(*((row, seq.prompt_token_ids[j],
                                            seq.params.prompt_logprobs)
                                           for row, (seq, j) in scored))
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
        scheduled = [e.seq for e in sched.scheduled]
        launched = _Launched(scheduled, list(zip(sampled, slots)), None, length_done, logits,
                             args, [s for _, s in scored], scores)
        if logits is not None and sample_now:
            self._sample(launched)
        return launched

    def _sample(self, launched: _Launched) -> None:
        """Sample a launched step's logits, its constrained rows under their grammars' masks
        (computed when their previous tokens were resolved)."""
        mask = None
        if len(self.grammars):
            mask = self.grammars.step_mask([seq.request_id for seq, _ in launched.sampled])
        params, generators, adjust = launched.sample_args
        launched.pending = self.runner.sample(launched.logits, params, generators, mask, adjust)
        launched.logits = None

    def _build_batch(self, sched: SchedulerOutput):
        """The step's ForwardBatch, packed input ids, rows to sample, (input index, previous
        sample row) for inputs still pending on the device, the KV sends to mark, and the
        (row, (sequence, prompt token index)) of the prompt tokens to score."""
        ps = self.kv.page_size
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
        batch = ForwardBatch(seqs, ps, self.kv.take_table_changes())
        return batch, input_ids, sample_rows, from_last, sends, scored

    def _resolve(self, launched: "_Launched") -> list[TokenOutput]:
        """Read a launched step's tokens back; emit outputs, finish and free sequences."""
        result = None
        waited = time.perf_counter()
        if launched.pending is not None:
            result = launched.pending.result()
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

    def _fill_prompt_logprobs(self, launched: _Launched) -> None:
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

    def _remove(self, seq: Sequence) -> None:
        """Take a finished or aborted generation out and free its pages."""
        self.scheduler.remove(seq)
        self.requests.finish(seq.request_id)
        self.grammars.remove(seq.request_id)
        self.penalties.remove(seq.request_id)
        self.counters["prompt_tokens"] += seq.num_prompt_tokens
        self.counters["cached_prompt_tokens"] += seq.num_cached_tokens or 0
        self.counters["generation_tokens"] += sum(t != PENDING for t in seq.output_token_ids)

    def _output(self, seq: Sequence, tokens: list[int], logprob, final: bool) -> TokenOutput:
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and tokens:  # the first token's output has them
            prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            assert seq.prompt_scored == seq.num_prompt_tokens, "a prompt token left unscored"
        return TokenOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            finish_reason=seq.finish_reason if final else None,
            logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            prompt_logprobs=prompt_logprobs,
        )

    # ---- inspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.kv.stats()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_pages_total=s.total_pages,
            kv_pages_free=s.free_pages,
            kv_pages_cached=s.cached_pages,
            kv_pages_used=s.used_pages,
            kv_pages_pinned=s.pinned_pages,
            preemptions=self.scheduler.num_preemptions,
            **self.counters,
            **self.exchange.stats(),
            **asdict(self.loop),
        )

    def check_integrity(self) -> None:
        """The KV pages and the penalty pool's rows, then the request table against the
        scheduler, the pages, the grammar matchers and the penalty pool. Raises
        IntegrityError."""
        self.kv.check_integrity()
        self.penalties.check_integrity()
        self.requests.check_integrity(self.scheduler, self.kv, self.grammars.request_ids(),
                                      self.penalties.request_ids())


def _late(seq: Sequence, now: float) -> bool:
    """A generation no step started on whose queue time ends by `now`."""
    return seq.start_by is not None and not seq.admitted and seq.start_by <= now
