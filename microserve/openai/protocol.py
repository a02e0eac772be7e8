"""OpenAI request bodies we accept (the JSON we answer with is microserve/openai/responses.py).

Field validation lives here, so a bad field becomes a 400 that names the field and the value
(errors.py formats pydantic's errors). Defaults that need the model, such as max_tokens (what
is left of the context), are resolved by the frontend. Unknown fields are ignored, as OpenAI does.

Ranges are OpenAI's documented ones: `temperature` in [0, 2], `top_p` in (0, 1],
`presence_penalty` and `frequency_penalty` in [-2, 2], `logit_bias` values in [-100, 100]
(keys are token ids, at most MAX_LOGIT_BIAS of them), at most 4 `stop` strings, message roles
system, developer, user, assistant and tool, and `content` required except on an assistant
turn. vLLM's extensions `repetition_penalty` (in (0, 2], SGLang's bound), `min_p` (in [0, 1])
and `min_tokens` (at most the completion budget, checked by the frontend once that is
resolved) are accepted.
`model` may be absent or empty, meaning the served model (as in vLLM).
vLLM's output and prompt options are honoured: `include_stop_str_in_output`,
`skip_special_tokens`, `truncate_prompt_tokens` (keep the prompt's last N tokens; -1: the
context), and for chat `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs` (extra variables for the template).
Options we do not implement are refused rather than ignored when ignoring them would silently
change the output: best_of > 1, suffix, and vLLM's use_beam_search, bad_words and (chat)
echo. vLLM's `return_tokens_as_token_ids` names logprobs' tokens by id, and its
`allowed_token_ids` restricts sampling to those tokens. `echo` (completions) puts the prompt in
front of the completion, and with `logprobs` the prompt tokens' logprobs in front of the
completion's (the first token's null), as vLLM does. `n` choices per prompt and a batch of
completion prompts are served as that many generations (at most MAX_CHOICES in one request).

Structured outputs (`response_format`, vLLM's `guided_*` and `structured_outputs`, SGLang's
`regex` and `json_schema`) are shape-checked here and turned into a grammar by guided.py; tools
and tool_choice are modelled in tools.py.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from microserve.bounds import (FINITE, INT32_MAX, INT64_MAX, MAX_ALLOWED_TOKENS, MAX_LOGIT_BIAS,
                               MAX_LOGPROBS, Count, MinTokens, Penalty, Priority,
                               RepetitionPenalty, Seed, TokenId, TopK)
from microserve.openai.tools import AssistantToolCall, NamedToolChoice, Tool, ToolChoice
from microserve.messages import SamplingParams


MAX_STOP = 4  # stop strings per request, as OpenAI allows
# What a request that leaves these out gets, unless the model's generation config says otherwise
# (microserve.model_config.sampling_defaults): OpenAI's defaults, and no top_k, min_p or
# repetition penalty.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                     "repetition_penalty": 1.0}
# Generations one request may start: n choices for each prompt of a batch. Each is a request to
# the engines (sharing the prompt's KV through the prefix cache).
MAX_CHOICES = 128
ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(BaseModel):
    model_config = FINITE
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage in every chunk


class JsonSchemaFormat(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_for_its_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo):
        if value is None and info.data.get("type") == "json_schema":
            raise ValueError("response_format type 'json_schema' needs json_schema")
        return value

    def as_dict(self) -> dict:
        return self.model_dump(by_alias=True)


class StructuredOutputs(BaseModel):
    """vLLM's (>= 0.12) structured_outputs: one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share."""

    model_config = FINITE  # no Infinity or NaN in any float field
    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1.0; 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = None  # vLLM extension; -1 and 0 disable it; <= the vocabulary
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM / SGLang extension; None and 0: off
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = []  # a single string is accepted too
    stop_token_ids: list[TokenId] | None = None  # vLLM extension; < the vocabulary
    seed: Seed | None = None
    ignore_eos: bool = False  # vLLM / SGLang extension
    user: str | None = None
    presence_penalty: Penalty | None = None  # None: 0
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM extension; None: 1
    # OpenAI's {"token id": bias}, parsed into int ids by _logit_bias; ids < the vocabulary
    logit_bias: dict[int, float] | None = None
    min_tokens: MinTokens = 0  # vLLM extension; at most max_tokens
    # vLLM extension: the request's scheduling priority, lower first, on engines run with
    # --scheduling-policy priority (others ignore it); a 32-bit integer
    priority: Priority = 0
    # Structured outputs (guided.py): OpenAI's, vLLM's and SGLang's fields, one per request.
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    regex: str | None = None
    json_schema: str | None = None
    # vLLM extensions on the text and the prompt
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) kept
    skip_special_tokens: bool = True  # False: special tokens' text in the output
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)  # -1: the context
    # vLLM extensions we refuse when set (ignoring them would change the output unseen)
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    # vLLM extension: logprobs name each token "token_id:ID" instead of its text
    return_tokens_as_token_ids: bool = False
    # vLLM extension: only these tokens may be sampled (ids below the vocabulary)
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=MAX_ALLOWED_TOKENS)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context) or >= 1, got 0")
        return value

    @field_validator("use_beam_search", "bad_words")
    @classmethod
    def _not_supported(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: the context's worth), or the
        prompt as it is."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        keep = max_model_len if keep == -1 else keep
        return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(value)}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        """{"token id": bias} with ids as decimal strings (JSON keys) or ints."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        parsed = {}
        for key, bias in value.items():
            token = _token_id_key(key)
            if token is None:
                raise ValueError(f"key {key!r} is not a token id (an integer in [0, "
                                 f"{INT32_MAX}])")
            if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                    or not -100 <= bias <= 100):  # NaN fails the comparison too
                raise ValueError(f"bias {bias!r} for token {key} is not a number in "
                                 "[-100, 100]")
            parsed[token] = float(bias)
        return parsed

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
        carries the usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def guided_fields(self) -> dict[str, Any]:
        """The structured-output fields, as guided.request_grammar takes them."""
        return {
            "response_format": self.response_format.as_dict() if self.response_format else None,
            "guided_json": self.guided_json, "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
            "regex": self.regex, "json_schema": self.json_schema,
            "structured_outputs": (self.structured_outputs.model_dump(by_alias=True)
                                   if self.structured_outputs else None),
        }

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        grammar: str | None = None, choice: int = 0,
                        prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """The engine's parameters for choice `choice` of a prompt: a seeded request's choices
        are seeded seed, seed + 1, ... (wrapping within 64 bits), so each is reproducible and
        they differ. `defaults`: what temperature, top_p, top_k, min_p and repetition_penalty
        are when the request leaves them out (the model's generation_config.json, as vLLM and
        SGLang take it; OpenAI's defaults for what it does not set)."""
        given = {name: getattr(self, name) for name in SAMPLING_DEFAULTS
                 if getattr(self, name) is not None}
        chosen = {**SAMPLING_DEFAULTS, **(defaults or {}), **given}
        seed = self.seed
        if seed is not None and choice:
            seed = (seed + choice + 2**63) % 2**64 - 2**63
            assert seed <= INT64_MAX
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=chosen["temperature"],
            top_p=chosen["top_p"],
            top_k=max(chosen["top_k"], 0),
            min_p=chosen["min_p"],
            seed=seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=chosen["repetition_penalty"],
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            min_tokens=self.min_tokens,
            allowed_token_ids=tuple(dict.fromkeys(self.allowed_token_ids or ())),
        )


DEFAULT_COMPLETION_TOKENS = 16


class CompletionRequest(GenerationRequest):
    # One prompt (a string or token ids) or a batch of them ([str] or [[int]]); `prompts`.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        # Checked here rather than by the union type, whose errors would name its members.
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            if len(value) > MAX_CHOICES:
                raise ValueError(f"a batch of at most {MAX_CHOICES} prompts, got {len(value)}")
            for i, prompt in enumerate(value):
                if isinstance(prompt, list) and not _token_ids(prompt):
                    raise ValueError(f"prompt {i} of the batch must be a string or a non-empty "
                                     "list of token ids")
            if not all(isinstance(p, type(value[0])) for p in value):
                raise ValueError("a batch is all strings or all lists of token ids")
            return value
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if not (isinstance(value, str) or isinstance(value, list) and _token_ids(value)):
            raise ValueError("must be a string, a list of token ids, or a list of either")
        return value

    @property
    def default_max_tokens(self) -> int | None:
        """The budget of a request that leaves max_tokens out: 16, OpenAI's default for the
        legacy completions API and vLLM's (fit to the context left). An explicit null means
        what is left of the context, the default of a chat request."""
        return None if "max_tokens" in self.model_fields_set else DEFAULT_COMPLETION_TOKENS

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts (one for a single prompt)."""
        p = self.prompt
        return p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value


class ChatMessage(BaseModel):
    role: Literal[ROLES]
    # Text parts of a list content are joined with newlines (as vLLM does). Required, except
    # on an assistant turn (one that only called tools has none).
    content: str = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # a tool turn: the call it answers
    tool_calls: list[AssistantToolCall] | None = None  # an assistant turn that called tools

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if info.data.get("role") not in ("assistant", None):
                raise ValueError(f"content is required in a {info.data['role']!r} message")
            return ""
        if not isinstance(value, list):
            return value
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content parts of type {kind!r} are not supported, only 'text'")
        return "\n".join(str(part.get("text", "")) for part in value)

    def template_dict(self) -> dict:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    # vLLM extensions on the chat template: the assistant's turn opened after the messages
    # (default) or the last message left open for the model to continue; extra template
    # variables (e.g. {"enable_thinking": false})
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM's chat echo: refused

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true (set add_generation_prompt to false)")
        return value

    @field_validator("echo")
    @classmethod
    def _no_chat_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported for chat completions")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: ToolChoice | None, info: ValidationInfo):
        if value is not None and value != "none" and not info.data.get("tools"):
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(value, NamedToolChoice):
            names = [tool.function.name for tool in info.data.get("tools") or ()]
            if value.function.name not in names:
                raise ValueError(f"tool_choice names function {value.function.name!r}, which "
                                 f"is not among the tools ({', '.join(names)})")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The field the client set the completion budget with (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_TOKENIZE = 1 << 17  # token ids /tokenize answers with and /detokenize takes (~20 ms of work)


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a `prompt`, or chat `messages` rendered as
    /v1/chat/completions renders them (the same template options), into token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, validate_default=True)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_open(cls, value: bool, info: ValidationInfo) -> bool:
        return ChatCompletionRequest._continue_or_open(value, info)

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, value: list | None, info: ValidationInfo) -> list | None:
        if (info.data.get("prompt") is None) == (value is None):
            raise ValueError("give exactly one of prompt and messages")
        return value


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids (below the vocabulary) into text."""

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_TOKENIZE)


def _token_id_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string of decimal digits; None if not."""
    if isinstance(key, str) and re.fullmatch(r"[0-9]+", key):
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key <= INT32_MAX:
        return key
    return None


def _token_ids(value: list) -> bool:
    """A non-empty list of ints (not bools)."""
    return bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
