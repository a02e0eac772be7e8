"""Bounds on every number a request can carry, where it enters (OpenAI, microserving and admin
bodies, JSON and msgpack alike). No torch.

A number past these bounds gets a 400 naming the field and the bound, from pydantic, before it
reaches code that could not hold it: msgpack packs integers of at most 64 bits, torch's
generators take 64-bit seeds, `select` takes timeouts that fit a C time_t. Bounds that need the
model (a token id below the vocabulary, `top_k` at most the vocabulary, begin/end within the
prompt) are checked by the frontend and the engine against the real numbers.

Floats are finite everywhere (`FINITE`: JSON's `Infinity` and `NaN` are refused).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1

FINITE = ConfigDict(allow_inf_nan=False)

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the engine checks it is < its vocabulary
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # what torch.Generator.manual_seed takes
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]  # max_tokens and other counts of tokens
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]  # vLLM's min_tokens; at most max_tokens
Index = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]  # begin/end; the engine checks the prompt
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1 and 0 disable it; at most the vocabulary
# A request's scheduling priority (vLLM's `priority`: lower runs first), for engines run with
# --scheduling-policy priority; other policies ignore it
Priority = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
# A priority at or past this marks a request as background work (a batch job's lines are sent
# at it): engines give it what live requests leave of each step (--background-max-seqs/-tokens)
BACKGROUND_PRIORITY = 1_000_000
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
# Sampling penalties: OpenAI's range for presence/frequency, and SGLang's upper bound for the
# repetition penalty (vLLM's and Hugging Face's take any positive value; past 2 the penalty
# only pushes every seen token out).
Penalty = Annotated[float, Field(ge=-2, le=2)]
MAX_REPETITION_PENALTY = 2.0
RepetitionPenalty = Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]  # OpenAI's range
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_ALLOWED_TOKENS = 1 << 16  # allowed_token_ids entries per request
# An llguidance grammar's JSON (structured outputs, forced tool calls); the OpenAI frontend caps
# the schemas it is built from at MAX_SCHEMA_CHARS.
MAX_GRAMMAR_CHARS = 1 << 20
MAX_SCHEMA_CHARS = 1 << 18
