"""Plain data that crosses the engine-core / frontend boundary (and, later, router / engine).

Everything here is ints, floats, strings and lists, so it can be sent as msgpack between
processes. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Token-level sampling parameters the engine core understands.

    Text-level options (stop strings, echo, chat formatting) are handled by the frontend that
    owns the tokenizer; the core only sees token ids. The frontend validates user input and
    resolves defaults before building this, so the core treats bad values as invariants.
    """

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 disables
    seed: int | None = None  # per-request generator when set
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus top n
    # An llguidance grammar (JSON) the output must follow: structured outputs and forced tool
    # calls, built and validated by the frontend (microserve/guided.py); None: unconstrained.
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            "grammar": self.grammar,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        d = dict(d)
        d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ())
        return cls(**d)


@dataclass
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


@dataclass
class TokenOutput:
    """What one engine step produced for one request.

    `token_ids` are the tokens new since the previous TokenOutput of this request (usually one).
    The last TokenOutput of a request has `finish_reason` set. `num_prompt_tokens` and
    `num_cached_tokens` (prompt tokens served from the prefix cache) are set on every output.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def to_wire(self) -> list:
        lp = None
        if self.logprobs is not None:
            lp = [[x.token_id, x.logprob, [list(t) for t in x.top]] for x in self.logprobs]
        return [
            self.request_id,
            self.token_ids,
            self.finish_reason,
            lp,
            self.num_prompt_tokens,
            self.num_cached_tokens,
        ]

    @classmethod
    def from_wire(cls, w: list) -> "TokenOutput":
        rid, toks, fin, lp, n_prompt, n_cached = w
        logprobs = None
        if lp is not None:
            logprobs = [TokenLogprob(t, p, [(a, b) for a, b in top]) for t, p, top in lp]
        return cls(rid, list(toks), fin, logprobs, n_prompt, n_cached)
