"""When the `auto` strategy flips an engine's role by itself (issue 44, item 2): a pure policy.

Fed one `Observation` of the pool per poll (each routable engine's role, prompt tokens waiting,
sequences decoding, predicted TPOT, KV use, seats, measured step and share of its time on
prompts; the choices `auto` made since the last one), it answers at most one `Flip`. Four
rules, checked in this order:

    decode_bound   every routable engine that decodes is saturated (it decodes something,
                   and its predicted step with one more sequence >= tpot_share x the TPOT
                   target, or its KV use >= kv_use, or every seat of its --max-num-seqs
                   taken) while a prefill engine idles (fewer than
                   backlog_tokens / 10 prompt tokens waiting): that engine -> decode, or -> any
                   when it is the last engine that prefills and `auto` sent a request P/D or
                   balanced within the window
    prefill_bound  the prefill engines have backlog_tokens or more prompt tokens waiting each
                   (on average) while a decode engine has room (TPOT, KV use and seats taken
                   at most half of saturated) and is not the last engine that decodes: that
                   engine -> prefill
    chat_like      within the window `auto` chose at least min_requests times, whole_share or
                   more of them "whole": a prefill engine -> any, else a decode engine -> any
    interference   no engine is a prefill engine, and every engine that decodes steps past
                   INTERFERENCE_SHARE x the TPOT target while prompts take PROMPT_SHARE or
                   more of its time (long prompts computed beside decodes stretch them all):
                   the "any" engine decoding the fewest -> prefill, so the others decode
                   undisturbed (disaggregation's reason to be; decode_bound turns it back
                   when decodes, not prompts, are what is short)

Hysteresis, so a burst flips nothing and two rules do not chase each other:

    observation:   o   o   o   o   o   o   o   o   o   o   o   o   o   o   o
    rule holds:        [---------- window_s ---------]
                                                     ^ flip (then no flip in flight)
                                                       [--- cooldown_s ---]
                                                     rules checked again ^, timers from zero

- a rule fires only when its condition (a candidate included) has held at every observation
  for `window_s`; a miss restarts its timer;
- after any role change (this policy's or an ops call's, seen as a role that differs from the
  last observation's) nothing is checked for `cooldown_s`, and every timer restarts after it;
- at most one flip in flight: none is proposed while one runs (`Observation.flipping`: an ops
  flip; or this policy's own until `done`);
- no flip leaves the pool without an engine that decodes, nor without one that prefills while
  `auto` sent requests P/D within the window (`keeps_needed_roles`).

Which engine: the one with the fewest prompt tokens waiting (a prefill engine) or the fewest
sequences decoding (a decode engine), then the first in the pool's order: the one whose flip
waits least. Flips to "any" never wait (the engine keeps doing what it did) and never take a
role away. Plain Python, no asyncio: router/role_steering.py runs it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields

RULES = ("decode_bound", "prefill_bound", "chat_like", "interference")
IDLE_SHARE = 0.1  # a prefill engine idles below this share of backlog_tokens waiting
ROOM_SHARE = 0.5  # a decode engine has room at or below this share of saturated
PROMPT_SHARE = 0.3  # a step stretched by prompts: they take this share or more of the time
# Of the TPOT target: an engine's mean step this long, with prompts PROMPT_SHARE of its time,
# is stretched by them. It was the choice model's STEP_SHARE (0.8, 20 ms), and the rule held
# "at every poll for window_s" only ~97 and ~278 s into a 3,000/100 phase at 9 req/s per GPU
# over two "any" engines (two pairs of H200s, 2026-11-28: that phase's goodput 0.98x and 0.85x
# balanced P/D's). By the fit's costs a step there averages ~24 ms (2,048-token chunks of ~55
# ms two-thirds of the time, ~10-ms decode steps the rest), so a poll's mean crosses 20 ms
# often: an estimate, not a trace (runs since keep one: bench.strategies' strategy_trace).
# Chat-like traffic steps 5-8 ms with prompts under 1% of the time, and 3,000-token prompts
# at 3 req/s per GPU (where data parallel wins) take ~0.2 of it.
INTERFERENCE_SHARE = 0.5


@dataclass(frozen=True)
class FlipSettings:
    """`auto`'s `flip_roles` argument: true (these defaults) or a table of some of them."""

    window_s: float = 10.0  # a rule must hold this long before it flips
    cooldown_s: float = 30.0  # after any role change, no flip for this long
    # a flip waits this long for its old role's work, then flips anyway; 2.0 ended an
    # any -> prefill flip under 3,000/100 at 9 req/s per GPU 2.005 s after it began (two H200s,
    # 2026-11-29): past issue 44's 2 s for a flip, so a margin
    wait_s: float = 1.5
    backlog_tokens: int = 8192  # prompt tokens waiting per prefill engine: prefill-bound
    tpot_share: float = 0.9  # of the TPOT target: a decode engine is saturated
    kv_use: float = 0.9  # share of KV pages in use: a decode engine is saturated
    whole_share: float = 0.9  # of auto's choices "whole": chat-like traffic
    min_requests: int = 20  # choices within the window before chat_like may fire

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise ValueError(f"flip_roles.{f.name} {value!r} must be a finite number")
        for name in ("window_s", "cooldown_s", "wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"flip_roles.{name} {getattr(self, name)} must be >= 0 seconds")
        for name in ("backlog_tokens", "min_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"flip_roles.{name} {getattr(self, name)} must be >= 1")
        for name in ("tpot_share", "kv_use", "whole_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"flip_roles.{name} {getattr(self, name)} must be within "
                                 "(0, 1]")

    @classmethod
    def parse(cls, value: bool | dict) -> FlipSettings | None:
        """`flip_roles` as given: False (off: None), True (the defaults) or a dict of
        settings. Raises ValueError naming what is wrong."""
        if value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"flip_roles {value!r} must be true, false or a table of "
                             f"{', '.join(f.name for f in fields(cls))}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"flip_roles has no setting {', '.join(unknown)} (settings: "
                             f"{', '.join(f.name for f in fields(cls))})")
        return cls(**value)


@dataclass(frozen=True)
class EngineView:
    """One routable engine as the policy sees it."""

    name: str
    role: str  # "prefill", "decode" or "any"
    waiting: int  # prompt tokens of the router's open calls on it not computed yet
    decoding: int  # sequences the router has generating on it, or on their way to it
    tpot_s: float  # its predicted step time with one more sequence decoding
    kv_use: float  # share of its KV pages in use (last poll)
    seats: int = 0  # sequences it runs at once (--max-num-seqs); 0: not known
    step_s: float = 0.0  # its mean step over its last polls (measured, smoothed)
    prompt_share: float = 0.0  # the share of its time its prompt tokens took, lately

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "any")

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "any")


@dataclass(frozen=True)
class Observation:
    time: float  # seconds, monotonic
    engines: tuple[EngineView, ...]  # the routable ones, in the pool's order
    chosen: dict[str, int] = field(default_factory=dict)  # auto's choices since the last one
    flipping: bool = False  # a flip (an ops call's) is in flight


@dataclass(frozen=True)
class Flip:
    engine: str
    from_role: str
    to_role: str
    reason: str  # the rule's name


def keeps_needed_roles(engines: tuple[EngineView, ...], flip: Flip, needs_prefill: bool) -> bool:
    """Whether the pool, with `flip` done, still has an engine that decodes (every request
    needs one) and, if `needs_prefill`, one that prefills."""
    roles = [flip.to_role if e.name == flip.engine else e.role for e in engines]
    return ("decode" in roles or "any" in roles) and (
        not needs_prefill or "prefill" in roles or "any" in roles)


class RolePolicy:
    """Fed `observe` once per poll; `done` when a flip it proposed has finished (or failed)."""

    def __init__(self, settings: FlipSettings, slo_tpot_s: float):
        self.settings = settings
        self.saturated_s = settings.tpot_share * slo_tpot_s  # a decode step this long: full
        self.stretched_s = INTERFERENCE_SHARE * slo_tpot_s  # a step this long: stretched
        # written by observe only
        self._since: dict[str, float] = {}  # rule -> when it started holding
        self._roles: dict[str, str] = {}  # the roles last seen (with this policy's flip done)
        self._changed_at = -math.inf  # when a role last changed
        self._choices: deque[tuple[float, dict[str, int]]] = deque()  # within the window
        self.pending: Flip | None = None  # proposed, not done yet

    def observe(self, obs: Observation) -> Flip | None:
        """The flip to make now, if any (then none until `done`)."""
        s = self.settings
        self._choices.append((obs.time, obs.chosen))
        while len(self._choices) > 1 and self._choices[0][0] <= obs.time - s.window_s:
            self._choices.popleft()  # (the window is (time - window_s, time], at least this)
        roles = {e.name: e.role for e in obs.engines}
        if any(self._roles.get(name, role) != role for name, role in roles.items()):
            self._changed_at = obs.time
        if roles.keys() != self._roles.keys():  # an engine came or went: start over
            self._since.clear()
        self._roles = roles
        if (self.pending is not None or obs.flipping
                or obs.time - self._changed_at < s.cooldown_s):
            self._since.clear()
            return None
        for rule in RULES:
            flip = getattr(self, rule)(obs)
            if flip is None:
                self._since.pop(rule, None)
                continue
            since = self._since.setdefault(rule, obs.time)
            if obs.time - since >= s.window_s:
                self.pending = flip
                self._roles[flip.engine] = flip.to_role  # expected: not a change by others
                self._since.clear()
                return flip
        return None

    def done(self, time: float) -> None:
        """The pending flip ended (done or failed) at `time`: the cool-down starts."""
        self.pending = None
        self._changed_at = time

    # -- the rules: each the flip it would make now, or None ------------------------------------

    def decode_bound(self, obs: Observation) -> Flip | None:
        decoders = [e for e in obs.engines if e.decodes]
        if not decoders or not all(self._saturated(e) for e in decoders):
            return None
        idle = [e for e in obs.engines if e.role == "prefill"
                and e.waiting < IDLE_SHARE * self.settings.backlog_tokens]
        if not idle:
            return None
        engine = min(idle, key=lambda e: e.waiting)
        flip = Flip(engine.name, "prefill", "decode", "decode_bound")
        if not keeps_needed_roles(obs.engines, flip, self._needs_prefill()):
            flip = Flip(engine.name, "prefill", "any", "decode_bound")
        return flip

    def prefill_bound(self, obs: Observation) -> Flip | None:
        prefill = [e for e in obs.engines if e.role == "prefill"]
        if not prefill or (sum(e.waiting for e in prefill) / len(prefill)
                           < self.settings.backlog_tokens):
            return None
        flips = [Flip(e.name, "decode", "prefill", "prefill_bound")
                 for e in sorted(obs.engines, key=lambda e: e.decoding)
                 if e.role == "decode" and self._has_room(e)]
        return next((f for f in flips if keeps_needed_roles(obs.engines, f, True)), None)

    def chat_like(self, obs: Observation) -> Flip | None:
        total = sum(n for _, chosen in self._choices for n in chosen.values())
        whole = sum(chosen.get("whole", 0) for _, chosen in self._choices)
        if total < self.settings.min_requests or whole < self.settings.whole_share * total:
            return None
        prefill = sorted((e for e in obs.engines if e.role == "prefill"),
                         key=lambda e: e.waiting)
        decode = sorted((e for e in obs.engines if e.role == "decode"),
                        key=lambda e: e.decoding)
        if not prefill + decode:
            return None
        engine = (prefill + decode)[0]
        return Flip(engine.name, engine.role, "any", "chat_like")

    def interference(self, obs: Observation) -> Flip | None:
        decoders = [e for e in obs.engines if e.decodes]
        if (any(e.role == "prefill" for e in obs.engines) or len(decoders) < 2
                or not all(e.step_s >= self.stretched_s and e.prompt_share >= PROMPT_SHARE
                           for e in decoders)):
            return None
        flips = [Flip(e.name, "any", "prefill", "interference")
                 for e in sorted(decoders, key=lambda e: e.decoding) if e.role == "any"]
        return next((f for f in flips if keeps_needed_roles(obs.engines, f, True)), None)

    def _saturated(self, e: EngineView) -> bool:
        # an idle engine stepping slower than the target is not saturated: another engine
        # that decodes would step no faster
        return e.decoding > 0 and (e.tpot_s >= self.saturated_s
                                   or e.kv_use >= self.settings.kv_use
                                   or 0 < e.seats <= e.decoding)

    def _has_room(self, e: EngineView) -> bool:
        return (e.tpot_s <= ROOM_SHARE * self.saturated_s
                and e.kv_use <= ROOM_SHARE * self.settings.kv_use
                and e.decoding <= ROOM_SHARE * (e.seats or math.inf))

    def _needs_prefill(self) -> bool:
        """Whether `auto` sent a request P/D or balanced within the window."""
        return any(chosen.get(k, 0) for _, chosen in self._choices for k in ("pd", "balanced"))

    def describe(self, now: float) -> dict:
        """The rules holding now and for how long, and the cool-down left (seconds)."""
        return {"holding_s": {rule: round(now - t, 3) for rule, t in self._since.items()},
                "cooldown_left_s": round(max(0.0, self._changed_at + self.settings.cooldown_s
                                             - now), 3),
                "pending": None if self.pending is None else asdict(self.pending)}
