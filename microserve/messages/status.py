"""What an engine is and how loaded (its info, liveness and stats), and a stream's error."""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec import Struct

from microserve.messages.sampling import GenerateChunk


@dataclass(slots=True)
class EngineInfo:
    """Facts the engine core reports once it has loaded the model and sized the KV pool."""

    model_name: str
    model_dir: str
    device: str
    dtype: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    page_size: int
    num_pages: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_transfer: str  # how this engine receives KV: shm, tcp, cuda_ipc, nvshmem or none
    quantization: str | None = None  # fp8: the projections' weights (dtype is the activations')
    kv_cache_dtype: str | None = None  # the KV pool's element type, e.g. float8_e4m3fn
    deployment: str | None = None  # set by the engine frontend: the deployment it belongs to
    max_loras: int = 0  # LoRA slots; 0: LoRA off
    lora_adapters: list[str] = field(default_factory=list)  # registered at start-up
    tensor_parallel_size: int = 1  # GPUs (ranks) the model is split over
    max_prefill_step_tokens: int = 0  # a step's budget with no decoding row (0: not reported)


@dataclass(slots=True)
class Liveness:
    """GET /microserving/live: whether the engine is alive and its core making progress. The
    frontend answers it from its event loop at once, never waiting for the core, and without
    the engine key (the router sends the key to no engine that has not proved it holds it)."""

    core_silent_s: float  # since the core's last heartbeat (it sends them in a step too)
    steps: int  # steps the core had begun at that heartbeat
    in_step_s: float  # how long the step it was in had run then (0: between steps)
    # auth.engine_proof(the engine key, the query's challenge); None without either
    proof: str | None = None


@dataclass(slots=True)
class EngineStats:
    """Load and KV accounting (GET /microserving/stats "stats"; Prometheus on /metrics)."""

    running: int  # requests running
    waiting: int  # requests waiting for admission
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int  # held only by the prefix cache (reusable)
    kv_pages_used: int  # held by running requests
    kv_pages_pinned: int
    preemptions: int
    prompt_tokens: int  # of finished requests
    cached_prompt_tokens: int  # served from the prefix cache
    generation_tokens: int
    kv_reservations: int  # prep_recv reservations waiting for KV or a start_generate
    kv_recv_waiting: int  # prep_recv calls waiting for KV pages
    kv_send_jobs: int  # remote_send calls in progress
    kv_leases_expired: int
    kv_tokens_sent: int
    kv_tokens_received: int
    kv_recv_waited: int  # prep_recv calls that had to wait for pages
    kv_recv_wait_timeouts: int  # ... and waited their wait_s in vain (503)
    kv_send_queue_timeouts: int = 0  # remote_send calls not started within their queue_s (503)
    generate_queue_timeouts: int = 0  # start_generate calls not started within their queue_s
    # Triton kernels compiled after warm-up (engine/kernels/compile_watch.py): each stalled a
    # step; warm-up should have served that shape
    triton_compiles_after_warmup: int = 0
    # The core's steps and where its time went (engine/loop_stats.py)
    steps: int = 0
    prompt_tokens_computed: int = 0  # through the forward pass (cached ones not)
    tokens_sampled: int = 0
    step_seconds: float = 0.0  # scheduling, launching, waiting for the GPU's last step
    device_wait_seconds: float = 0.0  # of step_seconds: waiting for the step before to run
    send_seconds: float = 0.0  # writing outputs to the frontend
    message_seconds: float = 0.0  # handling the frontend's requests and calls
    idle_seconds: float = 0.0  # waiting with nothing to run
    device_busy_seconds: float = 0.0  # the GPU's time running steps (CUDA events; 0 on CPU)
    device_steps_ahead: int = 0  # steps launched, not yet run, summed over launches
    device_decode_seconds: float = 0.0  # of device_busy_seconds: steps that only decoded
    device_decode_steps: int = 0
    device_decode_seqs: int = 0  # their sequences, summed (/ steps: the mean batch)
    device_prompt_seconds: float = 0.0  # of device_busy_seconds: steps in which nothing decoded
    device_prompt_steps: int = 0
    device_prompt_tokens: int = 0  # their tokens, summed (/ steps: the mean step)
    # launches held until the step in flight neared its end (--launch-ahead-layers), the
    # core's time holding them (of step_seconds), requests that arrived while they were held
    launch_holds: int = 0
    launch_hold_seconds: float = 0.0
    launch_hold_arrivals: int = 0
    # LoRA adapters (docs/lora.md): those requests may name, those in the GPU's slots now,
    # those a /v1/load_lora_adapter is reading from disk (not requestable yet)
    lora_registered: list[str] = field(default_factory=list)
    lora_resident: list[str] = field(default_factory=list)
    lora_loading: list[str] = field(default_factory=list)
    # adapters the running and the waiting requests name (vLLM's lora_requests_info)
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    lora_loads: int = 0  # adapters read from disk (start-up and /v1/load_lora_adapter)
    lora_load_seconds: float = 0.0  # ... the time that took, checking and reading them
    lora_slot_writes: int = 0  # adapters copied into a slot (on first use, after an eviction)
    lora_slot_write_seconds: float = 0.0
    lora_host_slabs: int = 0  # host-memory slabs allocated for adapters' copies (pinned on CUDA)
    lora_host_copies: int = 0  # adapters whose host copy is kept (at most --max-cpu-loras)
    lora_reads_back: int = 0  # host copies dropped past --max-cpu-loras, read back from disk
    # Scheduling (engine/policies.py): preemptions by why ("pages": a running request needed a
    # page; "priority": a request the policy ranks higher took the place), requests promoted
    # for waiting past the starvation bound, and mlfq's requests per queue (top first)
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    scheduling_promotions: int = 0
    mlfq_queue_requests: list[int] = field(default_factory=list)
    # The host KV tier (--kv-host-memory-gb; engine/host_swap.py): preempted requests swapped
    # out and back in, the bytes each way, preemptions that recomputed instead (cheaper, or
    # the host pool was full), and the host pool's pages
    kv_swap_outs: int = 0
    kv_swap_ins: int = 0
    kv_swap_out_bytes: int = 0
    kv_swap_in_bytes: int = 0
    kv_swap_recomputes: int = 0
    kv_swap_copies_beside: int = 0  # of those copies, the ones made beside steps (narrow grid)
    kv_host_pages_total: int = 0
    kv_host_pages_free: int = 0
    # The host tier as the prefix cache's second level: pages demoted to it and loaded back,
    # those it holds now, and the prompt tokens of cached_prompt_tokens that came from it
    kv_host_prefix_demoted_pages: int = 0
    kv_host_prefix_loaded_pages: int = 0
    kv_host_pages_cached: int = 0
    cached_prompt_tokens_host: int = 0


class StatsResponse(Struct, omit_defaults=True):
    """GET /microserving/stats: the core's load, the engine's facts, and with `?check=1` the
    integrity check's verdict ("ok", or what is wrong)."""

    stats: EngineStats
    info: EngineInfo
    integrity: str | None = None


class ErrorDetail(Struct):
    """OpenAI's error object (microserve/errors.py)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class StreamError(Struct):
    """The last item of a start_generate stream that failed after its status line went out:
    the status and error the call would have been answered with."""

    status: int
    error: ErrorDetail


class ChannelItem(Struct, omit_defaults=True):
    """One item of a channel (GET /microserving/channel/{id}): a chunk after the first of a
    start_generate bound to the channel, or the StreamError that ends it."""

    request_id: str
    chunk: GenerateChunk | None = None
    error: StreamError | None = None
