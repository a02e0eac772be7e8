"""Balanced P/D (paper §3.3): P prefills prompt[:s], D prefills prompt[s:] inside its decode steps.

    D.prep_recv(end=s)                     reserve D's slots for prompt[matched:s]
    P.remote_send(matched, s, kv_addr)     P computes and writes them
    D.start_generate(begin=s)              D computes the tail, samples, decodes

(`prefill.send_prompt(request, decode, end=s)`: as in `pd`, P starts at once beside D's
prep_recv and is told where to write when it answers, so that round trip is off the path.)

`ratio` is the share of the prompt left to D (the paper uses 0.2: the last 20%). Adaptive mode
(`adaptive: true`) picks the share from a model of both engines fitted to their measured
rates as the service runs (router/balance_model.py): P's prefill cost per token, D's decode
step against its batch and the prefill it takes on, the request rate and lengths; the share
with the least predicted job completion time within [min_ratio, max_ratio] is used until the
next poll of the engines' stats (twice a second). Until the model has data, `ratio`.
`pick_step` < 1 moves the share only that far from the last one toward each new pick (an
exponential average over polls), so that a poll whose rate reads high or low sends fewer
requests at a share far from the steady one (on two H100s, 2026-11-27, 0.2 did not help: the
share followed a burst of the rate a few seconds later; counting the rate over a longer window,
`rate_window_s`, did). The last picks, with the rate and P's
utilisation they were made at, are in `describe()` (GET /admin/strategy) as `picks`.

`adaptive: "queues"` is the older rule, kept for comparison: cut each prompt so that both
engines end their queued prefill work together, a sequence D decodes counted as
`decode_cost` prompt tokens:

    P's work: p_queued + s      D's work: d_queued + decode_cost * d_decoding + (n - s)
    equal when s = (n + d_queued + decode_cost * d_decoding - p_queued) / 2

With no prefill engine up, D computes the whole prompt; with no decode engine up, any engine
serves the request.
"""

import math
import time
from collections import deque

from router.balance_model import RATE_WINDOW_S, BalanceModel
from router.strategy import Strategy


class BalancedPD(Strategy):
    def __init__(self, ratio: float = 0.2, adaptive: bool | str = False, min_ratio: float = 0.0,
                 max_ratio: float = 0.5, decode_cost: float = 32.0, pick_step: float = 1.0,
                 rate_window_s: float = RATE_WINDOW_S):
        """
        Args:
            ratio: share of the prompt prefilled on D (fixed mode, and the start value).
            adaptive: False (a fixed share), True (the model's share) or "queues".
            min_ratio, max_ratio: bounds of the adaptive share.
            decode_cost: prefill tokens one decoding sequence on D counts as.
            pick_step: how far each poll moves the adaptive share toward the model's pick.
            rate_window_s: the adaptive model's request rate counts the arrivals of this
                many last seconds.
        """
        if not 0.0 <= min_ratio <= max_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio <= max_ratio <= 1, got min_ratio {min_ratio}, "
                             f"max_ratio {max_ratio}")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio {ratio} must be within [0, 1]")
        if decode_cost < 0:
            raise ValueError(f"decode_cost {decode_cost} must be >= 0")
        if not 0.0 < rate_window_s <= 3600.0:
            raise ValueError(f"rate_window_s {rate_window_s} must be within (0, 3600]")
        if not 0.0 < pick_step <= 1.0:
            raise ValueError(f"pick_step {pick_step} must be within (0, 1]")
        if adaptive not in (False, True, "queues"):
            raise ValueError(f"adaptive must be false, true or \"queues\", got {adaptive!r}")
        self.ratio, self.adaptive = ratio, adaptive
        self.model = BalanceModel(rate_window_s=rate_window_s)
        self._loads: tuple = ()  # the engine stats the model's pick was made from
        self._pick: float | None = None
        self.min_ratio, self.max_ratio, self.decode_cost = min_ratio, max_ratio, decode_cost
        self.last_ratio = ratio  # the share the last request got (GET /admin/strategy shows it)
        self.pick_step = pick_step
        # (seconds since the first, share used, the model's pick, λ, P's utilisation) per poll
        self.picks: deque[tuple[float, ...]] = deque(maxlen=120)
        self._t0: float | None = None

    def split(self, n: int, prefill, decode, engines=None) -> int:
        """Where the prompt is cut: P computes [0, s), D computes [s, n). 0 <= s <= n - 1.
        `engines` (the pool) tells the adaptive model how many engines share the traffic."""
        ratio = self.ratio
        if self.adaptive == "queues":
            d_work = decode.pending_prefill_tokens + self.decode_cost * decode.decoding
            s = (n + d_work - prefill.pending_prefill_tokens) / 2
            ratio = min(max((n - s) / n, self.min_ratio), self.max_ratio)
        elif self.adaptive:
            ratio = self._modelled(prefill, decode, ratio, engines)
        self.last_ratio = ratio
        # D computes at least the last token; rounded first: 0.3 * 1000 is 300.00000000000006
        return n - max(1, math.ceil(round(ratio * n, 6)))

    def _modelled(self, prefill, decode, fallback: float, engines) -> float:
        """The model's share, re-picked when the engines' stats changed (a poll)."""
        if (prefill.load, decode.load) != self._loads:
            self._loads = (prefill.load, decode.load)
            self.model.observe("p", prefill.load, prefill.name)
            self.model.observe("d", decode.load, decode.name)
            counts = (1, 1) if engines is None else (
                len(engines.routable("prefill")), len(engines.routable("decode")))
            best = self.model.best(self.min_ratio, self.max_ratio, *counts)
            if best is not None:
                last = best.ratio if self._pick is None else self._pick
                self._pick = last + self.pick_step * (best.ratio - last)
                now = time.monotonic()
                self._t0 = now if self._t0 is None else self._t0
                self.picks.append((round(now - self._t0, 2), round(self._pick, 3), best.ratio,
                                   round(self.model.rate()[0], 2), round(best.p_utilisation, 3)))
        return fallback if self._pick is None else self._pick

    async def generate(self, request, engines):
        prefill, decode = engines.prefill_decode()  # prefill None: no engine for it is up
        if self.adaptive is True:
            self.model.arrived(len(request.prompt), request.sampling.max_tokens or 1)
        s = 0 if prefill is None else self.split(len(request.prompt), prefill, decode, engines)
        if s > 0:
            s, _ = await prefill.send_prompt(request, decode, end=s)
        async for chunk in decode.start_generate(request, begin=s):
            yield chunk

    def describe(self) -> dict:
        return {"ratio": self.ratio, "adaptive": self.adaptive, "min_ratio": self.min_ratio,
                "max_ratio": self.max_ratio, "decode_cost": self.decode_cost,
                "last_ratio": self.last_ratio, "pick_step": self.pick_step,
                "rate_window_s": self.model.rate_window_s,
                **({"model": self.model.fitted(), "picks": [list(p) for p in self.picks]}
                   if self.adaptive is True else {})}
