"""auto: each request served whole, by P/D or by balanced P/D, whichever the live
measurements predict costs least (router/choice_model.py has the model).

    choice = model.pick(len(prompt), loads, slo_ttft_s)
    whole:     E.start_generate(begin=0)
    pd:        P.send_prompt(D), then D.start_generate          (as strategies/pd.py)
    balanced:  P.send_prompt(D, end=s), D.start_generate(begin=s)   (as strategies/balanced_pd.py)

The model's fit and the count of each choice are in `GET /admin/strategy`. On a deployment of
"any" engines every engine may be P, D or whole; with roles, P/D pairs follow them.

With `flip_roles` (off by default) it also changes engines' roles as the traffic shifts: a
background task, begun by `start` and ended by `retire`/`stop`, shows the pool to a
RolePolicy each poll (router/role_policy.py has the rules and their hysteresis) and flips
what it decides through the same call as the ops API (router/role_steering.py).
"""

import math
import time
from collections import deque
from dataclasses import asdict

from router.choice_model import KINDS, ChoiceModel, EngineLoad
from router.role_policy import FlipSettings, RolePolicy
from router.role_steering import RoleSteering
from router.strategy import Strategy

RATE_WINDOW_S = 10.0  # the request rate is counted over this window


class Auto(Strategy):
    def __init__(self, slo_ttft_s: float = 2.0, slo_tpot_ms: float = 25.0,
                 ratios: tuple[float, ...] = (0.1, 0.2, 0.3), handover_s: float = 0.005,
                 kinds: tuple[str, ...] = KINDS, flip_roles: bool | dict = False):
        """
        Args:
            slo_ttft_s: the TTFT target: a choice predicted to meet it is preferred to one
                that does not, whatever it costs others.
            slo_tpot_ms: the TPOT target: an engine whose step would pass it with one more
                sequence decoding does not get the request while another would not.
            ratios: the shares of a prompt balanced P/D may give D.
            handover_s: what a P/D handover adds to TTFT.
            kinds: the choices it may make, of "whole", "pd" and "balanced" (all by default).
            flip_roles: change engines' roles from the traffic: false (default), true, or a
                table of FlipSettings (router/role_policy.py) to change some of their defaults.
        """
        if not 0 < slo_ttft_s < math.inf:
            raise ValueError(f"slo_ttft_s {slo_ttft_s} must be a number of seconds > 0")
        if not 0 < slo_tpot_ms < math.inf:
            raise ValueError(f"slo_tpot_ms {slo_tpot_ms} must be a number of ms > 0")
        if not all(0 < r < 1 for r in ratios):
            raise ValueError(f"ratios {list(ratios)} must each be within (0, 1)")
        if not 0 <= handover_s < math.inf:
            raise ValueError(f"handover_s {handover_s} must be a number of seconds >= 0")
        if not kinds or set(kinds) - set(KINDS):
            raise ValueError(f"kinds {list(kinds)} must be some of {', '.join(KINDS)}")
        self.slo_ttft_s, self.slo_tpot_ms, self.kinds = slo_ttft_s, slo_tpot_ms, tuple(kinds)
        self.flip = FlipSettings.parse(flip_roles)  # None: roles are left alone
        self.model = ChoiceModel(tuple(ratios), handover_s)
        self.steering: RoleSteering | None = None  # with flip_roles, from start()
        self.chosen = {"whole": 0, "pd": 0, "balanced": 0}
        self._arrivals: deque[float] = deque()
        self.last = None  # the last request's Choice
        self.last_loads: list[EngineLoad] = []  # what the model read for it

    def loads(self, request, engines) -> list[EngineLoad]:
        """Each routable engine's load, as the model reads it (its stats fed to the fit)."""
        held = engines.prefix_index.match(request.prompt, request.adapter)
        out = []
        for e in engines.routable():
            if e.load is not None:
                self.model.observe(e.name, e.load)
            out.append(EngineLoad(e.name, e.serves("prefill"), e.serves("decode"),
                                  e.pending_prefill_tokens, e.decoding,
                                  held.get(e.name, 0), e.sends_kv, e.receives_kv,
                                  e.seats or 0, e.ends_per_s(), e.open_calls))
        return out

    async def start(self, engines) -> None:
        if self.flip is not None:
            policy = RolePolicy(self.flip, self.slo_tpot_ms / 1e3)
            self.steering = RoleSteering(policy, engines, lambda: self.chosen, self.tpot_s,
                                         self.flip.wait_s, self.measured)
            self.steering.start()

    def retire(self) -> None:
        if self.steering is not None:
            self.steering.retire()

    async def stop(self) -> None:
        if self.steering is not None:
            await self.steering.stop()

    def tpot_s(self, engine) -> float:
        """`engine`'s predicted step time with one more sequence decoding on it."""
        if engine.load is not None:
            self.model.observe(engine.name, engine.load)
        return self.model.tpot_s(EngineLoad(engine.name, True, True, 0, engine.decoding))

    def measured(self, engine) -> tuple[float, float]:
        """`engine`'s mean step and its share of time on prompts, each smoothed over its
        last polls (the role rules' view)."""
        return (self.model.step_smoothed_s.get(engine.name, 0.0),
                self.model.busy.get(engine.name, 0.0))

    def read(self, load: EngineLoad) -> dict:
        """One engine as the model read it for the last choice."""
        step_s, prompt_share = self.measured(load)
        return {"queue": load.queue, "decoding": load.decoding, "held": load.held,
                "calls": load.calls, "seats": load.seats,
                "ends_per_s": round(load.ends_per_s, 3),
                "seat_wait_s": round(load.seat_wait_s(), 6),
                "step_s": round(step_s, 6), "prompt_share": round(prompt_share, 4)}

    def rate(self) -> float:
        """Requests per second over the last RATE_WINDOW_S (this one included)."""
        now = time.monotonic()
        self._arrivals.append(now)
        while self._arrivals[0] < now - RATE_WINDOW_S:
            self._arrivals.popleft()
        return len(self._arrivals) / max(now - self._arrivals[0], 1.0)

    async def generate(self, request, engines):
        n = len(request.prompt)
        loads = self.loads(request, engines)
        choice = self.model.pick(n, loads, self.slo_ttft_s, self.rate(), self.kinds,
                                 self.slo_tpot_ms / 1e3)
        self.chosen[choice.kind] += 1
        self.last, self.last_loads = choice, loads
        decode = engines[choice.generate]
        begin, first = 0, None
        if choice.kind == "pd" and n > 1:
            begin, first = await engines[choice.prefill].send_prompt(request, decode)
        elif choice.kind == "balanced" and n > 1:
            begin = n - max(1, math.ceil(choice.ratio * n))  # D computes at least one token
            if begin > 0:
                begin, _ = await engines[choice.prefill].send_prompt(request, decode, end=begin)
        async for chunk in decode.start_generate(request, begin=begin, first_token=first):
            yield chunk

    def describe(self) -> dict:
        a, c, b = self.model.costs()
        last = self.last
        return {"slo_ttft_s": self.slo_ttft_s, "slo_tpot_ms": self.slo_tpot_ms,
                "kinds": list(self.kinds),
                "ratios": list(self.model.ratios),
                "handover_s": self.model.handover_s, "chosen": dict(self.chosen),
                "fit": {"step_s": a, "per_sampled_token_s": c, "per_prompt_token_s": b},
                "last": None if last is None else {
                    "kind": last.kind, "generate": last.generate, "prefill": last.prefill,
                    "ratio": last.ratio, "ttft_s": last.ttft_s, "delay_s": last.delay_s,
                    # what the model read of each engine for it
                    "engines": {e.name: self.read(e) for e in self.last_loads}},
                "flip_roles": None if self.flip is None else {
                    "settings": asdict(self.flip),
                    **(self.steering.describe() if self.steering else {})}}
