"""Balanced P/D (paper §3.3): P prefills prompt[:s], D prefills prompt[s:] inside its decode steps.

    D.prep_recv(end=s)                     reserve D's slots for prompt[matched:s]
    P.remote_send(matched, s, kv_addr)     P computes and writes them
    D.start_generate(begin=s)              D computes the tail, samples, decodes

`ratio` is the share of the prompt left to D (the paper uses 0.2: the last 20%). Adaptive mode
picks s per request so that both engines end their queued prefill work together, counting the
prompt tokens each already has open from this router and `decode_cost` tokens for each
sequence D is decoding (prefill D takes on slows those down):

    P's work: p_queued + s      D's work: d_queued + decode_cost * d_decoding + (n - s)
    equal when s = (n + d_queued + decode_cost * d_decoding - p_queued) / 2

and the ratio (n - s) / n is kept within [min_ratio, max_ratio]. With no prefill engine up, D
computes the whole prompt; with no decode engine up, any engine serves the request.
"""

import math

from router.strategy import Strategy


class BalancedPD(Strategy):
    def __init__(self, ratio: float = 0.2, adaptive: bool = False, min_ratio: float = 0.0,
                 max_ratio: float = 0.5, decode_cost: float = 32.0):
        """
        Args:
            ratio: share of the prompt prefilled on D (fixed mode, and the start value).
            adaptive: choose the share per request from the monitored load (see above).
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
        self.ratio, self.adaptive = ratio, adaptive
        self.min_ratio, self.max_ratio, self.decode_cost = min_ratio, max_ratio, decode_cost
        self.last_ratio = ratio  # the share the last request got (GET /admin/strategy shows it)

    def split(self, n: int, prefill, decode) -> int:
        """Where the prompt is cut: P computes [0, s), D computes [s, n). 0 <= s <= n - 1."""
        ratio = self.ratio
        if self.adaptive:
            d_work = decode.pending_prefill_tokens + self.decode_cost * decode.open_generations
            s = (n + d_work - prefill.pending_prefill_tokens) / 2
            ratio = min(max((n - s) / n, self.min_ratio), self.max_ratio)
        self.last_ratio = ratio
        return n - max(1, math.ceil(ratio * n))  # D computes at least the last token

    async def generate(self, request, engines):
        prefill, decode = engines.prefill_decode()  # prefill None: no engine for it is up
        s = 0 if prefill is None else self.split(len(request.prompt), prefill, decode)
        if s > 0:
            recv = await decode.prep_recv(request, end=s)
            if recv.matched < s:
                await prefill.remote_send(request, recv.matched, s, recv.kv_addr)
        async for chunk in decode.start_generate(request, begin=s):
            yield chunk

    def describe(self) -> dict:
        return {"ratio": self.ratio, "adaptive": self.adaptive, "min_ratio": self.min_ratio,
                "max_ratio": self.max_ratio, "decode_cost": self.decode_cost,
                "last_ratio": self.last_ratio}
