"""A request's state inside the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from microserve.messages import SamplingParams


PENDING = -1  # an output token sampled on the device whose value the host has not read yet


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # no KV pages held (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; FCFS sorts on it
    # appended by EngineCore; the newest may be PENDING while its step is in flight
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING  # set by the Scheduler
    num_computed_tokens: int = 0  # KV positions written; set by the Scheduler and EngineCore
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission; Scheduler
    # set by EngineCore; a sequence with a finish reason still in `running` is waiting for its
    # last step to be resolved, and the scheduler gives it no more work
    finish_reason: str | None = None
    # a remote_send job: computes KV for its tokens and sends it; never samples
    send_only: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
