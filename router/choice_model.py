"""The `auto` strategy's model: for one request, what each way of serving it costs.

For a prompt of n tokens of which `held_e` are cached on engine e (the router's prefix index),
each choice is priced from each engine's polled load — `queue_e`, the prompt tokens of its
open calls not yet computed, and `m_e`, the sequences decoding on it — and from one fit of
the engines' step time over the counters every engine reports, polled twice a second:

    step seconds = a·steps + c·sampled tokens + b·prompt tokens        (Fit, weighted least
                                                                        squares, as the
                                                                        balance model's)
    an engine e that prefills t tokens of it (w = b·t seconds of work) costs others
        D_e(t) = w·m_e  +  w·λ_e·(b·queue_e + w) / (1 − ρ_e)
    whole on e:           TTFT = b·(queue_e + n − held_e) + a          delay = D_e(n − held_e)
    P/D on (P, D):        TTFT = b·(queue_P + n − held_P) + a + h      delay = D_P(n − held_P)
    balanced r on (P, D): TTFT = b·(queue_P + (n − held_P)·(1 − r)) + b·n·r + a + h
                          delay = D_P((n − held_P)·(1 − r)) + D_D(n·r)
    each TTFT, + the wait for a seat on each engine it runs on (P, then D; a send takes a
    seat on P while it computes):
                          W_e = (k_e + 1 − seats_e) / ends_e  when k_e + 1 > seats_e, else 0

`k_e` is e's open calls (sends, generations, KV on its way to it), `seats_e` its --max-num-seqs
and `ends_e` the rate its calls from this router ended over the last seconds: past its seats a
request waits for others to end before it runs (a P/D request gets its first token from P, then
waits for the rest). `D_e(t)` is what the t tokens cost other requests. The m_e sequences
decoding on e each wait them out (chunked prefill shares their steps). And every prompt that
reaches e before its queue empties waits w longer: the queue ahead, b·queue_e, and w itself
drain at 1 − ρ_e of e's time (ρ_e: the share of e's time its prompt tokens took over the last
polls, b times the prompt tokens it computed per second of its loop's time), and prompts arrive
at λ_e per second (the larger of ρ_e / (b·n), the rate that keeps e as busy with prompts like
this one, and the request rate the strategy sees spread evenly over the engines). As a prefill
engine's share nears 1 its work grows dear without bound: that is what makes balanced P/D,
which moves part of a prompt to D, or the whole prompt to a D with room, worth their cost to
D's decodes, before P's queue breaks the TTFT target. `h` is the handover (its p50 on two
H200s: 2.6 ms; `handover_s`, 5 ms). The cost of a choice is its TTFT plus the delay it adds.
The SLO filters first, and drops a choice while another keeps within it when
- its generating engine has no seat free (W_e > 0): at chat lengths a decode engine's seats
  fill while its steps, short contexts decoding, stay far under the TPOT target, and the
  requests past them queue, or
- its generating engine's predicted TPOT, (a + c·(m + 1)) / (1 − ρ) once the request joins its
  batch (its prompts take ρ of its steps' time), is over `slo_tpot_s`, or
- it computes prompt tokens on its generating engine (whole, balanced) while that engine's last
  polled step took `STEP_SHARE` of `slo_tpot_s` or more. The fit has no term for the context
  its decodes attend to: on two H200s, with ~100 sequences of 3,000-token prompts decoding
  beside prefill chunks, D's steps took 44 ms where the fit said 17, and `auto` kept sending it
  whole prompts (TPOT mean 41 ms). The measured step is the check.
Then among those whose TTFT meets `slo_ttft_s` the cheapest wins, else the one with the least
TTFT. Ties go to the earlier choice in the order whole, P/D, balanced: fewer calls, no
transfer.

What this leaves out: the transfer's bandwidth (the same for every P/D choice of one prompt),
and decode steps' own cost in a prefill's time on an engine that also decodes. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.balance_model import Fit, shows_cost

KINDS = ("whole", "pd", "balanced")
_PRIOR = (5e-3, 5e-3 * 0.1 / 64, 25e-6)  # a, c, b: Llama-3.1-8B on an H100 (balance_model)
_SCALE = (50.0, 1e3, 1e3)  # a poll's typical steps, sampled and prompt tokens
BUSY_SMOOTHING = 0.3  # the weight of the latest poll in an engine's prompt share ρ
MAX_BUSY = 0.95  # ρ is held below 1: past it the queue term has no bound
UNKNOWN_WAIT_S = 3600.0  # a seat's wait where none ended lately
STEP_SHARE = 0.8  # of the TPOT target: an engine whose steps take this long gets no prompt


@dataclass(frozen=True)
class Choice:
    """One way to serve a request: `kind` "whole" (on `generate`), "pd" or "balanced" (with
    `prefill` and the share `ratio` of the prompt D computes), its predicted TTFT and the
    delay it adds to other requests, in seconds."""

    kind: str
    generate: str
    prefill: str | None = None
    ratio: float = 0.0
    ttft_s: float = 0.0
    delay_s: float = 0.0

    @property
    def cost_s(self) -> float:
        return self.ttft_s + self.delay_s


@dataclass(frozen=True)
class EngineLoad:
    """What the model reads of an engine: its name, whether it can be P or D, and its load."""

    name: str
    prefill: bool
    decode: bool
    queue: int  # prompt tokens of its open calls not yet computed
    decoding: int  # sequences generating on it, or whose KV is on its way to it
    held: int = 0  # tokens of this prompt it has cached
    sends_kv: bool = True  # may be P (a tensor-parallel engine only with a KV transfer)
    receives_kv: bool = True  # may be D (runs a KV transfer)
    seats: int = 0  # sequences it runs at once (--max-num-seqs); 0: not known
    ends_per_s: float = 0.0  # its calls (sends, generations) that ended, per second lately
    calls: int = 0  # its open calls, each a seat: sends, generations, KV on its way here

    def seat_wait_s(self) -> float:
        """How long one more request would wait for a seat here: 0 while one is free, else
        the requests ahead of it over the rate seats free up (none ended lately: an hour,
        never chosen while anything else can be, and JSON can still show it)."""
        over = max(self.calls, self.decoding) + 1 - self.seats
        if not self.seats or over <= 0:
            return 0.0
        return over / self.ends_per_s if self.ends_per_s > 0 else UNKNOWN_WAIT_S


class ChoiceModel:
    """Fed each engine's polled stats by `observe`; asked `choices` for one prompt."""

    def __init__(self, ratios: tuple[float, ...] = (0.1, 0.2, 0.3), handover_s: float = 5e-3):
        self.fit = Fit(scale=_SCALE)
        self.ratios, self.handover_s = ratios, handover_s
        self._last: dict[str, object] = {}
        self.busy: dict[str, float] = {}  # ρ: each engine's share of time on prompt tokens
        self.step_s: dict[str, float] = {}  # each engine's mean step over its last poll
        # ... smoothed as ρ is (BUSY_SMOOTHING): the role rules' view, which must hold at
        # every poll of their window (router/role_policy.py)
        self.step_smoothed_s: dict[str, float] = {}

    def observe(self, engine: str, stats) -> None:
        """`stats` (EngineStats) of `engine`: the difference from its last is one poll."""
        last = self._last.get(engine)
        self._last[engine] = stats
        if last is None or stats is last:
            return
        steps = stats.steps - last.steps
        busy = stats.step_seconds - last.step_seconds
        if steps < 0 or busy < 0:  # restarted: the counters went back
            return
        if steps == 0 or busy == 0:  # idle the whole poll: no prompt took any of its time
            if engine in self.busy:  # (a share that froze here kept an idle P priced busy)
                self.busy[engine] *= 1 - BUSY_SMOOTHING
            return
        prompt = stats.prompt_tokens_computed - last.prompt_tokens_computed
        self.step_s[engine] = step = busy / steps
        was = self.step_smoothed_s.get(engine, step)
        self.step_smoothed_s[engine] = step + (1 - BUSY_SMOOTHING) * (was - step)
        if shows_cost(stats, last):  # as the balance model's P fit: idle polls read cheap
            self.fit.add((steps, stats.tokens_sampled - last.tokens_sampled, prompt), busy)
        wall = sum(getattr(stats, k) - getattr(last, k) for k in (
            "step_seconds", "idle_seconds", "message_seconds", "send_seconds"))
        share = min(self.costs()[2] * prompt / wall, MAX_BUSY)
        self.busy[engine] = share + (1 - BUSY_SMOOTHING) * (self.busy.get(engine, share) - share)

    def costs(self) -> tuple[float, float, float]:
        """(a, c, b): seconds per step, per sampled token, per prompt token."""
        a, c, b = self.fit.solve(_PRIOR)
        return a, c, b

    def choices(self, n: int, engines: list[EngineLoad], rate: float = 0.0) -> list[Choice]:
        """Every choice for a prompt of n tokens over `engines`, priced, with requests
        arriving at `rate` per second in all."""
        a, _, b = self.costs()
        spread = rate / max(len(engines), 1)

        def delay(e: EngineLoad, tokens: float) -> float:
            work, rho = b * tokens, self.busy.get(e.name, 0.0)
            # a fit may put b at 0 (short prompts alone cannot part it from a step's own cost)
            arrivals = max(spread, rho / (b * max(n, 1))) if b > 0 else spread
            return work * e.decoding + work * arrivals * (b * e.queue + work) / (1 - rho)

        whole = [e for e in engines if e.decode] or engines  # prefill engines are kept for P
        out = [Choice("whole", e.name, ttft_s=b * (e.queue + n - e.held) + a + e.seat_wait_s(),
                      delay_s=delay(e, n - e.held)) for e in whole]
        for p in (e for e in engines if e.prefill and e.sends_kv):
            for d in (e for e in engines if e.decode and e.receives_kv and e is not p):
                todo, seat = n - p.held, p.seat_wait_s() + d.seat_wait_s()
                out.append(Choice("pd", d.name, p.name,
                                  ttft_s=b * (p.queue + todo) + a + self.handover_s + seat,
                                  delay_s=delay(p, todo)))
                out += [Choice("balanced", d.name, p.name, r,
                               ttft_s=b * (p.queue + todo * (1 - r)) + b * n * r + a
                               + self.handover_s + seat,
                               delay_s=delay(p, todo * (1 - r)) + delay(d, n * r))
                        for r in self.ratios]
        return out

    def tpot_s(self, engine: EngineLoad) -> float:
        """`engine`'s time per decoded token once one more sequence decodes on it: its step,
        stretched by the share of its time its prompts take."""
        a, c, _ = self.costs()
        return (a + c * (engine.decoding + 1)) / (1 - self.busy.get(engine.name, 0.0))

    def _has_room(self, engine: EngineLoad, slo_tpot_s: float) -> bool:
        """A seat free on `engine`, and its predicted TPOT within the target with one more."""
        return engine.seat_wait_s() == 0 and self.tpot_s(engine) <= slo_tpot_s

    def _stretches(self, choice: Choice, engine: EngineLoad, slo_tpot_s: float) -> bool:
        """Whether `choice` computes prompt tokens on `engine` (whole and balanced do, on the
        engine that generates) while its last polled step took STEP_SHARE of the target."""
        return (choice.kind != "pd"
                and self.step_s.get(engine.name, 0.0) >= STEP_SHARE * slo_tpot_s)

    def pick(self, n: int, engines: list[EngineLoad], slo_ttft_s: float, rate: float = 0.0,
             kinds: tuple[str, ...] = KINDS, slo_tpot_s: float = float("inf")) -> Choice:
        """The cheapest choice of `kinds` that keeps its engine within `slo_tpot_s` and meets
        `slo_ttft_s`, else the fastest first token (any choice when none of `kinds` is
        possible: a P/D kind needs two engines). When no engine that could generate it has
        room (a seat, a TPOT within the target), still none that computes prompt tokens on an
        engine whose steps are stretched while another choice does not: with 1P1D's one D
        full and P's queue priced high, whole prompts went to D anyway and its steps grew to
        46 ms (two H200s, 3,000/100 at 10 requests/s per GPU); then any choice."""
        options = self.choices(n, engines, rate)
        options = [c for c in options if c.kind in kinds] or options
        by_name = {e.name: e for e in engines}
        for keeps in (lambda c, e: self._has_room(e, slo_tpot_s)
                      and not self._stretches(c, e, slo_tpot_s),
                      lambda c, e: not self._stretches(c, e, slo_tpot_s)):
            kept = [c for c in options if keeps(c, by_name[c.generate])]
            if kept:
                options = kept
                break
        meeting = [c for c in options if c.ttft_s <= slo_ttft_s]
        # to the nanosecond: choices equal but for rounding go to the earlier one
        if meeting:
            return min(meeting, key=lambda c: round(c.cost_s, 9))
        return min(options, key=lambda c: round(c.ttft_s, 9))
