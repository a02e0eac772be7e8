"""What the scheduler runs for a request: its tokens and how far their KV is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from microserve.messages import SamplingParams


PENDING = -1  # an output token sampled on the device whose value the host has not read yet


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no KV pages held (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence the scheduler runs: a generation, or the computing part of a remote_send.

    Every mutable field has one writer, named beside it. The KV already held when a sequence
    is made (received from another engine, or cached) is its initial `num_computed_tokens`;
    from then on only the Scheduler moves it: admission (a cached prefix), each launched step
    (`Scheduler.advance`) and preemption (back to 0).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; FCFS sorts on it
    # the request's priority (lower runs first) under the `priority` scheduling policy
    priority: int = 0
    num_computed_tokens: int = 0  # KV positions written; the Scheduler's after construction
    # prompt tokens whose KV was reused rather than computed: given at construction when the
    # KV was held then, else set by the Scheduler at first admission
    num_cached_tokens: int | None = None
    # of those, the ones loaded from the host tier (the prefix cache's second level); set by
    # the Scheduler with num_cached_tokens
    num_host_cached_tokens: int = 0
    # a remote_send job: computes KV for its tokens and sends it; samples only if
    # `send_samples` (the first output token, handed to the receiver with the KV)
    send_only: bool = False
    send_samples: bool = False
    # a generation's queue time (start_generate's queue_s) and the time.monotonic() by which
    # a step must start on it, else it fails with a 503 (EngineCore.expire); None: no limit
    queue_s: float | None = None
    start_by: float | None = None
    # the LoRA adapter it runs with (its registry id, engine/lora/registry.py), 0: the base;
    # also its prefix-cache namespace
    lora_id: int = 0
    # appended by EngineCore; the newest may be PENDING while its step is in flight
    output_token_ids: list[int] = field(default_factory=list, init=False)
    status: SeqStatus = field(default=SeqStatus.WAITING, init=False)  # set by the Scheduler
    admitted: bool = field(default=False, init=False)  # set by the Scheduler, at admission
    # set by EngineCore; a sequence with a finish reason still in `running` is waiting for its
    # last step to be resolved, and the scheduler gives it no more work
    finish_reason: str | None = field(default=None, init=False)
    # params.prompt_logprobs: entry j scores prompt token j (entry 0 stays None), filled by
    # EngineCore as the steps computing the prompt resolve; `prompt_scored` counts the leading
    # tokens whose entries are in (1: none yet). Prefix reuse stops there (Scheduler).
    prompt_logprobs: list | None = field(default=None, init=False)
    prompt_scored: int = field(default=1, init=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @cached_property
    def prompt_key(self) -> int:
        """A hash of the prompt: sequences with equal prompts have equal keys (the Scheduler
        finds a prompt's twins by it, then compares the prompts)."""
        return hash(tuple(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
