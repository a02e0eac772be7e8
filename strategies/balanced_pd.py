"""Balanced P/D (paper §3.3): P prefills prompt[:s], D prefills prompt[s:] inside its decode steps.

    D.prep_recv(end=s)                     reserve D's slots for prompt[matched:s]
    P.remote_send(matched, s, kv_addr)     P computes and writes them
    D.start_generate(begin=s)              D computes the tail, samples, decodes

`ratio` is the share of the prompt left to D (the paper uses 0.2: the last 20%). Adaptive mode
(`adaptive: true`) picks the share from a model of both engines fitted to their measured
rates as the service runs (router/balance_model.py): P's prefill cost per token, D's decode
step against its batch and the prefill it takes on, the request rate and lengths; the share
with the least predicted job completion time within [min_ratio, max_ratio] is used until the
next poll of the engines' stats (twice a second). Until the model has data, `ratio`.

`adaptive: "queues"` is the older rule, kept for comparison: cut each prompt so that both
engines end their queued prefill work together, a sequence D decodes counted as
`decode_cost` prompt tokens:

    P's work: p_queued + s      D's work: d_queued + decode_cost * d_decoding + (n - s)
    equal when s = (n + d_queued + decode_cost * d_decoding - p_queued) / 2

With no prefill engine up, D computes the whole prompt; with no decode engine up, any engine
serves the request.
"""

import math

from router.balance_model import BalanceModel
from router.strategy import Strategy


class BalancedPD(Strategy):
    def __init__(self, ratio: float = 0.2, adaptive: bool | str = False, min_ratio: float = 0.0,
                 max_ratio: float = 0.5, decode_cost: float = 32.0):
        """
        Args:
            ratio: share of the prompt prefilled on D (fixed mode, and the start value).
            adaptive: False (a fixed share), True (the model's share) or "queues".
            min_ratio, max_ratio: bounds of the adaptive share.
            decode_cost: prefill tokens one decoding sequence on D counts as.
        """
        if not 0.0 <= min_ratio <= max_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio <= max_ratio <= 1, got min_ratio {min_ratio}, "
                             f"max_ratio {max_ratio}")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio {ratio} must be within [0, 1]")
        if decode_cost < 0:
            raise ValueError(f"decode_cost {decode_cost} must be >= 0")
        if adaptive not in (False, True, "queues"):
            raise ValueError(f"adaptive must be false, true or \"queues\", got {adaptive!r}")
        self.ratio, self.adaptive = ratio, adaptive
        self.model = BalanceModel()
        self._loads: tuple = ()  # the engine stats the model's pick was made from
        self._pick: float | None = None
        self.min_ratio, self.max_ratio, self.decode_cost = min_ratio, max_ratio, decode_cost
        self.last_ratio = ratio  # the share the last request got (GET /admin/strategy shows it)

    def split(self, n: int, prefill, decode, engines=None) -> int:
        """Where the prompt is cut: P computes [0, s), D computes [s, n). 0 <= s <= n - 1.
        `engines` (the pool) tells the adaptive model how many engines share the traffic."""
        ratio = self.ratio
        if self.adaptive == "queues":
            d_work = decode.pending_prefill_tokens + self.decode_cost * decode.open_generations
            s = (n + d_work - prefill.pending_prefill_tokens) / 2
            ratio = min(max((n - s) / n, self.min_ratio), self.max_ratio)
        elif self.adaptive:
            ratio = self._modelled(prefill, decode, ratio, engines)
        self.last_ratio = ratio
        return n - max(1, math.ceil(ratio * n))  # D computes at least the last token

    def _modelled(self, prefill, decode, fallback: float, engines) -> float:
        """The model's share, re-picked when the engines' stats changed (a poll)."""
        if (prefill.load, decode.load) != self._loads:
            self._loads = (prefill.load, decode.load)
            self.model.observe("p", prefill.load, prefill.name)
            self.model.observe("d", decode.load, decode.name)
            counts = (1, 1) if engines is None else (
                len(engines.routable("prefill")), len(engines.routable("decode")))
            best = self.model.best(self.min_ratio, self.max_ratio, *counts)
            self._pick = None if best is None else best.ratio
        return fallback if self._pick is None else self._pick

    async def generate(self, request, engines):
        prefill, decode = engines.prefill_decode()  # prefill None: no engine for it is up
        if self.adaptive is True:
            self.model.arrived(len(request.prompt), request.sampling.max_tokens or 1)
        s = 0 if prefill is None else self.split(len(request.prompt), prefill, decode, engines)
        if s > 0:
            recv = await decode.prep_recv(request, end=s)
            if recv.matched < s:
                await prefill.remote_send(request, recv.matched, s, recv.kv_addr)
        async for chunk in decode.start_generate(request, begin=s):
            yield chunk

    def describe(self) -> dict:
        return {"ratio": self.ratio, "adaptive": self.adaptive, "min_ratio": self.min_ratio,
                "max_ratio": self.max_ratio, "decode_cost": self.decode_cost,
                "last_ratio": self.last_ratio,
                **({"model": self.model.fitted()} if self.adaptive is True else {})}
