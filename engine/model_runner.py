"""Owns the model, the KV tensor and the sampler; runs one forward step.

The runner sees plain data from the scheduler (a ForwardBatch, token ids, which rows to sample)
and returns plain data (sampled ids and logprobs). It is the one place that holds tensors, and
the part a GPU runner (CUDA graphs, overlap) replaces.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.device import to_device
from engine.kernels import pdl
from engine.lora.layers import LoraModel
from engine.models import fp8
from engine.models.loader import load_model
from engine.models.parallel import TensorParallel
from engine.penalties import StepAdjustments
from engine.sampler import PendingSample, Sampler, TokenMask
from kvcache.forward import ForwardBatch, KVSend, SeqForward
from kvcache.manager import PageCopy
from kvcache.paged import PagedKVCache
from microserve.messages import SamplingParams

if TYPE_CHECKING:  # CUDA-only modules import triton; load them only on CUDA
    from engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_blas_library(name: str) -> str:
    """Make `name` torch's GEMM library for this process; returns the one before."""
    before = torch.backends.cuda.preferred_blas_library()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental feature"
        torch.backends.cuda.preferred_blas_library(name)
    return str(before).rsplit(".", 1)[-1].lower()


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel `rank` of an engine on `device`: cuda:N puts rank r on
    GPU N + r (cpu: every rank on the CPU)."""
    dev = torch.device(device)
    if dev.type != "cuda" or rank == 0:
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for --kv-cache-dtype `name` (EngineConfig.kv_cache_dtype)
    and the model's `dtype`."""
    return torch.float8_e4m3fn if name in ("fp8", "fp8_e4m3") else dtype


class ModelRunner:
    """Args: config (sizes, device), dtype. On CUDA the model runs its Triton kernels, attention
    is the Triton backend, and steps replay CUDA graphs unless config.enforce_eager: whole
    graphs for decode-only steps, piecewise ones (attention eager) for steps with prompt
    tokens up to config.max_piecewise_tokens (engine/cuda_graphs.py).

    `tp`: this process's rank of a tensor-parallel engine (engine/tp/): it holds that share of
    the model and of every KV page, on GPU config.device + rank; `config` stays the whole
    model's (vocabulary, layers), `shape` is the rank's (heads)."""

    def __init__(self, config: EngineConfig, dtype: torch.dtype,
                 tp: TensorParallel = TensorParallel()):
        self.engine_config = config
        self.tp = tp
        self.device = rank_device(config.device, tp.rank)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the current device, and the KV transfer's streams and events
            # are made there: --device cuda:N makes N current for the whole core process.
            torch.cuda.set_device(self.device)
        self.dtype = dtype
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
        if self.kv_dtype == torch.float8_e4m3fn:
            fp8.check_supported(self.device, "kv_cache_dtype fp8")
        self.model, self.config = load_model(config.model, dtype=dtype, device=self.device,
                                             quantization=config.quantization, tp=tp)
        self.shape = self.model.config  # this rank's heads and rows
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            # cuBLASLt heuristics for torch's GEMMs: at batch 128 the down projection (K 14,336)
            # ran 47 us against 55 us under the default cuBLAS path, the others equal, which
            # made a batch-128 decode step 2% faster (H100, 2026-11-23, docs/benchmarks.md).
            # The setting is process-wide; an engine owns its process.
            set_blas_library(config.eager_blas_library)
            pdl.configure(config.pdl)
        self.lora: LoraModel | None = None  # the adapters' slots, with --lora-modules
        if config.lora:
            # the most tokens one forward runs: a step, or a decode graph's largest bucket
            max_tokens = max(config.max_prefill_step_tokens, config.max_num_seqs, 512)
            self.lora = LoraModel(self.model, self.config, config.max_loras,
                                  config.max_lora_rank, max_tokens)
        backend = config.attention_backend
        self.triton = backend == "triton" or (backend == "auto" and self.cuda)
        if self.triton:
            self.model.use_triton_kernels(True, gemv=self.cuda and config.decode_gemv,
                                          few_rows=self._few_rows(config, tp.size))
        if self.lora is not None:
            self.lora.use_triton_kernels(self.triton)
        elif tp.size > 1:  # (an adapter's slots are per row of the whole step)
            self.model.model.overlap_tokens = config.tp_overlap_tokens
        self.sampler = Sampler(self.config.vocab_size, self.device, seed=config.seed,
                               triton_argmax=self.cuda and self.triton)
        self.kv: PagedKVCache | None = None  # set by allocate_kv
        self.graphs: DecodeGraphs | None = None  # set by allocate_kv on CUDA
        self.pieces: PiecewiseGraphs | None = None  # likewise
        # A step replayed as pieces records an event when this many layers are left
        # (config.launch_ahead_layers; 0: none); `forward` leaves it in near_end (or None)
        self.launch_ahead_layers = config.launch_ahead_layers
        self.near_end: torch.cuda.Event | None = None
        self._last_tokens: torch.Tensor | None = None  # the previous step's sampled ids (device)
        self._hidden: torch.Tensor | None = None  # the last forward's final hidden states

    def close(self) -> None:
        """Nothing to release: the process's end frees the device (a tensor-parallel runner
        stops its workers here)."""

    def kv_bytes_per_page(self, page_size: int) -> int:
        c = self.shape
        return PagedKVCache.bytes_per_page(
            c.num_layers, page_size, c.num_kv_heads, c.head_dim, self.kv_dtype
        )

    def num_pages_for(self, max_model_len: int) -> int:
        """KV pool size: given, or from memory (CPU: kv_cache_memory_gb; CUDA: what is left of
        gpu_memory_utilization x the GPU's memory after weights and a worst-case step)."""
        config = self.engine_config
        if config.num_pages is not None:
            return config.num_pages
        per_page = self.kv_bytes_per_page(config.page_size)
        if not self.cuda:
            return max(1, int(config.kv_cache_memory_gb * 2**30 // per_page))
        budget = config.gpu_memory_utilization * torch.cuda.get_device_properties(
            self.device
        ).total_memory
        peak = self._profile_peak_memory(max_model_len)
        if budget - peak < per_page * 2:
            raise ValueError(
                f"no GPU memory left for the KV cache: weights and activations peak at "
                f"{peak / 2**30:.1f} GiB of the {budget / 2**30:.1f} GiB allowed "
                f"(gpu_memory_utilization {config.gpu_memory_utilization})"
            )
        return int((budget - peak) // per_page)

    @torch.inference_mode()
    def _profile_peak_memory(self, max_model_len: int) -> int:
        """Peak bytes of a step with the largest token budget (one long prefill chunk of a
        prompt-only step) and a full sampling batch, run on a scratch KV pool just large
        enough for it."""
        config = self.engine_config
        n = config.max_prefill_step_tokens
        pages = -(-n // config.page_size)
        self.allocate_kv(pages, max_model_len, capture_graphs=False)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        batch = ForwardBatch([SeqForward("profile", 0, n, list(range(pages)))], config.page_size)
        rows = min(n, config.max_num_seqs)
        params = [SamplingParams(max_tokens=1, top_p=0.9, logprobs=5)] * rows
        self.execute(batch, [0] * n, list(range(n - rows, n)), params, [None] * rows).result()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv = None
        torch.cuda.empty_cache()
        return peak - pages * self.kv_bytes_per_page(config.page_size)

    def kv_shape(self, num_pages: int) -> tuple[int, ...]:
        """This rank's KV pool of `num_pages` pages (PagedKVCache's layout)."""
        c = self.shape
        return (c.num_layers, 2, num_pages, self.engine_config.page_size, c.num_kv_heads,
                c.head_dim)

    def _few_rows(self, config: EngineConfig, tp_size: int) -> int:
        """--few-rows-gemm, auto (None) resolved: 16 on one GPU whose few-rows tiles were
        swept (engine/kernels/few_rows.py, _TILES_BY_GPU), else 0 (cuBLAS)."""
        if config.few_rows_gemm is not None:
            return config.few_rows_gemm
        if not self.cuda or tp_size > 1:
            return 0
        from engine.kernels.few_rows import has_swept_tiles

        return 16 if has_swept_tiles(torch.cuda.get_device_name(self.device)) else 0

    def allocate_kv(self, num_pages: int, max_model_len: int, capture_graphs: bool = True,
                    pool: torch.Tensor | None = None):
        """Build the paged KV cache (on `pool` when given: a transfer backend's memory)."""
        c, config = self.shape, self.engine_config
        if self.triton:
            from engine.attention.triton_backend import (
                DENSE_AUTO_MIN_TOKENS,
                TritonAttentionBackend,
            )

            backend = TritonAttentionBackend(
                self.device, c.num_heads, c.num_kv_heads, c.head_dim,
                max_tokens=max(config.max_prefill_step_tokens, config.max_num_seqs),
                max_seqs=config.max_num_seqs,
                max_pages_per_seq=-(-max_model_len // config.page_size),
                page_size=config.page_size,
                dense_min_tokens={"auto": DENSE_AUTO_MIN_TOKENS, "sdpa": 1}.get(
                    config.prompt_attention),
            )  # fmt: skip
        else:
            backend = TorchAttentionBackend(self.device)
        self.kv = PagedKVCache(
            c.num_layers, num_pages, config.page_size, c.num_kv_heads, c.head_dim,
            self.kv_dtype, self.device, backend, pool,
        )  # fmt: skip
        self.graphs = self.mixed = self.pieces = None
        if self.cuda and self.triton and capture_graphs and not config.enforce_eager:
            from engine.cuda_graphs import DecodeGraphs, MixedGraphs, PiecewiseGraphs

            before = set_blas_library(config.blas_library)
            # graphs hold the LoRA kernels even though no step has used an adapter yet
            lora = self.lora.batch.capturing() if self.lora is not None else nullcontext()
            try:
                with lora:
                    self.graphs = DecodeGraphs(self.model, self.kv, backend, config.max_num_seqs)
                    self.graphs.capture()
                    # not with LoRA (a LoRA step's slots follow the packed rows) nor across
                    # GPUs (not run there yet)
                    if config.mixed_graph_tokens and self.lora is None and self.tp.size == 1:
                        self.mixed = MixedGraphs(self.model, self.kv, backend,
                                                 config.max_num_seqs, config.mixed_graph_tokens)
                        self.mixed.capture()
                    tokens = min(config.max_piecewise_tokens, config.max_prefill_step_tokens)
                    if tokens > 0:
                        self.pieces = PiecewiseGraphs(self.model, self.kv, backend, tokens,
                                                      config.piecewise_bucket_step)
                        self.pieces.capture()
            finally:
                set_blas_library(before)

    @torch.inference_mode()
    def execute(
        self,
        batch: ForwardBatch,
        input_ids: list[int],
        sample_rows: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        copies: list[PageCopy] = (),
        from_last: list[tuple[int, int]] = (),
        sends: list[KVSend] = (),
        mask: TokenMask | None = None,
        adjust: StepAdjustments | None = None,
    ) -> PendingSample | None:
        """`forward`, then `sample` its logits (with `mask`'s constrained rows and `adjust`'s
        logit adjustments), if any row is sampled. Returns without waiting for the GPU."""
        logits = self.forward(batch, input_ids, sample_rows, copies, from_last, sends)
        if logits is None:
            return None
        return self.sample(logits, params, generators, mask, adjust)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        input_ids: list[int],
        sample_rows: list[int],
        copies: list[PageCopy] = (),
        from_last: list[tuple[int, int]] = (),
        sends: list[KVSend] = (),
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Launch one step's forward pass: append KV for `input_ids` (packed per `batch`) and
        return the logits at each of `sample_rows` (packed row indices), None if there are
        none. `sample` must follow before the next `forward` when there are.

        `from_last` lists (input index, sampled row of the previous step): inputs whose value
        is the previous step's sampled token, which may not have reached the host yet (async
        scheduling); they are filled on the device. `sends` are KV transfers to start layer
        by layer during this step (`PagedKVCache.mark_send`). `lora_slots`: each input's LoRA
        slot (-1: the base model); None: all the base. Returns without waiting for the GPU.
        """
        self.near_end = None
        if self.lora is not None:
            self.lora.batch.set_slots(lora_slots or ())
        if copies:
            self.kv.copy_pages(copies)
        if sends:
            self.kv.mark_send(list(sends))
        fill = None
        if from_last:
            dst, src = zip(*from_last)
            fill = (to_device(dst, torch.long, self.device),
                    self._last_tokens[to_device(src, torch.long, self.device)])  # fmt: skip
        if self.graphs is not None and not sends and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch, input_ids, fill)
        elif self.mixed is not None and not sends and self.mixed.can_run(batch):
            hidden = self.mixed.run(batch, input_ids, fill)
        elif self.pieces is not None and self.pieces.can_run(batch):
            hidden = self.pieces.run(batch, input_ids, fill, self.launch_ahead_layers)
            self.near_end = self.pieces.near_end
        else:
            hidden = self._forward_eager(batch, input_ids, fill)
        self._last_tokens = None
        self._hidden = hidden  # for `score`, until the next forward
        if not sample_rows:
            return None
        rows = to_device(sample_rows, torch.long, self.device)
        return self.model.compute_logits(hidden[rows])

    # Rows of logits a `score` call makes at once: 256 x a 128k vocabulary is 128 MiB of fp32
    # (twice, with the log-softmax), where a whole 2,048-token chunk would take 2 GiB.
    SCORE_ROWS = 256

    @torch.inference_mode()
    def score(self, rows: list[int], token_ids: list[int],
              num_top: list[int]) -> list[PendingSample]:
        """Logprobs of `token_ids` at the last forward's packed `rows` (prompt tokens scored
        by the position before each), in blocks of SCORE_ROWS. Call before the next forward."""
        pending = []
        for i, logits in zip(range(0, len(rows), self.SCORE_ROWS), self.score_logits(rows)):
            pending.append(self.sampler.score_async(logits, token_ids[i : i + self.SCORE_ROWS],
                                                    num_top[i : i + self.SCORE_ROWS]))
        return pending

    def score_logits(self, rows: list[int]) -> Iterator[torch.Tensor]:
        """The logits at the last forward's packed `rows`, SCORE_ROWS at a time (under tensor
        parallelism each block is a collective: every rank walks the same blocks)."""
        for i in range(0, len(rows), self.SCORE_ROWS):
            block = to_device(rows[i : i + self.SCORE_ROWS], torch.long, self.device)
            yield self.model.compute_logits(self._hidden[block])

    def use_sampled(self, token_ids: torch.Tensor) -> None:
        """The last step's sampled ids, sampled by another rank: the next step's `from_last`
        inputs (a tensor-parallel worker, which does not sample)."""
        self._last_tokens = token_ids

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None], mask: TokenMask | None = None,
               adjust: StepAdjustments | None = None) -> PendingSample:
        """Sample the logits `forward` returned (one row per params); the next step's
        `from_last` inputs come from these tokens, and the penalties' counts (`adjust`) get
        them on the device."""
        pending = self.sampler.sample_async(logits, params, generators, mask, adjust)
        self._last_tokens = pending.token_ids
        return pending

    def _forward_eager(self, batch: ForwardBatch, input_ids: list[int], fill=None):
        dev = self.device
        ids = to_device(input_ids, torch.long, dev)
        if fill is not None:
            ids[fill[0]] = fill[1]
        positions = to_device(batch.positions(), torch.long, dev)
        self.kv.begin_forward(batch)
        try:
            return self.model(ids, positions, self.kv)
        finally:
            self.kv.end_forward()
