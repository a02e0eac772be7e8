"""The checks of a request's sampling parameters against the model, one function each, asked
by the OpenAI frontend (router and engine: microserve/openai/app.py) and by the engine core
(engine/validation.py) alike: the same rule, the same numbers, the same message. A refusal is a
RequestRejected (a 400) naming the field. No torch.
"""

from __future__ import annotations

from microserve.backend import RequestRejected
from microserve.messages import SamplingParams


def out_of_vocab(ids, vocab_size: int) -> int | None:
    """The position of the first id in `ids` outside [0, vocab_size), or None."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return None
    return next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """What `params` must meet besides their own bounds: the fields bounded by the vocabulary
    (top_k, stop_token_ids, logit_bias, allowed_token_ids) and min_tokens within max_tokens."""
    if params.top_k > vocab_size:
        raise RequestRejected(f"top_k {params.top_k} exceeds the vocabulary of {vocab_size} "
                              "tokens (-1 or 0 disables top-k)", "top_k")
    bad = out_of_vocab(params.stop_token_ids, vocab_size)
    if bad is not None:
        raise RequestRejected(f"stop token id {params.stop_token_ids[bad]} is out of range for "
                              f"a vocabulary of {vocab_size} tokens", "stop_token_ids")
    bad = out_of_vocab([t for t, _ in params.logit_bias], vocab_size)
    if bad is not None:
        raise RequestRejected(f"logit_bias token id {params.logit_bias[bad][0]} is out of range "
                              f"for a vocabulary of {vocab_size} tokens", "logit_bias")
    bad = out_of_vocab(params.allowed_token_ids, vocab_size)
    if bad is not None:
        raise RequestRejected(f"allowed_token_ids token id {params.allowed_token_ids[bad]} is out "
                              f"of range for a vocabulary of {vocab_size} tokens",
                              "allowed_token_ids")
    if params.min_tokens > params.max_tokens:
        raise RequestRejected(f"min_tokens ({params.min_tokens}) exceeds the completion's "
                              f"max_tokens ({params.max_tokens})", "min_tokens")
