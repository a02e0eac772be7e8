"""vLLM's names for the figures microserve already measures, on the same /metrics page.

What watches a vLLM server reads these names: an autoscaler on `vllm:num_requests_waiting`
(KEDA, the production stack), the Gateway API inference extension's endpoint picker (waiting
requests and `vllm:kv_cache_usage_perc`), vLLM's Grafana dashboard (the latency histograms).
Each is labelled `model_name` (the served name), as vLLM labels its own. Only figures whose
meaning is the same as vLLM's are exported under its names (docs/from-vllm.md#metrics):

    vllm:num_requests_running / _waiting      the engine core's running / waiting requests
    vllm:kv_cache_usage_perc (0..1)           KV pages held by requests / all pages; pages
    vllm:gpu_cache_usage_perc                   only the prefix cache holds count as free, as
                                                vLLM's evictable cached blocks do (the older
                                                name too, for older watchers)
    vllm:num_preemptions_total                requests preempted
    vllm:prompt_tokens_total                  prompt tokens of finished requests
    vllm:generation_tokens_total              tokens they generated
    vllm:prefix_cache_queries_total / _hits_total   their prompt tokens looked up / found cached
    vllm:time_to_first_token_seconds          arrival -> first token (the HTTP frontend's)
    vllm:e2e_request_latency_seconds          arrival -> the request's end
    vllm:request_time_per_output_token_seconds   per request, its mean gap after the first
    vllm:request_success_total{finished_reason}  ended requests: stop, length or abort
    vllm:request_prompt_tokens / _generation_tokens   per ended request that started
                                                generating: its prompt's and its output's tokens
    vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                                              with LoRA on: the adapters running and waiting
                                                requests name (comma-separated) and the slots;
                                                its value the time it was read, as vLLM's;
                                                left out where --api-key guards the engine
                                                (/metrics is open, the names are tenants')

The engine core's part comes from its stats (`core_lines`, on an engine's /metrics); the
request histograms from the OpenAI frontend (`RequestMetrics`, on an engine's and a router's).
"""

from __future__ import annotations

import time

from microserve.messages.status import EngineInfo, EngineStats
from microserve.metrics import Registry, _escape, _format_value

# vLLM's own bucket bounds for the end-to-end latency (seconds)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's bounds for token counts)."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return bounds
            bounds.append(step * scale)
        scale *= 10


class RequestMetrics:
    """The frontend's per-request histograms and counters under vLLM's names."""

    def __init__(self, registry: Registry, model_name: str, ttft_buckets, tpot_buckets,
                 max_model_len: int):
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        self.prompt_tokens = registry.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request that generated (vLLM's "
            "name).", token_buckets(max_model_len), names)
        self.generation_tokens = registry.histogram(
            "vllm:request_generation_tokens", "Tokens a request generated (vLLM's name).",
            token_buckets(max_model_len), names)
        self.ttft = registry.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, seconds (vLLM's name).",
            ttft_buckets, names)
        self.e2e = registry.histogram(
            "vllm:e2e_request_latency_seconds", "From arrival to the request's end, seconds "
            "(vLLM's name).", E2E_BUCKETS, names)
        self.tpot = registry.histogram(
            "vllm:request_time_per_output_token_seconds", "Per request: mean time per output "
            "token after the first, seconds (vLLM's name).", tpot_buckets, names)
        self.success = registry.counter(
            "vllm:request_success_total", "Requests ended, by finish reason (vLLM's name).",
            [*names, "finished_reason"])
        for reason in FINISHED_REASONS:  # every series present from the start, at 0
            self.success.inc(0, finished_reason=reason, **self.labels)

    def finished(self, arrival: float, now: float, finish_reason: str | None,
                 prompt_tokens: int = 0, generated: int | None = None) -> None:
        """A request ended: `finish_reason` None (it was cut short) counts as abort; tool
        calls as stop. `generated`: its tokens, None if it never started generating."""
        self.e2e.observe(now - arrival, **self.labels)
        if generated is not None:
            self.prompt_tokens.observe(prompt_tokens, **self.labels)
            self.generation_tokens.observe(generated, **self.labels)
        reason = {None: "abort", "tool_calls": "stop"}.get(finish_reason, finish_reason)
        if reason not in FINISHED_REASONS:
            reason = "abort"
        self.success.inc(finished_reason=reason, **self.labels)


def core_lines(stats: EngineStats, info: EngineInfo, model_name: str,
               lora_names: bool = True) -> list[str]:
    """The engine core's load and token counts under vLLM's names (Prometheus text lines);
    `lora_names`: with the adapters' gauge (LoRA on)."""
    label = f'{{model_name="{_escape(model_name)}"}}'
    total = stats.kv_pages_total
    usage = (total - stats.kv_pages_free - stats.kv_pages_cached) / total if total else 0.0
    figures = [
        ("vllm:num_requests_running", "gauge", "Requests running (vLLM's name).",
         stats.running),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for admission (vLLM's name).",
         stats.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 1 means 100 percent: pages "
         "held by requests (vLLM's name).", usage),
        ("vllm:gpu_cache_usage_perc", "gauge", "The same, by vLLM's older name.", usage),
        ("vllm:num_preemptions_total", "counter", "Requests preempted (vLLM's name).",
         stats.preemptions),
        ("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests (vLLM's "
         "name).", stats.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Tokens generated by finished requests "
         "(vLLM's name).", stats.generation_tokens),
        ("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix "
         "cache (vLLM's name).", stats.prompt_tokens),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache "
         "(vLLM's name).", stats.cached_prompt_tokens),
    ]
    lines = []
    for name, kind, help_text, value in figures:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name}{label} {_format_value(value)}"]
    if info.max_loras and lora_names:
        name = "vllm:lora_requests_info"
        pairs = (("running_lora_adapters", ",".join(stats.lora_running)),
                 ("waiting_lora_adapters", ",".join(stats.lora_waiting)),
                 ("max_lora", str(info.max_loras)))
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
        lines += [f"# HELP {name} LoRA adapters of the running and the waiting requests, and "
                  f"the slots; the value is when this was read, seconds since the epoch "
                  f"(vLLM's name).", f"# TYPE {name} gauge",
                  f"{name}{{{labels}}} {_format_value(time.time())}"]
    return lines
