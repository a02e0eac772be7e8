"""router/choice_model.py: the `auto` strategy's prices, on engine stats made from a known
cost model (a step of 6 ms + 50 µs per sampled token + 26 µs per prompt token), as the
router's poller would see them: the fit recovers the costs, and each situation gets the
choice its prices say, exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from router.choice_model import UNKNOWN_WAIT_S, ChoiceModel, EngineLoad

A, C, B = 6e-3, 50e-6, 26e-6
N = 3000


@dataclass(frozen=True)
class Stats:  # the EngineStats counters the model reads
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens_computed: int = 0
    tokens_sampled: int = 0
    idle_seconds: float = 0.0
    message_seconds: float = 0.0
    send_seconds: float = 0.0


@pytest.fixture(scope="module")
def model() -> ChoiceModel:
    m, rng = ChoiceModel(), random.Random(0)
    engines = {"e0": Stats(), "e1": Stats()}
    for _ in range(60):
        for name, s in engines.items():
            m.observe(name, s)
            steps, batch, prompt = rng.randint(20, 80), rng.randint(1, 64), rng.randint(0, 9000)
            engines[name] = replace(s, steps=s.steps + steps,
                                    tokens_sampled=s.tokens_sampled + steps * batch,
                                    prompt_tokens_computed=s.prompt_tokens_computed + prompt,
                                    step_seconds=s.step_seconds + steps * (A + C * batch)
                                    + prompt * B)
    m.busy.clear()  # the random polls' prompt shares and steps: each test sets its own
    m.step_s.clear()
    m.step_smoothed_s.clear()
    return m


def test_the_fit_recovers_the_engines_costs(model):
    a, c, b = model.costs()  # the prior (an H100's costs) pulls them by well under 1%
    assert a == pytest.approx(A, rel=1e-2)
    assert c == pytest.approx(C, rel=1e-2)
    assert b == pytest.approx(B, rel=1e-2)


def fitted(model):
    a, _, b = model.costs()
    return a, b


def any_engine(name, queue=0, decoding=0, held=0, prefill=True, decode=True):
    return EngineLoad(name, prefill, decode, queue, decoding, held)


def test_idle_engines_serve_it_whole(model):
    """Nobody to delay and no handover to pay: whole, on the engine with the shorter queue."""
    a, b = fitted(model)
    choice = model.pick(N, [any_engine("e0", queue=500), any_engine("e1")], slo_ttft_s=2.0)
    assert (choice.kind, choice.generate) == ("whole", "e1")
    assert choice.ttft_s == pytest.approx(b * N + a)
    assert choice.delay_s == 0


def test_a_cached_prefix_draws_it_to_its_holder(model):
    a, b = fitted(model)
    choice = model.pick(N, [any_engine("e0", held=2800), any_engine("e1")], slo_ttft_s=2.0)
    assert (choice.kind, choice.generate) == ("whole", "e0")
    assert choice.ttft_s == pytest.approx(b * 200 + a)


def test_a_long_prompt_goes_to_p_when_every_decoder_is_busy(model):
    """60 sequences decoding on D, P idle: prefilling 3,000 tokens on D would hold each of
    them 78 ms; P/D costs them nothing and the request one handover."""
    a, b = fitted(model)
    engines = [any_engine("p", decode=False), any_engine("d", decoding=60, prefill=False)]
    choice = model.pick(N, engines, slo_ttft_s=2.0)
    assert (choice.kind, choice.prefill, choice.generate) == ("pd", "p", "d")
    assert choice.ttft_s == pytest.approx(b * N + a + 0.005)
    whole = next(c for c in model.choices(N, engines) if c.kind == "whole")
    assert (whole.generate, whole.delay_s) == ("d", pytest.approx(b * N * 60))


def test_a_queued_p_loses_to_whole_on_d_when_its_wait_breaks_the_slo(model):
    """P has 80,000 prompt tokens queued (2.08 s: past a 2-s TTFT target), D decodes 2
    sequences: every P/D choice waits out P's queue, so the request goes whole to D, and its
    two sequences wait out the prompt."""
    a, b = fitted(model)
    engines = [any_engine("p", queue=80_000, decode=False),
               any_engine("d", decoding=2, prefill=False)]
    choice = model.pick(N, engines, slo_ttft_s=2.0)
    assert (choice.kind, choice.generate) == ("whole", "d")
    assert choice.cost_s == pytest.approx(b * N + a + b * N * 2)
    assert all(c.ttft_s > 2.0 for c in model.choices(N, engines) if c.kind != "whole")


def test_at_a_high_rate_a_share_on_idle_d_shortens_ps_queue_for_the_next_requests(model):
    """10 requests/s over two engines, nobody decoding: D computes a tail as fast as P would,
    so no choice has a faster first token than whole; but 30% of the prompt on D leaves the
    next arrivals at each engine less to wait for, which pays for the handover."""
    a, b = fitted(model)
    engines = [any_engine("p", decode=False), any_engine("d", prefill=False)]
    choice = model.pick(N, engines, slo_ttft_s=2.0, rate=10.0)
    assert (choice.kind, choice.prefill, choice.generate, choice.ratio) == (
        "balanced", "p", "d", 0.3)
    assert choice.delay_s == pytest.approx(5.0 * (b * N) ** 2 * (0.7**2 + 0.3**2))
    # the same with 40 sequences decoding on D: any share on D would hold them all
    busy = [engines[0], any_engine("d", decoding=40, prefill=False)]
    assert model.pick(N, busy, slo_ttft_s=2.0, rate=10.0).kind == "pd"
    # and with no traffic to speak of, whole on D: no handover, nobody to delay
    assert model.pick(N, engines, slo_ttft_s=2.0, rate=0.0).kind == "whole"


def test_each_engines_share_of_time_on_prompts_is_measured_from_its_polls(model):
    """A poll of 0.5 s of the engine's loop: 50 steps of 10 sequences, 4,000 prompt tokens
    (0.104 s at the fit's b), idle the rest; then a poll with no prompt: the share falls by
    the smoothing weight."""
    first = Stats(steps=1000, step_seconds=10.0, prompt_tokens_computed=10**6)
    busy = 50 * (A + C * 10) + 4000 * B
    second = replace(first, steps=1050, tokens_sampled=500, prompt_tokens_computed=10**6 + 4000,
                     step_seconds=10.0 + busy, idle_seconds=0.5 - busy)
    fitted_polls = model.fit.n
    model.observe("probe", first)
    model.observe("probe", second)
    assert model.fit.n == fitted_polls  # idle 14% of the poll: its steps may read cheap
    share = model.costs()[2] * 4000 / 0.5
    assert model.busy["probe"] == pytest.approx(share) and 0.2 < share < 0.22
    third = replace(second, steps=1100, tokens_sampled=1000,
                    step_seconds=second.step_seconds + 50 * (A + C * 10),
                    idle_seconds=second.idle_seconds + 0.5 - 50 * (A + C * 10))
    model.observe("probe", third)
    assert model.busy["probe"] == pytest.approx(0.7 * share)
    assert model.step_s["probe"] == pytest.approx(A + C * 10)  # the last poll's mean step
    # ... and the role rules' view, smoothed as the share is: the second poll's mean step
    # (its prompts in it), then 0.3 of the way to the third's
    step2, step3 = busy / 50, A + C * 10
    assert model.step_smoothed_s["probe"] == pytest.approx(step2 + 0.3 * (step3 - step2))
    # its decodes' time per token is stretched by that share
    engine = any_engine("probe", decoding=60)
    a, c, _ = model.costs()
    assert model.tpot_s(engine) == pytest.approx((a + c * 61) / (1 - 0.7 * share))
    # a poll in which it ran no step at all: its share falls as by any prompt-free poll, its
    # last measured step stays (no step measured nothing)
    idle = replace(third, idle_seconds=third.idle_seconds + 0.5)
    model.observe("probe", idle)
    assert model.busy["probe"] == pytest.approx(0.7 * 0.7 * share)
    assert model.step_s["probe"] == pytest.approx(A + C * 10)
    # a restart (the counters went back) reads as nothing
    model.observe("probe", Stats(steps=3, step_seconds=0.1))
    assert model.busy["probe"] == pytest.approx(0.7 * 0.7 * share)
    del model.busy["probe"], model.step_s["probe"], model.step_smoothed_s["probe"]


def test_as_p_nears_saturation_its_work_grows_dear_and_d_takes_the_prompt(model):
    """1P1D at 18 requests/s, D decoding 18 sequences with 20% of its time on prompts. While P
    is idle the prompt goes to P (P/D): its work holds no one. Once P spends 95% of its time on
    prompts with 12,000 tokens queued, each second of work added to it holds every prompt that
    reaches it (12/s at that share) until its queue drains at 5% of its time: now the whole
    prompt on D is cheapest, though its 18 decodes wait it out."""
    a, b = fitted(model)
    w = b * N
    engines = [any_engine("p", decode=False), any_engine("d", decoding=18, prefill=False)]
    model.busy.update(p=0.0, d=0.2)
    try:
        choice = model.pick(N, engines, slo_ttft_s=2.0, rate=18.0, slo_tpot_s=0.025)
        assert (choice.kind, choice.prefill, choice.generate) == ("pd", "p", "d")
        assert choice.delay_s == pytest.approx(w * 9.0 * w)  # arrivals: 18/s over 2 engines
        model.busy["p"] = 0.95
        engines[0] = any_engine("p", queue=12_000, decode=False)
        options = {(c.kind, c.ratio): c for c in model.choices(N, engines, 18.0)}
        to_p = 0.95 / w  # > 9/s: the rate that keeps P 95% busy with such prompts
        assert options["pd", 0.0].delay_s == pytest.approx(w * to_p * (b * 12_000 + w) / 0.05)
        choice = model.pick(N, engines, slo_ttft_s=2.0, rate=18.0, slo_tpot_s=0.025)
        assert (choice.kind, choice.generate) == ("whole", "d")
        assert choice.delay_s == pytest.approx(w * 18 + w * 9.0 * w / 0.8)
        assert choice.cost_s < min(c.cost_s for c in options.values() if c.kind != "whole")
    finally:
        del model.busy["p"], model.busy["d"]


def test_an_engine_whose_steps_near_the_tpot_target_gets_no_prompt_to_compute(model):
    """D's last poll: steps of 21 ms (prefill chunks beside long-context decodes; the fit
    would predict far less). P is saturated, so whole on D is cheapest, but a prompt computed
    there would stretch its steps further: with a 25-ms target (21 ms >= 0.8 of it) only P/D
    is left. Below 20 ms, or with no target, whole on D again."""
    model.busy.update(p=0.95, d=0.2)
    engines = [any_engine("p", queue=12_000, decode=False),
               any_engine("d", decoding=18, prefill=False)]
    try:
        for step, target, kind in ((0.021, 0.025, "pd"), (0.019, 0.025, "whole"),
                                   (0.021, float("inf"), "whole")):
            model.step_s["d"] = step
            assert model.pick(N, engines, slo_ttft_s=2.0, rate=18.0,
                              slo_tpot_s=target).kind == kind, (step, target)
    finally:
        del model.busy["p"], model.busy["d"], model.step_s["d"]


def test_a_fit_with_no_cost_per_prompt_token_still_prices_every_choice(monkeypatch):
    """Chat-like polls (a few short prompts beside many decodes) can fit b at 0: the price of
    P's work is then 0, not a division by it (a 500 under chat-like load before)."""
    model = ChoiceModel()
    monkeypatch.setattr(model, "costs", lambda: (A, C, 0.0))
    model.busy.update(p=0.5)
    engines = [any_engine("p", queue=1000, decode=False), any_engine("d", decoding=8)]
    choice = model.pick(200, engines, slo_ttft_s=2.0, rate=20.0)
    assert (choice.kind, choice.delay_s) == ("whole", 0.0)


def test_when_nothing_meets_the_slo_the_fastest_first_token_wins(model):
    engines = [any_engine("p", queue=200_000, decode=False),
               any_engine("d", queue=150_000, decoding=10, prefill=False)]
    choice = model.pick(N, engines, slo_ttft_s=0.5)
    assert choice.ttft_s == min(c.ttft_s for c in model.choices(N, engines))
    assert (choice.kind, choice.generate) == ("whole", "d")


def test_kinds_restrict_the_choice(model):
    engines = [any_engine("e0"), any_engine("e1")]
    choice = model.pick(N, engines, slo_ttft_s=2.0, kinds=("balanced",))  # all cost the same
    assert (choice.kind, choice.ratio) == ("balanced", 0.1)
    # one engine: no P/D choice exists, so it is served whole whatever kinds says
    assert model.pick(N, engines[:1], 2.0, kinds=("pd",)).kind == "whole"


def test_an_engine_past_the_tpot_target_only_prefills_what_it_holds(model):
    """e0 holds all but the last token of the prompt but decodes 400 sequences: one more
    makes its step 26 ms, past a 25-ms target. Without the target the request runs whole on
    e0; with it, e0 computes the last token and hands the KV over to e1 (P/D), which
    decodes it."""
    a, c, _ = model.costs()
    engines = [any_engine("e0", held=N - 1, decoding=400), any_engine("e1")]
    assert model.tpot_s(engines[0]) == pytest.approx(a + c * 401)
    assert model.tpot_s(engines[0]) > 0.025
    assert (model.pick(N, engines, slo_ttft_s=2.0).kind,
            model.pick(N, engines, slo_ttft_s=2.0).generate) == ("whole", "e0")
    choice = model.pick(N, engines, slo_ttft_s=2.0, slo_tpot_s=0.025)
    assert (choice.kind, choice.prefill, choice.generate) == ("pd", "e0", "e1")


def test_engines_that_cannot_move_kv_are_never_p_or_d(model):
    """An engine that cannot send (a tensor-parallel one without a KV transfer) is never P,
    and one that cannot receive (no KV transfer) never D. p cannot send, so only e can be P; once e cannot receive
    either and d decodes 60 sequences, the request runs whole on e, the idle one."""
    engines = [EngineLoad("p", True, False, 0, 0, sends_kv=False),
               any_engine("d", decoding=60, prefill=False), any_engine("e")]
    assert {(c.kind, c.prefill, c.generate) for c in model.choices(N, engines)
            if c.kind != "whole"} == {("pd", "e", "d"), ("balanced", "e", "d")}
    engines[2] = EngineLoad("e", True, True, 0, 0, sends_kv=False, receives_kv=False)
    assert all(c.kind == "whole" for c in model.choices(N, engines))
    choice = model.pick(N, engines, slo_ttft_s=2.0)
    assert (choice.kind, choice.generate) == ("whole", "e")


def test_a_decoder_whose_seats_are_taken_gets_no_request_while_another_has_one(model):
    """1P1D at chat lengths after P turned any, 96 seats on d: all taken (the rest of its
    requests queue) though its steps are short; one more request there waits for one of them
    to end, at 20 ends a second (50 ms). So it runs whole on e, which has seats free, though
    by delay alone (e's 120 decodes against d's 96) d would win — and does, a seat free."""
    a, b = fitted(model)
    d = EngineLoad("d", False, True, 0, 96, seats=96, ends_per_s=20.0)
    e = EngineLoad("e", True, True, 0, 120, seats=128, ends_per_s=5.0)
    assert (d.seat_wait_s(), e.seat_wait_s()) == (pytest.approx(1 / 20), 0)
    by_kind = {(c.kind, c.generate, c.ratio): c for c in model.choices(200, [e, d])}
    assert by_kind["whole", "d", 0.0].ttft_s == pytest.approx(b * 200 + a + 1 / 20)
    assert by_kind["pd", "d", 0.0].ttft_s == pytest.approx(
        b * 200 + a + model.handover_s + 1 / 20)
    choice = model.pick(200, [e, d], slo_ttft_s=2.0, slo_tpot_s=0.025)
    assert (choice.kind, choice.generate) == ("whole", "e")
    d = replace(d, decoding=95)
    choice = model.pick(200, [e, d], slo_ttft_s=2.0, slo_tpot_s=0.025)
    assert (choice.kind, choice.generate) == ("whole", "d")


def test_past_its_seats_an_engine_with_no_ends_yet_is_priced_an_hours_wait(model):
    """No generation has ended on d lately (a burst filled its seats): the wait is unknown and
    priced as an hour, so P/D to d loses to f, a decoder with a seat free; with d the only
    decoder it still gets the request (nothing else can decode it), its price shown."""
    d = EngineLoad("d", False, True, 0, 8, seats=8)
    assert d.seat_wait_s() == UNKNOWN_WAIT_S
    p = EngineLoad("p", True, False, 0, 0, seats=8)
    free = EngineLoad("f", False, True, 0, 3, seats=8)
    assert model.pick(N, [p, d, free], slo_ttft_s=2.0).generate == "f"
    choice = model.pick(N, [p, d], slo_ttft_s=2.0)
    assert choice.generate == "d" and choice.ttft_s > UNKNOWN_WAIT_S


def test_with_no_decoder_to_spare_prompts_still_stay_off_a_stretched_one(model):
    """1P1D with D's 96 seats all taken (every choice generates on D, none has room) and P
    nearly saturated, so P's work is priced high and whole on D is cheapest. While D's last
    step took 46 ms (over 0.8 of the 25-ms target), only P/D keeps prompts off it; once its
    steps are short again, the cheapest of all."""
    model.busy.update(p=0.95, d=0.3)
    engines = [EngineLoad("p", True, False, 12_000, 0, seats=96, ends_per_s=18.0),
               EngineLoad("d", False, True, 0, 96, seats=96, ends_per_s=18.0)]
    try:
        model.step_s["d"] = 0.046
        assert model.pick(N, engines, slo_ttft_s=2.0, rate=18.0, slo_tpot_s=0.025).kind == "pd"
        model.step_s["d"] = 0.012
        cheapest = min(model.choices(N, engines, 18.0), key=lambda c: round(c.cost_s, 9))
        assert cheapest.kind != "pd"
        assert model.pick(N, engines, slo_ttft_s=2.0, rate=18.0, slo_tpot_s=0.025) == cheapest
    finally:
        del model.busy["p"], model.busy["d"], model.step_s["d"]
