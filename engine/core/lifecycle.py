"""A request's life in the engine core: added, finished, aborted, expired, failed.

The core moves generations (GENERATING) and is the only one to add sequences to the scheduler
or take them out; the KV exchange moves the transfer states and returns the send-only sequences
to schedule or drop. So the calls that start or stop scheduled work come through here
(`add_request`, `remote_send`, `abort_request`, `poll`, `expire`); the receiver's calls
(`prep_recv`, `commit`) and the lease and wait bookkeeping are the exchange's alone.

What a generation holds beside its sequence (a grammar matcher, a penalty row; later adapters,
host pages) lives in the core's side tables (`RequestSideTable`, engine/requests.py): each is
given the request when it is added and told when it leaves, here and nowhere else.
"""

from __future__ import annotations

import time

from engine.kv_exchange import Answer
from engine.kv_sender import queue_timeout
from engine.requests import RequestState
from engine.sampler import make_generator
from engine.sequence import PENDING, Sequence
from engine.validation import check_request, resolve_index
from microserve.backend import MicroservingError, RequestRejected
from microserve.messages import FinishReason, KVAddr, SamplingParams, TokenOutput


class RequestLifecycle:
    """Mixed into EngineCore, whose fields it reads: requests, scheduler, exchange, side_tables,
    info, counters, runner, max_model_len, eos_token_ids."""

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    begin: int = 0, first_token: int | None = None,
                    queue_s: float | None = None,
                    received_at: float | None = None, priority: int = 0,
                    first_token_delivered: bool = False) -> TokenOutput | None:
        """Queue a request. Raises RequestRejected (naming the field and numbers) on bad input.

        `begin` > 0 (microserving start_generate): the KV of prompt[:begin] is already on this
        engine, received under request_id after a prep_recv or in the prefix cache; a
        MicroservingError says why not. A prep_recv reservation is consumed even at begin 0;
        a request_id in any other state is in use (409).

        `first_token`: the first output, sampled by the engine that sent the KV of the whole
        prompt (begin = len(prompt)). Returns its output, to emit now: no step computes it.
        With `first_token_delivered` the caller has emitted it already: it joins the output
        all the same (usage, max_tokens, stops), but is not emitted again; the output returned
        is then only a final one, of no tokens, if that token ends the request (else None).

        `queue_s`: a step must start on it within this long of `received_at` (the frontend's
        time.perf_counter() when the call came; default now), else it fails with a 503, code
        queue_timeout (`expire`); raised here, holding nothing, if that time has passed.

        `priority`: its rank under the priority scheduling policy (lower runs first).
        """
        entry = self.requests.get(request_id)
        if entry is not None and entry.state is not RequestState.RESERVED:
            raise MicroservingError(409, f"request_id {request_id!r} is already in use",
                                    "request_id")  # fmt: skip
        check_request(prompt, params, self.info)
        if params.lora_name is not None and self.adapters is None:
            raise RequestRejected("this engine serves no LoRA adapters (start it with "
                                  "--lora-modules or --enable-lora)", "model")
        begin = resolve_index(begin, len(prompt), "begin")
        if first_token_delivered and first_token is None:
            raise MicroservingError(400, "first_token_delivered needs the first_token it says "
                                    "was delivered", "first_token_delivered")
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
            for table in self.side_tables:
                table.admit(request_id, params)  # RequestRejected: e.g. no grammar
            lora_id = self.adapters.lora_id(request_id) if self.adapters is not None else 0
            if begin or entry is not None:  # KV received, or cached, under its adapter
                held = self.exchange.adopt_for_generate(request_id, prompt, begin,
                                                        first_token is not None, lora_id)
        except BaseException:
            self._release_side_tables(request_id)
            raise
        seq = Sequence(request_id, list(prompt), params, arrival, num_computed_tokens=held or 0,
                       num_cached_tokens=held, queue_s=queue_s, start_by=start_by,
                       lora_id=lora_id, priority=priority)  # fmt: skip
        if held is not None:  # the host tier's share of a cached start, for its counter
            seq.num_host_cached_tokens = self.exchange.host_loaded
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(prompt)
        self.requests.generate(request_id, seq, generator)
        self.scheduler.add(seq)
        if first_token is None:
            return None
        seq.output_token_ids.append(first_token)
        final = self._finishes(seq, first_token)
        if first_token_delivered and not final:
            return None  # the caller emitted it: the next step's token follows it
        out = self._output(seq, [] if first_token_delivered else [first_token], None, final)
        if final:
            self._remove(seq)
        return out

    def adapter_id(self, lora_name: str | None) -> int:
        """The id of the LoRA adapter a KV exchange call names (0: the base model). Raises a
        400 if LoRA is off here, a 404 if no adapter of that name is loaded: KV is never
        computed, received or reused under other weights than the request's."""
        if lora_name is None:
            return 0
        if self.adapters is None:
            raise MicroservingError(400, f"lora_name {lora_name!r}: this engine serves no LoRA "
                                    "adapters (start it with --lora-modules or --enable-lora)",
                                    "lora_name")
        return self.adapters.id_of(lora_name)

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
                    received_at: float | None = None, queue_s: float | None = None,
                    priority: int = 0, lora_name: str | None = None) -> None:
        """Start a remote_send (KVExchange.remote_send); the answer comes from `poll()`. The KV
        not cached here is computed by a send-only sequence in the scheduler, which also
        samples the first output token with `sampling` if given (the whole prompt is sent).
        Without `kv_addr` nothing is sent until `exchange.send_to` names the destination.
        `received_at` (time.perf_counter()): when the frontend took the call; default now.
        `queue_s`: how long it may wait for a step to start on it (`expire`); `priority`: its
        rank under the priority scheduling policy; `lora_name`: the LoRA adapter the KV is
        computed with (None: the base model)."""
        generator = None
        lora_id = self.adapter_id(lora_name)
        if sampling is not None:
            check_request(prompt, sampling, self.info)
            if sampling.lora_name != lora_name:
                raise MicroservingError(
                    400, f"sampling.lora_name {sampling.lora_name!r} differs from the "
                    f"remote_send's lora_name {lora_name!r}: the first token is sampled with "
                    "the adapter the KV is computed with", "lora_name")
            if sampling.prompt_logprobs is not None:
                raise MicroservingError(400, "prompt_logprobs is for a generation, not a "
                                        "remote_send's first token", "prompt_logprobs")
            generator = make_generator(sampling.seed, self.runner.device)
        seq = self.exchange.remote_send(request_id, prompt, begin, end, kv_addr,
                                        next(self._arrivals), sampling, generator, received_at,
                                        queue_s, priority, lora_id)
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
        """Answers for the deferred calls now settled (KVExchange.poll, and adapters read by
        the loader thread). Sends whose transfer failed leave the scheduler first."""
        for seq in self.exchange.drop_failed_sends():
            self.scheduler.remove(seq)
        loads = []
        if self.adapters is not None:
            loads = self.adapters.poll()
            for adapter_id, why in self.adapters.take_failed():
                self._fail_adapter_requests(adapter_id, why)
        return self.exchange.poll() + loads

    def _fail_adapter_requests(self, adapter_id: int, why: str) -> None:
        """An adapter's host copy could not be read back from disk: its waiting requests fail
        (a generation's 500 from `take_rejected`, a send's through its call); running ones
        hold its slot and go on."""
        name = self.adapters.registry.by_id(adapter_id).name
        error = MicroservingError(500, f"LoRA adapter {name!r} could not be read back from "
                                       f"disk: {why}", "model")
        for seq in [s for s in self.scheduler.waiting if s.lora_id == adapter_id]:
            entry = self.requests.get(seq.request_id)
            if entry is not None and entry.state is RequestState.GENERATING:
                seq.finish_reason = FinishReason.ABORT
                self._remove(seq)
                self._rejected.append((seq.request_id, error))
            elif entry is not None and entry.state is RequestState.SENDING:
                self.scheduler.remove(self.exchange.fail_send(seq.request_id, error))

    def abort_request(self, request_id: str, early_send: bool = False) -> TokenOutput | None:
        """Drop a request wherever it is and release its pages. Returns the final output of a
        generation; None for a transfer (no token stream) or an unknown id.

        `early_send` (AbortRequest's): the abort is for a remote_send without kv_addr that may
        not have come yet. An unknown id is then kept for that send, which is refused when it
        comes (`Sending.refuse_ahead`): one abort settles it, whichever arrives first."""
        entry = self.requests.get(request_id)
        if entry is None:
            self.exchange.forget_address(request_id)  # a send_to ahead of its remote_send
            if early_send:
                self.exchange.refuse_ahead(request_id)
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

    def _remove(self, seq: Sequence) -> None:
        """Take a finished or aborted generation out and free its pages."""
        self.scheduler.remove(seq)
        self.requests.finish(seq.request_id)
        self._release_side_tables(seq.request_id)
        self.counters["prompt_tokens"] += seq.num_prompt_tokens
        self.counters["cached_prompt_tokens"] += seq.num_cached_tokens or 0
        self.counters["cached_prompt_tokens_host"] += seq.num_host_cached_tokens
        self.counters["generation_tokens"] += sum(t != PENDING for t in seq.output_token_ids)

    def _release_side_tables(self, request_id: str) -> None:
        for table in self.side_tables:
            table.remove(request_id)

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


def _late(seq: Sequence, now: float) -> bool:
    """A generation no step started on whose queue time ends by `now`."""
    return seq.start_by is not None and not seq.admitted and seq.start_by <= now
