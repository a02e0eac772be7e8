"""What the core refuses before a request or a microserving call touches any state.

Plain functions of the input and the engine's fixed limits (`EngineInfo`), shared by the core
(generate, start_generate) and the KV exchange (prep_recv, remote_send); the sampling checks
are the OpenAI frontend's own (microserve/request_checks.py). A refusal names the field and
the numbers: RequestRejected (400) for a request, MicroservingError for an index.
"""

from __future__ import annotations

from microserve.backend import MicroservingError, RequestRejected
from microserve.bounds import INT64_MAX, INT64_MIN
from microserve.messages import EngineInfo, SamplingParams
from microserve.request_checks import check_sampling, out_of_vocab


def resolve_index(value: int, n: int, name: str) -> int:
    """A Python-style index into an n-token prompt (negative counts from the end)."""
    if not -n <= value <= n:
        raise MicroservingError(400, f"{name} {value} out of range for a {n}-token prompt", name)
    return value + n if value < 0 else value


def check_prompt(prompt: list[int], vocab_size: int) -> None:
    if not prompt:
        raise RequestRejected("prompt is empty: at least one token is needed", "prompt")
    bad = out_of_vocab(prompt, vocab_size)
    if bad is not None:
        raise RequestRejected(f"prompt token id {prompt[bad]} out of range [0, {vocab_size})",
                              "prompt")


def check_request(prompt: list[int], params: SamplingParams, info: EngineInfo) -> None:
    check_prompt(prompt, info.vocab_size)
    if params.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
    total = len(prompt) + params.max_tokens
    if total > info.max_model_len:
        raise RequestRejected(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the maximum context length of {info.max_model_len} tokens",
            "max_tokens",
        )
    check_sampling(params, info.vocab_size)  # the frontend's own check, again here
    if params.seed is not None and not INT64_MIN <= params.seed <= INT64_MAX:
        raise RequestRejected(f"seed {params.seed} does not fit in 64 bits", "seed")
    if total > info.kv_capacity_tokens:
        raise RequestRejected(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the KV cache capacity of {info.kv_capacity_tokens} tokens",
            "max_tokens",
        )
