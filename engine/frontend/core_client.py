"""The frontend's handle on its engine-core process (a GenerateBackend). No torch here.

It starts `python -m engine.core_proc` with one end of a Unix socket pair, waits for Ready,
and then multiplexes requests over that socket (typed frames, engine/frames.py): one
asyncio queue per request receives its TokenOutputs from a single reader task, and the
request's generator makes each one the next GenerateChunk. If the core process dies, every open
request fails with BackendUnavailable and `healthy()` turns false. The core's heartbeats
(engine/core_proc.py) say whether it still makes progress: `liveness()`, answered from here
without asking the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict


from engine.config import EngineConfig
from microserve.backend import (
    RETRY_AFTER_S,
    BackendUnavailable,
    GenerateBackend,
    MicroservingError,
    RequestRejected,
)
from engine.frames import (
    CallFailed,
    Frame,
    FromCore,
    Generate,
    Heartbeat,
    invoke,
    Outputs,
    Ready,
    Rejected,
    Reply,
    Shutdown,
)
from microserve.messages import (
    CALLS,
    AbortRequest,
    AbortResponse,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    Liveness,
    LoadLoraRequest,
    SamplingParams,
    StatsRequest,
    TokenOutput,
    UnloadLoraRequest,
    Usage,
    call_of,
)
from kvcache.transfer.auth import KEY_ENV, transfer_key
from microserve import vllm_metrics
from microserve.wire import FrameDecoder, encode

log = logging.getLogger("microserve.engine")


class CoreStartError(RuntimeError):
    pass


class CoreClient(GenerateBackend):
    """Args:
        config: the core's configuration (sent on its command line: no secrets in it).
        served_model_name: what /v1/models reports.
        engine_key: the engine's API key, shared by the deployment's engines; the core derives
            the KV transfer key from it (given through its environment). None: no KV transfer.
    """

    def __init__(self, config: EngineConfig, served_model_name: str,
                 engine_key: str | None = None):
        if served_model_name in {name for name, _ in config.lora_modules}:
            raise ValueError(f"--lora-modules names an adapter {served_model_name!r}, the "
                             "served model's own name: requests could not tell them apart")
        self.config = config
        self._engine_key = engine_key
        self.model_name = served_model_name
        self.info: EngineInfo | None = None  # as the core found it; set by start()
        # the LoRA adapters registered: set by start(), then by `call` as loads and unloads
        # succeed (they all come through this frontend)
        self._lora_names: list[str] = []
        self.max_model_len = 0
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, tuple[asyncio.Future, str]] = {}  # id -> (its answer, method)
        self._call_ids = itertools.count()
        self._alive = False
        self.exited = asyncio.Event()  # set when the core process is gone (crash or shutdown)
        # The core's last heartbeat and when it came (loop time); set by _dispatch (and start)
        self._beat = Heartbeat(0, 0.0)
        self._beat_at = 0.0

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [
            sys.executable, "-m", "engine.core_proc",
            "--fd", str(theirs.fileno()), "--config", json.dumps(asdict(self.config)),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        if self._engine_key is not None:
            env[KEY_ENV] = transfer_key(self._engine_key).hex()
        self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        reader, self._writer = await asyncio.open_connection(sock=ours)
        decoder = FrameDecoder(FromCore)
        try:
            first = await asyncio.wait_for(self._read_one(reader, decoder), timeout_s)
        except (asyncio.TimeoutError, ConnectionError) as e:
            await self.close()
            raise CoreStartError(f"engine core did not start: {e!r}") from e
        if not isinstance(first, Ready):
            await self.close()
            why = first.message if first else "the core process exited"
            raise CoreStartError(f"engine core failed to start: {why}")
        self.info = first.info
        self._lora_names = list(first.info.lora_adapters)
        self.max_model_len = self.info.max_model_len
        self._alive = True
        self._beat_at = asyncio.get_running_loop().time()  # Ready is a sign of life too
        self._reader_task = asyncio.create_task(self._read_loop(reader, decoder))

    @staticmethod
    async def _read_one(reader: asyncio.StreamReader, decoder: FrameDecoder):
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return None
            msgs = decoder.feed(data)
            if msgs:
                assert len(msgs) == 1, "the core sends nothing before ready"
                return msgs[0]

    async def close(self) -> None:
        """Stop the core process and the reader task; fail whatever is still open."""
        self._alive = False
        if self._writer is not None and not self._writer.is_closing():
            with contextlib.suppress(ConnectionError):
                self._writer.write(encode(Shutdown()))
                await self._writer.drain()
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
        if self._proc is not None:
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        self._fail_all("engine is shutting down")

    # ---- reading ------------------------------------------------------------------------------

    async def _read_loop(self, reader: asyncio.StreamReader, decoder: FrameDecoder) -> None:
        try:
            while data := await reader.read(1 << 20):
                for msg in decoder.feed(data):
                    self._dispatch(msg)
        finally:
            if self._alive:
                code = await asyncio.to_thread(self._wait_exit_code)
                log.error("engine core process exited (code %s)", code)
            self._alive = False
            self._fail_all("engine core process exited")
            self.exited.set()

    def _wait_exit_code(self) -> int | None:
        try:
            return self._proc.wait(5)  # the socket closes just before the process is reaped
        except subprocess.TimeoutExpired:
            return None

    def _dispatch(self, msg: FromCore) -> None:
        if isinstance(msg, Outputs):
            for out in msg.items:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
        elif isinstance(msg, Rejected):
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(_error(msg.status, msg.message, msg.param, msg.code))
        elif isinstance(msg, Heartbeat):
            self._beat, self._beat_at = msg, asyncio.get_running_loop().time()
        elif isinstance(msg, Reply | CallFailed):
            fut, method = self._calls.pop(msg.id, (None, None))
            if fut is None or fut.done():
                return
            if isinstance(msg, CallFailed):
                fut.set_exception(_error(msg.status, msg.error, msg.param, msg.code))
            else:  # decoded once, into the call's answer type
                fut.set_result(CALLS[method].decode_answer(msg.result))

    def _fail_all(self, why: str) -> None:
        for q in self._queues.values():
            q.put_nowait(BackendUnavailable(why))
        for fut, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(BackendUnavailable(why))
        self._calls.clear()

    # ---- GenerateBackend ------------------------------------------------------------------------

    def _send(self, msg: Frame) -> None:
        if not self._alive:
            raise BackendUnavailable("engine core is not running")
        self._writer.write(encode(msg))  # buffered by the transport: never blocks the loop

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, choices_of: str | None = None,
    ) -> AsyncIterator[GenerateChunk]:
        """A request of this engine's own /v1: bounded by its queue_timeout_s, from now.
        choices_of: unused, the scheduler already computes a prompt once for all its choices."""
        return self.start_generate(request_id, prompt_token_ids, 0, params,
                                   queue_s=self.config.queue_timeout_s,
                                   received_at=time.perf_counter(), priority=priority)

    async def start_generate(
        self, request_id: str, prompt: list[int], begin: int, params: SamplingParams,
        first_token: int | None = None, queue_s: float | None = None, received_at: float = 0.0,
        priority: int = 0, first_token_delivered: bool = False,
    ) -> AsyncIterator[GenerateChunk]:
        """generate() whose KV for prompt[:begin] is already on the engine (microserving),
        `first_token` its first output if the sender sampled it (`first_token_delivered`: the
        caller gave it to its client already, so the chunks begin after it and the usage
        counts it, as StartGenerateRequest says); `queue_s` bounds its wait for
        a step (from `received_at`, time.perf_counter(): a 503 queue_timeout); `priority` ranks
        it under the priority scheduling policy. Raises
        MicroservingError / RequestRejected before the first output on bad input.

        The request lives as long as this iterator: closed or cancelled before its finishing
        chunk, it aborts the request in the core (once, from here; a 409's request_id belongs
        to another call, and a request the core refused holds nothing there)."""
        if request_id in self._queues:
            raise MicroservingError(409, f"request_id {request_id!r} is already in use",
                                    "request_id")  # fmt: skip
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        # A first token the caller delivered was its stream's first chunk (the one that says
        # how many prompt tokens were cached): the core's outputs follow on from it.
        num_generated = 1 if first_token_delivered else 0
        settled = False
        try:
            self._send(Generate(request_id, prompt, params, begin, first_token, queue_s,
                                priority, received_at, first_token_delivered))
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    # The core holds nothing for a call it refused, nor a core that is gone.
                    settled = isinstance(item, (MicroservingError, BackendUnavailable))
                    raise item
                first = num_generated == 0
                num_generated += len(item.token_ids)
                settled = item.finish_reason is not None
                yield _chunk(item, num_generated, first)
                if settled:
                    return
        finally:
            del self._queues[request_id]
            if not settled and self._alive:  # the abort call, its answer not awaited
                self._send(invoke(next(self._call_ids), AbortRequest(request_id)))

    async def abort(self, request_id: str) -> AbortResponse:
        """Drop whatever the core holds under `request_id` (the abort call)."""
        return await self.call(AbortRequest(request_id))

    async def call(self, request, timeout_s: float | None = 30.0, received_at: float = 0.0):
        """Run the call whose request `request` is (messages.CALLS) in the core. Returns its
        answer, decoded once into the call's answer type; raises MicroservingError or
        RequestRejected as the core answers, RuntimeError on an internal failure.
        `received_at`: time.perf_counter() when the call came in (a remote_send's queue
        time starts there)."""
        if isinstance(request, LoadLoraRequest) and request.lora_name == self.model_name:
            raise MicroservingError(400, f"lora_name {request.lora_name!r} is the base model's "
                                    "name: pick another", "lora_name")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (fut, call_of(request).name)
        try:
            self._send(invoke(call_id, request, received_at))
            answer = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        if isinstance(request, LoadLoraRequest):  # what requests may name in `model` now
            self._lora_names.append(request.lora_name)
        elif isinstance(request, UnloadLoraRequest):
            self._lora_names.remove(request.lora_name)
        return answer

    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name (GenerateBackend's)."""
        return list(self._lora_names)

    async def healthy(self) -> bool:
        return self._alive

    def liveness(self) -> Liveness:
        """How long the core has been silent, and what its last heartbeat said."""
        silent = asyncio.get_running_loop().time() - self._beat_at
        return Liveness(core_silent_s=silent, steps=self._beat.steps,
                        in_step_s=self._beat.in_step_s)

    async def metrics_text(self) -> str:
        if not self._alive:
            return ""
        # /metrics is open: adapters' names (tenants', often) only where no key guards the rest
        return format_core_stats(await self.call(StatsRequest()), self.info, self.model_name,
                                 lora_names=self._engine_key is None)


def _chunk(out: TokenOutput, num_generated: int, first: bool) -> GenerateChunk:
    """The request's next chunk; `num_generated` counts its tokens so far, this one's included.
    The first chunk says how many prompt tokens were cached, the last has the usage."""
    usage = None if out.finish_reason is None else Usage(
        out.num_prompt_tokens, num_generated, out.num_cached_tokens)
    return GenerateChunk(out.token_ids, out.logprobs, out.finish_reason, usage,
                         out.num_cached_tokens if first else None, out.prompt_logprobs)


def _error(status: int, message: str, param: str | None, code: str | None = None) -> Exception:
    if status == 400:
        return RequestRejected(message, param)
    if status >= 500 and status != 502 and status != 503:
        return RuntimeError(message)
    error = MicroservingError(status, message, param, code)
    if code == "queue_timeout":  # the engine is busy: the client may come back later
        error.retry_after = RETRY_AFTER_S
    return error


_STAT_HELP = {
    "running": ("gauge", "Requests running in the engine"),
    "waiting": ("gauge", "Requests waiting for admission"),
    "kv_pages_total": ("gauge", "KV pages in the pool"),
    "kv_pages_free": ("gauge", "KV pages free"),
    "kv_pages_cached": ("gauge", "KV pages held only by the prefix cache (reusable)"),
    "kv_pages_used": ("gauge", "KV pages held by running requests"),
    "kv_pages_pinned": ("gauge", "KV pages pinned in the prefix cache"),
    "preemptions": ("counter", "Requests preempted (recomputed later), for any reason"),
    "scheduling_promotions": ("counter", "Requests promoted to the top for waiting past the "
                                         "scheduling starvation bound"),
    "kv_swap_outs": ("counter", "Preempted requests whose KV was copied to host memory"),
    "kv_swap_ins": ("counter", "Swapped requests whose KV was copied back to the GPU"),
    "kv_swap_out_bytes": ("counter", "KV bytes copied to host memory"),
    "kv_swap_in_bytes": ("counter", "KV bytes copied back from host memory"),
    "kv_swap_recomputes": ("counter", "Preemptions with a host KV tier that recompute instead "
                                      "(cheaper than the copy, or the host pool was full)"),
    "kv_swap_copies_beside": ("counter", "Host-tier copies made beside steps, by the copy "
                                         "kernel's narrow grid (slower, and slowing them less)"),
    "kv_host_pages_total": ("gauge", "KV pages in the host tier (0: off)"),
    "kv_host_pages_free": ("gauge", "KV pages free in the host tier"),
    "kv_host_pages_cached": ("gauge", "KV pages of the prefix cache in the host tier"),
    "kv_host_prefix_demoted_pages": ("counter", "Prefix-cache pages evicted from the GPU and "
                                                "kept in the host tier"),
    "kv_host_prefix_loaded_pages": ("counter", "Prefix-cache pages loaded back from the host "
                                               "tier for a prefix hit"),
    "prompt_tokens": ("counter", "Prompt tokens of finished requests"),
    "cached_prompt_tokens": ("counter", "Prompt tokens served from the prefix cache"),
    "generation_tokens": ("counter", "Tokens generated by finished requests"),
    "kv_reservations": ("gauge", "prep_recv reservations waiting for KV or a start_generate"),
    "kv_send_jobs": ("gauge", "remote_send calls in progress"),
    "kv_recv_waiting": ("gauge", "prep_recv calls waiting for KV pages"),
    "kv_recv_waited": ("counter", "prep_recv calls that had to wait for KV pages"),
    "kv_recv_wait_timeouts": ("counter", "prep_recv calls that waited their wait_s in vain (503)"),
    "kv_send_queue_timeouts": ("counter",
                               "remote_send calls no step started within their queue_s (503)"),
    "generate_queue_timeouts": ("counter",
                                "start_generate calls no step started within their queue_s (503)"),
    "triton_compiles_after_warmup": ("counter", "Triton kernels compiled after warm-up (each "
                                                "stalled a step; the log names them)"),
    "kv_leases_expired": ("counter", "prep_recv reservations freed because their lease ran out"),
    "kv_tokens_sent": ("counter", "Tokens of KV written into peers by remote_send"),
    "kv_tokens_received": ("counter", "Tokens of KV received from peers and adopted"),
    "steps": ("counter", "Steps the engine core ran"),
    "prompt_tokens_computed": ("counter", "Prompt tokens through the forward pass (not cached)"),
    "tokens_sampled": ("counter", "Tokens sampled"),
    "step_seconds": ("counter", "Core time in steps: scheduling, launching, waiting for the GPU"),
    "device_wait_seconds": ("counter", "Of the step time: waiting for the GPU to run the "
                                       "step before (its sampled tokens)"),
    "send_seconds": ("counter", "Core time writing outputs to the frontend"),
    "message_seconds": ("counter", "Core time handling the frontend's requests and calls"),
    "idle_seconds": ("counter", "Core time waiting with nothing to run"),
    "device_busy_seconds": ("counter", "GPU time running steps (CUDA events around each step; "
                                       "0 on CPU)"),
    "device_steps_ahead": ("counter", "Steps launched and not yet run on the GPU, summed at "
                                      "each launch (/ steps: the host's lead)"),
    "device_decode_seconds": ("counter", "Of the GPU's step time: steps that only decoded"),
    "device_decode_steps": ("counter", "Steps that only decoded (one token a sequence)"),
    "device_decode_seqs": ("counter", "Sequences of the steps that only decoded, summed "
                                      "(/ those steps: their mean batch)"),
    "device_prompt_seconds": ("counter", "Of the GPU's step time: steps in which nothing "
                                         "decoded (prompt chunks only)"),
    "device_prompt_steps": ("counter", "Steps in which nothing decoded (the prompt-only "
                                       "budget, --max-prefill-step-tokens)"),
    "device_prompt_tokens": ("counter", "Tokens of the steps in which nothing decoded, summed "
                                        "(/ those steps: their mean size)"),
    "launch_holds": ("counter", "Launches held until the step in flight had "
                                "--launch-ahead-layers left"),
    "launch_hold_seconds": ("counter", "Of the step time: holding those launches"),
    "launch_hold_arrivals": ("counter", "Requests that arrived while a launch was held"),
}


def _labelled(key: str, kind: str, help_text: str, label: str, values: dict) -> list[str]:
    name = f"microserve_engine_{key}" + ("_total" if kind == "counter" else "")
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
            *(f'{name}{{{label}="{k}"}} {v}' for k, v in values.items())]


def format_core_stats(stats: EngineStats, info: EngineInfo, model_name: str | None = None,
                      lora_names: bool = True) -> str:
    """The core's stats as Prometheus text: microserve's names, then vLLM's for the figures
    it has too (microserve/vllm_metrics.py), labelled with `model_name` (default: the
    model's); `lora_names`: with vLLM's gauge of the adapters' names."""
    lines = []
    for key, (kind, help_text) in _STAT_HELP.items():
        name = f"microserve_engine_{key}" + ("_total" if kind == "counter" else "")
        value = getattr(stats, key)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    lines += _labelled("preemptions_by_reason", "counter", "Requests preempted, by reason "
                       "(pages: a running request needed a page; priority: one ranked higher "
                       "took the place; ahead: copied to the host tier before pages ran "
                       "short)", "reason",
                       {reason: stats.preemptions_by_reason.get(reason, 0)
                        for reason in ("pages", "priority", "ahead")})
    lines += _labelled("prefix_cache_hit_tokens", "counter", "Prompt tokens of finished "
                       "requests served from the prefix cache, by the tier that held them",
                       "tier", {"device": stats.cached_prompt_tokens
                                - stats.cached_prompt_tokens_host,
                                "host": stats.cached_prompt_tokens_host})
    if stats.mlfq_queue_requests:
        lines += _labelled("mlfq_queue_requests", "gauge", "Requests in each skip-join MLFQ "
                           "queue (level 0 runs first)", "level",
                           dict(enumerate(stats.mlfq_queue_requests)))
    cap = info.kv_capacity_tokens
    lines += [
        "# HELP microserve_engine_kv_capacity_tokens KV cache capacity in tokens",
        "# TYPE microserve_engine_kv_capacity_tokens gauge",
        f"microserve_engine_kv_capacity_tokens {cap}",
    ]
    lines += vllm_metrics.core_lines(stats, info, model_name or info.model_name, lora_names)
    return "\n".join(lines) + "\n"
