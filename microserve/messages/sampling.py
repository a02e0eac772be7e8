"""Sampling parameters, and what a generation answers: chunks to the router, token outputs
from the core."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Struct
from pydantic import Field

from microserve.bounds import (INT32_MAX, MAX_ALLOWED_TOKENS, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS,
                               MAX_LOGPROBS, Count, LogitBias, MinTokens, Penalty,
                               RepetitionPenalty, Seed, TokenId)
from microserve.messages.fields import CHECKED


@CHECKED
@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Token-level sampling, from the OpenAI frontend (which resolved OpenAI's defaults) to the
    engine core's sampler, through the router and start_generate unchanged.

    Text-level options (stop strings, echo, chat formatting) are the frontend's, which owns the
    tokenizer; the core sees token ids only. Bounds that need the model (top_k and token ids
    within the vocabulary, max_tokens within the context) are the engine's to check.

    The logit adjustments (vLLM's semantics, applied in this order after a grammar's mask):
    `logit_bias` adds to its tokens' logits; while fewer than `min_tokens` tokens are out,
    the stop token ids (and the eos ids unless ignore_eos) are impossible;
    `repetition_penalty` divides a positive logit (multiplies a negative one) of every token
    seen in the prompt or the output; `frequency_penalty` x its count in the output plus
    `presence_penalty` if it occurs there at all is subtracted.
    """

    max_tokens: Count = 16
    temperature: Annotated[float, Field(ge=0)] = 1.0  # 0 means greedy
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # 0 disables
    # vLLM's and SGLang's min_p: after temperature, tokens less likely than min_p times the most
    # likely one are dropped (before top_k and top_p, as vLLM orders them); 0 disables
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    seed: Seed | None = None  # per-request generator when set
    stop_token_ids: tuple[TokenId, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # 0: the sampled
    # token's; n: plus the top n
    # The prompt's tokens' logprobs as well (completions' echo with logprobs, what
    # lm-evaluation-harness scores with): 0: each prompt token's; n: plus the top n. The engine
    # computes the whole prompt for them (no prefix cache, no KV from a peer).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # An llguidance grammar (JSON) the output must follow: structured outputs and forced tool
    # calls, built and validated by the frontend (microserve/openai/guided.py); None: unconstrained.
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # 1 disables it
    # (token id, bias) pairs, ids below the vocabulary (the engine checks)
    logit_bias: Annotated[tuple[tuple[TokenId, LogitBias], ...],
                          Field(max_length=MAX_LOGIT_BIAS)] = ()
    min_tokens: MinTokens = 0  # at most max_tokens
    # vLLM's allowed_token_ids: every other token is impossible (empty: no restriction)
    allowed_token_ids: Annotated[tuple[TokenId, ...], Field(max_length=MAX_ALLOWED_TOKENS)] = ()
    # The LoRA adapter to generate with (a name the engine registered: the request's `model`
    # when it names an adapter); None: the base model.
    lora_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def stops_on(self, token: int, eos_token_ids: Collection[int]) -> bool:
        """Whether sampling `token` stops the request: one of its stop_token_ids, or one of the
        model's `eos_token_ids` unless ignore_eos. The one rule the engine core, the router and
        min_tokens' mask (engine/penalties.py) ask."""
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    @property
    def needs_token_counts(self) -> bool:
        """Whether the penalties need the tokens seen so far (engine/penalties.py)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment is set (penalties, logit_bias, min_tokens,
        allowed_token_ids)."""
        return (self.needs_token_counts or bool(self.logit_bias) or self.min_tokens > 0
                or bool(self.allowed_token_ids))


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives if asked for.

    Logprobs are of the model's raw distribution (log-softmax of the logits, before
    temperature / top-p / top-k), as vLLM reports them by default.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


class FinishReason:
    STOP = "stop"  # eos or a stop token id (or, at the frontend, a stop string)
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # aborted by the client or an operator


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV was already on this engine (received or cached)


@dataclass(slots=True)
class GenerateChunk:
    """One piece of a generation's output, as every consumer above the engine core sees it: the
    engine's OpenAI frontend and start_generate's stream, a strategy, the router's frontend.

    `token_ids` are new since the previous chunk (usually one). The last chunk has
    finish_reason and usage.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    # The first chunk's: what usage.cached_tokens will say, for a caller that stops reading
    # early (a stop string matched).
    cached_tokens: int | None = None
    # The first chunk's, when SamplingParams.prompt_logprobs asked: one per prompt token, None
    # for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TokenOutput(Struct, array_like=True):
    """What one engine step produced for one request: the core's record, sent to its frontend
    positionally (one frame per step holds every request's), where the core client makes it the
    request's next GenerateChunk. `num_prompt_tokens` and `num_cached_tokens` (prompt tokens
    served from the prefix cache) are set on every output; the last has `finish_reason`."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs, on the request's first output: one per prompt token,
    # None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
