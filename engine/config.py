"""Engine configuration: what the user asked for (what was found at start-up is
microserve.messages.EngineInfo)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.policies import POLICIES, PRIORITY_MAX, PRIORITY_MIN  # plain data: no torch
from microserve.backend import QUEUE_TIMEOUT_S
from microserve.bounds import BACKGROUND_PRIORITY, INT32_MAX
from microserve.model_config import ModelConfig  # plain data: no torch
from kvcache.transfer.nvshmem_group import check_member

MAX_LEASE_S = 86400.0  # a day: any longer lease is a reservation nobody will consume

# The step budget and the running sequences when not given. On a GPU, steps of 512 tokens
# leave its GEMMs short of work: 400 requests of 1,024 tokens in, 128 out, sent at once, ran
# at 20.8k tokens/s with 512 and 27.8-30.1k with 2,048 (8,192: the same throughput, twice the
# inter-token latency while prompts are prefilled); H100, bench.serve, docs/benchmarks.md.
# A step in which no sequence decodes keeps nobody's next token waiting, so it may take up to
# max_prefill_step_tokens, as vLLM's server takes 8,192 a step on such a GPU: 8 x 4,096-token
# prompts prefilled at 38,266 tokens/s in steps of 8,192 against 33,972 in steps of 2,048 on
# an H100, 40,388 against 40,003 on an H200 (one bench.peers call each, docs/benchmarks.md).
# None: the step budget (no larger prompt-only steps).
DEVICE_DEFAULTS = {
    "cpu": {"max_num_batched_tokens": 512, "max_num_seqs": 256, "max_prefill_step_tokens": None},
    "cuda": {"max_num_batched_tokens": 2048, "max_num_seqs": 256,
             "max_prefill_step_tokens": 8192},
}

# --kv-cache-dtype: auto is the model's dtype; fp8_e4m3 is fp8's other name (vLLM takes both)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
BLAS_LIBRARIES = ("cublas", "cublaslt")  # torch.backends.cuda.preferred_blas_library's


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a resolved local Hugging Face directory (see microserve.model_files)
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    page_size: int = 16
    kv_cache_memory_gb: float = 1.0  # KV pool size on CPU
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory the engine may use
    num_pages: int | None = None  # overrides kv_cache_memory_gb when set (tests)
    # Per-step token budget (prefill chunk + decodes) and running sequences; None: the
    # device's default (DEVICE_DEFAULTS).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    # The budget of a step in which no running sequence decodes (prompt chunks only: a burst
    # arriving at an idle engine, a long prompt alone, a prefill engine of P/D): at least
    # max_num_batched_tokens. None: the device's default, raised to max_num_batched_tokens.
    max_prefill_step_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True
    # Which waiting and running sequences go first (engine/policies.py): fcfs, priority (the
    # request's `priority`, lower first) or mlfq (FastServe's skip-join MLFQ). Under priority
    # and mlfq a sequence that has not run for scheduling_starvation_s is promoted to the top.
    scheduling_policy: str = "fcfs"
    scheduling_starvation_s: float = 10.0
    # Background (filler) work, engine/scheduler.py's Background: a request whose priority is at
    # or past background_priority (a batch job's lines: the router sends them at
    # BACKGROUND_PRIORITY) gets at most background_max_seqs rows and background_max_tokens
    # tokens of a step while other requests run or wait, under any policy.
    background_priority: int = BACKGROUND_PRIORITY
    background_max_seqs: int = 4
    background_max_tokens: int = 32
    # >1: background prompt chunks wait until this many steps' worth of background_max_tokens
    # is saved and run in one step (engine/background.py: a step with prompt tokens leaves the
    # whole decode CUDA graph)
    background_prompt_every: int = 1
    mlfq_levels: int = 8  # mlfq: its queues
    # mlfq: queue 0's quantum in predicted seconds of running (queue i's: 2**i times it);
    # None: 8 one-token steps of the start-up profile
    mlfq_base_quantum_s: float | None = None
    # Host memory for the KV of preempted sequences (kvcache/host_tier.py, engine/host_swap.py):
    # a preempted sequence whose KV copies back faster than it recomputes is swapped out to it
    # and resumes without recomputing; 0: off, every preemption recomputes.
    kv_host_memory_gb: float = 0.0
    # The host <-> device copy rate the swap-or-recompute choice assumes, one way; None:
    # measured at start-up (a round trip of a few pages).
    kv_host_copy_gbps: float | None = None
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    # CUDA: steps with prompt tokens, up to this many tokens in all, replay piecewise CUDA
    # graphs (attention eager between them; engine/cuda_graphs.py); 0: they run eagerly. An
    # 8B model's eager step waits on Python's launches (H100: a 576-token step 27.6 ms eager,
    # 20.0 ms as pieces), and with fp8 weights so does a full 2,048-token step (the CUDA
    # default budget): 48 ms eager against 40 ms as pieces on one host. Steps above it run
    # eagerly (the step budget caps it anyway).
    max_piecewise_tokens: int = 2048
    # CUDA: above 512 tokens, piecewise graphs are captured every this many tokens, and a step
    # pads to the next. Padded rows cost GEMM time like real ones there: at 256 apart (before
    # 2026-11-29), 1,024 prompt tokens beside 19 decodes ran as 1,280 rows.
    piecewise_bucket_step: int = 64
    # CUDA: a step of decodes beside one prompt chunk of at most this many tokens (a batch
    # job's room in a live step, a prompt's last piece) replays one whole graph per decode
    # bucket, the chunk padded to this size (engine/cuda_graphs.py, MixedGraphs); 0: off,
    # such steps replay the piecewise graphs. One-GPU engines without LoRA only. Off by
    # default: on one H200 beside a batch (32) it cut live TPOT p99 in two calls of three and
    # raised live TTFT p99 in all three (docs/benchmarks.md, "Mixed CUDA graphs").
    mixed_graph_tokens: int = 0
    # CUDA: before it reports ready, the engine serves a few requests of its own (EngineCore
    # .warm_up) so that the Triton kernels a shape needs compile then, not during the first
    # user requests of that shape (~1 s each on an H100)
    warmup: bool = True
    # launch step N before reading step N-1's tokens back; None: on for CUDA, off for CPU
    # (where the host is not waiting on a device and overlap would only delay each token)
    async_scheduling: bool | None = None
    # CUDA, async scheduling: while a step replayed as piecewise graphs (prompt tokens, up to
    # max_piecewise_tokens) runs, the next step is scheduled only once this many of its layers
    # are left on the GPU, so that a prompt arriving during the step makes the next one, not
    # the one after it; 0: scheduled at once (engine/core_proc.py, CoreLoop._hold_launch)
    launch_ahead_layers: int = 0
    # auto: triton on CUDA, torch elsewhere; "triton" on CPU needs TRITON_INTERPRET=1 (tests)
    attention_backend: str = "auto"
    # triton backend: whole prompts (no cached prefix, at most 8 a step) attend with the paged
    # extend kernel as every other prompt chunk ("paged"), or with torch's fused SDPA (cuDNN's
    # kernel) over the step's own K/V when each has 4,096 tokens or more ("auto") or whatever
    # their length ("sdpa"); an fp8 KV cache keeps the paged kernel. Not the default: cuDNN
    # builds a graph for each new prompt length (engine/attention/triton_backend.py)
    prompt_attention: str = "paged"
    # CUDA, 16-bit weights: batch-1 decode projections through the Triton GEMV (not cuBLAS)
    decode_gemv: bool = True
    # CUDA, 16-bit weights: decode steps of 2..N rows (N <= 16) run their projections and the
    # LM head through the Triton few-rows kernel (engine/kernels/few_rows.py), each weight read
    # once for all rows, instead of cuBLAS; 0: off; None (auto): 16 on one GPU whose tiles
    # were swept (an H200: steps of 2-16 rows 2-6% faster), else off
    few_rows_gemm: int | None = None
    # CUDA: the decode-path kernels launch with programmatic dependent launch where the GPU has
    # it (sm_90+; engine/kernels/pdl.py). bench.engine_gpu --no-pdl turns it off.
    pdl: bool = True
    # CUDA: torch's GEMM library (cublas or cublaslt) for the GEMMs captured in CUDA graphs,
    # and for those of steps run eagerly (engine/model_runner.py says why cublaslt);
    # bench.engine_gpu --blas and --eager-blas
    blas_library: str = "cublaslt"
    eager_blas_library: str = "cublaslt"
    # fp8: the decoder layers' projections quantized to float8 e4m3 at load, one scale per
    # output channel; activations per token (engine/models/fp8.py). None: the model's dtype.
    quantization: str | None = None
    # The KV cache's element type. auto: the model's dtype. fp8 (or fp8_e4m3): float8 e4m3,
    # stored with scale 1 and saturated at +-448 (as vLLM does without calibrated scales);
    # half the bytes of bf16, so twice the tokens in the same memory and half the KV a
    # decode step reads. Engines exchange KV only with engines of the same KV dtype.
    kv_cache_dtype: str = "auto"
    # While it works, the core logs its steps, throughput, load and where its time went every
    # this many seconds (engine/loop_stats.py); 0: never
    log_stats_interval_s: float = 10.0
    seed: int = 0  # engine-wide generator for requests without a seed
    # torch's CPU threads; None: torch's default (every core). Engines sharing a host must
    # split the cores: two engines each spinning on every core run ~10x slower (measured).
    cpu_threads: int | None = None
    # How this engine receives KV from peers: shm (CPU, same host), tcp (any host), cuda_ipc
    # (GPUs, one host), nvshmem (GPUs of one NVSHMEM group), none; auto: see
    # resolved_kv_transfer. Sending works toward any kind a peer offers (nvshmem: from members
    # of the receiver's group only).
    kv_transfer: str = "auto"
    # nvshmem: this engine's place in its deployment's group, RANK/SIZE@DIR (set by `microserve
    # up` through MICROSERVE_NVSHMEM_GROUP; kvcache/transfer/nvshmem_group.py)
    nvshmem_group: str | None = None
    kv_transfer_host: str = "127.0.0.1"  # tcp: where the transfer listener binds
    kv_transfer_port: int = 0  # tcp: 0 picks a free port
    kv_transfer_advertise_host: str | None = None  # tcp: the address peers dial, if not host
    # A prep_recv reservation is freed when its sender has not renewed it for this long (the
    # sender renews every 0.25 s while it holds the job, queued or computing).
    kv_lease_s: float = 15.0
    kv_lease_max_s: float = 600.0  # the longest lease a prep_recv may ask for
    # How long a prep_recv waits for pages when its call names no wait_s, and the most it may
    # name; then a 503.
    kv_recv_wait_s: float = 60.0
    kv_recv_wait_max_s: float = 3600.0
    # Ranks the model is split over (engine/tp/, engine/models/parallel.py): one process each,
    # on GPUs device + 0 .. size - 1 (CPU: gloo, for tests). A collective that waits longer
    # than tensor_parallel_timeout_s on a rank fails instead of hanging.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0
    # How the ranks sum a layer's partial products: "nccl"; "one-shot" over symmetric memory
    # for messages up to 512 KiB (engine/tp/allreduce.py), NCCL above; or "auto": one-shot
    # where it can be set up and, with two ranks, the copy-engine exchange for eager steps'
    # messages of 1 MiB and more (engine/tp/exchange.py), NCCL for the rest.
    all_reduce: str = "auto"
    # A tensor-parallel step of at least this many tokens (a large prompt step: they run
    # eagerly, above max_piecewise_tokens) is computed in two row halves, each half's
    # all-reduces overlapping the other half's GEMMs (LlamaModel._forward_overlapped); 0: off.
    # Engines with LoRA adapters never overlap (their slots are per row of the whole step).
    tp_overlap_tokens: int = 4096
    # A request sent to this engine's own /v1 that no step has started on within this long
    # fails with a 503 (code queue_timeout) and Retry-After, holding nothing; the router's
    # calls carry the router's own queue_timeout_s instead. The router's default.
    queue_timeout_s: float = QUEUE_TIMEOUT_S
    # LoRA adapters (engine/lora/, docs/lora.md): (name, path) served from the start; on with
    # any of them or with enable_lora (adapters then come through /v1/load_lora_adapter).
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident in the GPU's slots at once (every step may mix them)
    max_lora_rank: int = 16  # slots are this wide: an adapter of higher rank is refused
    # adapters whose host copy (a pinned slab, ~92 MB for rank 16 over Llama-3.1-8B) is kept,
    # least recently used dropped past it and read back from disk when next needed (vLLM's
    # --max-cpu-loras); None: every registered adapter's. At least max_loras.
    max_cpu_loras: int | None = None
    # where /v1/load_lora_adapter may read adapters from (its lora_path must resolve inside);
    # None: runtime loading is refused (start-up --lora-modules may be anywhere)
    lora_dir: str | None = None

    @property
    def lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def resolved_kv_transfer(self, has_key: bool = True) -> str:
        """The backend to receive with. auto: shm on CPU, cuda_ipc on CUDA, but only with an
        engine key (KV transfer is authenticated by it); none without one. A tensor-parallel
        engine moves KV only with these two (kvcache/transfer/tp_peer.py)."""
        if self.kv_transfer == "auto":
            if not has_key:
                return "none"
            return "cuda_ipc" if self.device.startswith("cuda") else "shm"
        return self.kv_transfer

    def __post_init__(self):
        defaults = DEVICE_DEFAULTS["cuda" if self.device.startswith("cuda") else "cpu"]
        prefill_given = self.max_prefill_step_tokens is not None
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if not 0 <= self.log_stats_interval_s < float("inf"):  # NaN fails too
            raise ValueError(f"log_stats_interval_s must be a number of seconds >= 0 (0: never), "
                             f"got {self.log_stats_interval_s}")
        if self.tp_overlap_tokens < 0:
            raise ValueError(f"tp_overlap_tokens must be >= 0, got {self.tp_overlap_tokens}")
        if self.max_piecewise_tokens < 0:
            raise ValueError(f"max_piecewise_tokens must be >= 0, got {self.max_piecewise_tokens}")
        if not 0 <= self.launch_ahead_layers <= 1024:
            raise ValueError(f"launch_ahead_layers must be 0 (off) to 1024, got "
                             f"{self.launch_ahead_layers}")
        if self.few_rows_gemm is not None and not 0 <= self.few_rows_gemm <= 16:
            raise ValueError(f"few_rows_gemm must be 0 (off) to 16 rows, got {self.few_rows_gemm}")
        if not 1 <= self.piecewise_bucket_step <= 2048:
            raise ValueError(f"piecewise_bucket_step must be 1 to 2048 tokens, got "
                             f"{self.piecewise_bucket_step}")
        if not 0 <= self.mixed_graph_tokens <= 256:
            raise ValueError(f"mixed_graph_tokens must be 0 (off) to 256, got "
                             f"{self.mixed_graph_tokens}")
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not prefill_given:  # the default never lowers a budget the user raised
            object.__setattr__(self, "max_prefill_step_tokens", max(
                self.max_prefill_step_tokens or 0, self.max_num_batched_tokens))
        elif self.max_prefill_step_tokens < self.max_num_batched_tokens:
            raise ValueError(f"max_prefill_step_tokens ({self.max_prefill_step_tokens}) must be "
                             f">= max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}"
            )
        if self.prompt_attention not in ("auto", "paged", "sdpa"):
            raise ValueError("prompt_attention must be auto, paged or sdpa; got "
                             f"{self.prompt_attention!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_transfer not in ("auto", "shm", "tcp", "cuda_ipc", "nvshmem", "none"):
            raise ValueError(f"kv_transfer must be auto, shm, tcp, cuda_ipc, nvshmem or none; got "
                             f"{self.kv_transfer!r}")
        if self.kv_transfer == "nvshmem":  # fail before the model loads, not after
            check_member(self.device, self.nvshmem_group)
        if not 0 < self.kv_lease_s <= self.kv_lease_max_s <= MAX_LEASE_S:
            raise ValueError(f"need 0 < kv_lease_s ({self.kv_lease_s}) <= kv_lease_max_s "
                             f"({self.kv_lease_max_s}) <= {MAX_LEASE_S:.0f}")
        if not 0 <= self.kv_recv_wait_s <= self.kv_recv_wait_max_s <= MAX_LEASE_S:
            raise ValueError(f"need 0 <= kv_recv_wait_s ({self.kv_recv_wait_s}) <= "
                             f"kv_recv_wait_max_s ({self.kv_recv_wait_max_s}) <= "
                             f"{MAX_LEASE_S:.0f}")
        if not 0 < self.queue_timeout_s <= 3600:  # NaN fails too; the router's bounds
            raise ValueError(f"queue_timeout_s must be in (0, 3600] s, got {self.queue_timeout_s}")
        for name in ("blas_library", "eager_blas_library"):
            if getattr(self, name) not in BLAS_LIBRARIES:
                raise ValueError(f"{name} must be one of {', '.join(BLAS_LIBRARIES)}; got "
                                 f"{getattr(self, name)!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                             f"{self.kv_cache_dtype!r}")
        # (name, path) pairs; JSON (the core process's config) brings them as lists
        object.__setattr__(self, "lora_modules", tuple(tuple(m) for m in self.lora_modules))
        if self.lora:
            for name in ("max_loras", "max_lora_rank"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                                 f"max_loras ({self.max_loras})")
            names = [name for name, _ in self.lora_modules]
            if len(set(names)) < len(names):
                raise ValueError(f"lora_modules names must differ, got {', '.join(names)}")
            if self.quantization is not None:
                raise ValueError("LoRA adapters over fp8 weights are not supported yet "
                                 "(--quantization with --lora-modules or --enable-lora)")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}; got "
                             f"{self.scheduling_policy!r}")
        if not 0 < self.scheduling_starvation_s <= MAX_LEASE_S:
            raise ValueError(f"scheduling_starvation_s must be in (0, {MAX_LEASE_S:.0f}] s, got "
                             f"{self.scheduling_starvation_s}")
        if not 0 <= self.background_max_seqs <= INT32_MAX or not (
                0 <= self.background_max_tokens <= INT32_MAX):
            raise ValueError(f"background_max_seqs and background_max_tokens must be >= 0, got "
                             f"{self.background_max_seqs} and {self.background_max_tokens}")
        if not 1 <= self.background_prompt_every <= 1024:
            raise ValueError(f"background_prompt_every must be in [1, 1024], got "
                             f"{self.background_prompt_every}")
        if not PRIORITY_MIN <= self.background_priority <= PRIORITY_MAX:
            raise ValueError(f"background_priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                             f"got {self.background_priority}")
        if not 1 <= self.mlfq_levels <= 32:
            raise ValueError(f"mlfq_levels must be in [1, 32], got {self.mlfq_levels}")
        if self.mlfq_base_quantum_s is not None and not 0 < self.mlfq_base_quantum_s <= 3600:
            raise ValueError(f"mlfq_base_quantum_s must be in (0, 3600] s, got "
                             f"{self.mlfq_base_quantum_s}")
        if self.kv_host_memory_gb < 0:
            raise ValueError(f"kv_host_memory_gb must be >= 0, got {self.kv_host_memory_gb}")
        if self.kv_host_copy_gbps is not None and self.kv_host_copy_gbps <= 0:
            raise ValueError(f"kv_host_copy_gbps must be > 0, got {self.kv_host_copy_gbps}")
        if self.all_reduce not in ("auto", "nccl", "one-shot"):
            raise ValueError(f"all_reduce must be auto, nccl or one-shot, got "
                             f"{self.all_reduce!r}")
        if self.tensor_parallel_size != 1:
            self._check_tensor_parallel()
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    def _check_tensor_parallel(self) -> None:
        """What a tensor-parallel engine cannot do yet, refused before the model loads, and a
        rank count the model's heads do not divide (ModelConfig.check_tensor_parallel)."""
        size = self.tensor_parallel_size
        if not 1 <= size <= 64:
            raise ValueError(f"tensor_parallel_size must be in [1, 64], got {size}")
        if self.all_reduce == "one-shot" and not str(self.device).startswith("cuda"):
            raise ValueError(f"all_reduce one-shot needs CUDA devices, got device "
                             f"{self.device!r} (auto and nccl work on any)")
        if not 0 < self.tensor_parallel_timeout_s <= MAX_LEASE_S:
            raise ValueError(f"tensor_parallel_timeout_s must be in (0, {MAX_LEASE_S:.0f}], got "
                             f"{self.tensor_parallel_timeout_s}")
        unsupported = {"--kv-transfer nvshmem (it cannot reach every rank's pool; shm, "
                       "cuda_ipc and tcp can)": self.kv_transfer == "nvshmem"}
        for what, asked in unsupported.items():
            if asked:
                raise ValueError(f"{what} and tensor_parallel_size {size} do not work together "
                                 "yet")
        # a model not resolved to its directory yet (`up` reads deployment files before it
        # fetches random:NAME) is checked when it loads (TensorParallel.local_config)
        if (Path(self.model) / "config.json").is_file():
            ModelConfig.from_dir(self.model).check_tensor_parallel(size)
