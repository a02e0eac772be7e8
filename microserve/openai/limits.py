"""What one request may ask for: how many generations, and how many tokens in the context."""

from __future__ import annotations

from microserve.errors import invalid_request
from microserve.openai.protocol import MAX_CHOICES


def check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise invalid_request(f"{prompts} prompt{'s' if prompts > 1 else ''} x n {n} = "
                              f"{prompts * n} generations; at most {MAX_CHOICES} in one "
                              "request", "n")


def fit_context(limit: int, prompt_len: int, max_tokens: int | None, max_tokens_field: str,
                prompt_field: str, default: int | None = None) -> int:
    """The completion budget in a context of `limit` tokens: `max_tokens` if prompt +
    completion fit, else a 400. Without max_tokens the budget is `default` or what is left of
    the context, whichever is smaller (no default: what is left).
    """
    if prompt_len == 0:
        raise invalid_request(f"The {prompt_field} is empty after tokenization", prompt_field)
    where = "in the messages" if prompt_field == "messages" else "in the prompt"
    if max_tokens is None:
        if prompt_len < limit:
            return min(limit - prompt_len, default or limit)
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_len} tokens {where}, which leaves no room for the completion. "
            f"Please reduce the length of the {prompt_field}.", prompt_field)
    if prompt_len + max_tokens > limit:
        raise invalid_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {prompt_field} or completion.",
            max_tokens_field if prompt_len < limit else prompt_field)
    return max_tokens
