"""EngineCore: what the engine runs, built once; its stats and its integrity check.

The request lifecycle is engine/core/lifecycle.py, the step pipeline engine/core/step.py, the
frames in and out engine/core/handlers.py, the warm-up engine/core/warmup.py.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import asdict

import torch

from engine.background import Background
from engine.config import EngineConfig
from engine.core.adapters import EngineAdapters
from engine.core.handlers import MessageHandlers
from engine.core.lifecycle import RequestLifecycle
from engine.core.profile import measure_prefill
from engine.core.step import LaunchedStep, StepPipeline
from engine.core.warmup import WARMUP_LENGTHS, warm_up
from engine.grammar import GrammarMatchers
from engine.host_swap import HostSwap
from engine.kernels.compile_watch import COMPILES
from engine.kv_exchange import ExchangeLimits, KVExchange
from engine.loop_stats import DeviceTimeline, LoopCounters
from engine.model_runner import ModelRunner, resolve_dtype
from engine.models import fp8
from engine.penalties import PenaltyPool
from engine.policies import FCFS, PrefillProfile, SchedulingPolicy, make_policy
from engine.requests import RequestSideTable, RequestTable
from engine.scheduler import Scheduler
from kvcache.manager import KVCacheManager
from kvcache.transfer import KVLayout, make_backend
from kvcache.transfer.sender import KVSender
from kvcache.transfer.tp_peer import rank_fields
from microserve.backend import MicroservingError
from microserve.messages import EngineInfo, EngineStats

log = logging.getLogger("engine.core")


class EngineCore(RequestLifecycle, StepPipeline, MessageHandlers):
    """Args:
        config: what to run.
        transfer_key: the deployment's KV transfer key (kvcache/transfer/auth.py). Without
            it this engine neither receives KV (`--kv-transfer auto` means none) nor sends it.
    """

    def __init__(self, config: EngineConfig, transfer_key: bytes | None = None):
        # while any engine of this process starts (benches run several in one), its compiles
        # are its own start-up's, not shapes another engine's warm-up missed
        with COMPILES.starting():
            self._start(config, transfer_key)

    def _start(self, config: EngineConfig, transfer_key: bytes | None) -> None:
        self.config = config
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        dtype = resolve_dtype(config.dtype, config.device)
        if config.tensor_parallel_size > 1:
            from engine.tp.runner import TensorParallelRunner

            self.runner = TensorParallelRunner(config, dtype)
        else:
            self.runner = ModelRunner(config, dtype)
        # LoRA adapters (engine/lora/), with --lora-modules or --enable-lora; None: off
        self.adapters = (EngineAdapters(config, self.runner, notify=self._wake)
                         if config.lora else None)
        mc = self.runner.config
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, mc)
        num_pages = self.runner.num_pages_for(self.max_model_len)
        kv_dtype = str(self.runner.kv_dtype).removeprefix("torch.")
        tp = config.tensor_parallel_size
        layout = KVLayout(mc.name, kv_dtype, config.page_size, mc.num_layers,
                          self.runner.shape.num_kv_heads, mc.head_dim, tp, mc.num_kv_heads)
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
        if tp > 1:  # the workers' pools, mapped here for the transfers (kvcache/transfer/tp_peer)
            self.runner.allocate_kv(num_pages, self.max_model_len, pool=self.transfer.kv,
                                    export=kind != "none" or config.kv_host_memory_gb > 0)
            if kind != "none":
                self.transfer.add_ranks(rank_fields(layout, self.runner.rank_exports),
                                        self.runner.rank_pools)
        else:
            self.runner.allocate_kv(num_pages, self.max_model_len, pool=self.transfer.kv)
        self.kv = KVCacheManager(num_pages, config.page_size, config.enable_prefix_cache)
        # the host KV tier for preempted sequences, with --kv-host-memory-gb; None: off
        self.host_swap = (HostSwap(self.runner.kv.kv, config.kv_host_memory_gb,
                                   config.kv_host_copy_gbps,
                                   self.runner.rank_pools if tp > 1 else None)
                          if config.kv_host_memory_gb > 0 else None)  # fmt: skip
        if self.host_swap is not None:  # and the prefix cache's second level
            self.kv.attach_host(self.host_swap.tier, self.host_swap)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   self._policy(None),  # mlfq's waits for its profile
                                   adapters=self.adapters, swapper=self.host_swap,
                                   background=Background(config.background_priority,
                                                         config.background_max_seqs,
                                                         config.background_max_tokens,
                                                         config.background_prompt_every),
                                   max_prefill_step_tokens=config.max_prefill_step_tokens)
        self.requests = RequestTable()
        # The transfer thread wakes the step loop through this pipe when a send completes.
        self.wakeup_fd, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_w, False)
        sender = KVSender(self.transfer.kv, layout, notify=self._wake, key=transfer_key,
                          local_ranks=self.runner.rank_pools if tp > 1 else None)
        self.runner.kv.sender = sender
        self.exchange = KVExchange(self.kv, self.requests, self.scheduler.headroom,
                                   mc.vocab_size, self.transfer, sender,
                                   ExchangeLimits.from_config(config))
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.grammars = GrammarMatchers(config.model, mc.vocab_size, sorted(self.eos_token_ids))
        self.penalties = PenaltyPool(mc.vocab_size, self.runner.device, sorted(self.eos_token_ids))
        # what a generation holds beside its sequence: given it when added, told when it leaves
        self.side_tables: list[RequestSideTable] = [self.grammars, self.penalties]
        if self.adapters is not None:
            self.side_tables.append(self.adapters)
        self._arrivals = itertools.count()
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None
            else self.runner.cuda
        )  # fmt: skip
        self._in_flight: LaunchedStep | None = None  # async: the step launched, not yet resolved
        # The last step found work but could schedule none of it (waiting for KV pages that
        # only a message, a finished send or a lease's end can free): the loop then waits.
        self.stalled = False
        self._pending_rows: dict[str, int] = {}  # seq id -> its row in the last launch's sample
        self._compiles_before: int | None = None  # COMPILES' count when warm-up ended
        self.counters = {"prompt_tokens": 0, "cached_prompt_tokens": 0,
                         "cached_prompt_tokens_host": 0, "generation_tokens": 0,
                         "generate_queue_timeouts": 0}
        # generations failed before a step started on them (their queue_s passed), for the
        # core process to answer: taken by `take_rejected`
        self._rejected: list[tuple[str, MicroservingError]] = []
        self._init_handlers()
        self.loop = LoopCounters()  # steps and tokens here; the core process adds its time
        self.device_timeline = DeviceTimeline(self.loop, self.runner.cuda)
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
            max_prefill_step_tokens=config.max_prefill_step_tokens,
            kv_transfer=self.transfer.kind,
            quantization="fp8" if fp8.is_quantized(self.runner.model) else None,
            kv_cache_dtype=kv_dtype,
            max_loras=config.max_loras if self.adapters is not None else 0,
            lora_adapters=self.adapters.registry.registered() if self.adapters else [],
            tensor_parallel_size=config.tensor_parallel_size,
        )
        if self.runner.cuda and config.warmup:
            log.info("warmed up in %.1f s", self.warm_up())
        if config.scheduling_policy == "mlfq" or self.host_swap is not None:
            profile = measure_prefill(self)
            log.info("prefill profile: %.2f ms + %.4f ms per token",
                     profile.fixed_s * 1e3, profile.per_token_s * 1e3)
            if config.scheduling_policy == "mlfq":
                self.scheduler.policy = self._policy(profile)
                log.info("mlfq base quantum %.2f ms", self.scheduler.policy.base_quantum_s * 1e3)
            if self.host_swap is not None:  # what swapping is weighed against
                self.host_swap.prefill_s = profile.predict
                log.info("host KV tier: %d pages, copies at %.1f GB/s",
                         self.host_swap.tier.pool.num_pages,
                         self.host_swap.measure_copy_rate() / 1e9)
        if self.runner.cuda and config.warmup:
            # compiles from here on mean warm-up missed a shape (one watch per process)
            self._compiles_before = COMPILES.compiles if COMPILES.start() else None
        log.info("engine core ready: %s", self.info)

    WARMUP_LENGTHS = WARMUP_LENGTHS

    def _policy(self, profile: PrefillProfile | None) -> SchedulingPolicy:
        """The configured scheduling policy; FCFS for mlfq until its `profile` is measured."""
        c = self.config
        if c.scheduling_policy == "mlfq" and profile is None:
            return FCFS()
        return make_policy(c.scheduling_policy, starvation_s=c.scheduling_starvation_s,
                           profile=profile, num_levels=c.mlfq_levels,
                           base_quantum_s=c.mlfq_base_quantum_s)

    def warm_up(self) -> float:
        """Serve the start-up requests, then forget them (engine/core/warmup.py). Returns the
        seconds it took."""
        return warm_up(self, self.WARMUP_LENGTHS)

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

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def _wake(self) -> None:
        try:
            os.write(self._wakeup_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop is woken anyway
            pass

    def close(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
        self.exchange.sender.close()
        self.transfer.close()
        self.runner.close()
        os.close(self._wakeup_w)
        os.close(self.wakeup_fd)

    # ---- inspection ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.kv.stats()
        self.device_timeline.collect()  # the steps the device finished since the last step
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_pages_total=s.total_pages,
            kv_pages_free=s.free_pages,
            kv_pages_cached=s.cached_pages,
            kv_pages_used=s.used_pages,
            kv_pages_pinned=s.pinned_pages,
            kv_host_pages_cached=s.host_cached_pages,
            preemptions=self.scheduler.num_preemptions,
            preemptions_by_reason=dict(self.scheduler.preemptions_by_reason),
            scheduling_promotions=self.scheduler.policy.promotions,
            mlfq_queue_requests=list(self.scheduler.policy.stats().values()),
            **self.counters,
            triton_compiles_after_warmup=(0 if self._compiles_before is None
                                          else COMPILES.compiles - self._compiles_before),
            **self.exchange.stats(),
            **asdict(self.loop),
            **(self.adapters.stats() if self.adapters is not None else {}),
            **(self.host_swap.stats() if self.host_swap is not None else {}),
            lora_running=self._adapter_names(self.scheduler.running),
            lora_waiting=self._adapter_names(self.scheduler.waiting),
        )

    def _adapter_names(self, seqs) -> list[str]:
        """The adapters `seqs` run with, by name, each once (sorted)."""
        if self.adapters is None:
            return []
        registry = self.adapters.registry
        return sorted({a.name for s in seqs if s.lora_id and (a := registry.get(s.lora_id))})

    def check_integrity(self) -> None:
        """The KV pages and the penalty pool's rows, then the request table against the
        scheduler, the pages and the side tables (grammar matchers, penalty pool). Raises
        IntegrityError."""
        self.kv.check_integrity()
        self.penalties.check_integrity()
        if self.adapters is not None:
            self.adapters.check_integrity()
        if self.host_swap is not None:
            self.host_swap.check_integrity({s.request_id for s in (*self.scheduler.running,
                                                                   *self.scheduler.waiting)},
                                           self.kv.cache.host_pages())
        self.requests.check_integrity(self.scheduler, self.kv, side_tables=self.side_tables)
