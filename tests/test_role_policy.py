"""router/role_policy.py: the `auto` strategy's role flips, decided on synthetic observation
sequences (one every 0.5 s, as the router polls): exactly which flip, at which observation —
none before a rule held for its window, none in the cool-down or while a flip is in flight,
never the last engine of a role the traffic needs."""

from __future__ import annotations

import asyncio

import pytest

from router.engines import EnginePool
from router.host import StrategyHost, StrategySource
from strategies.auto import Auto
from router.role_policy import (EngineView, Flip, FlipSettings, Observation, RolePolicy,
                                keeps_needed_roles)

SETTINGS = FlipSettings(window_s=2.0, cooldown_s=5.0, backlog_tokens=1000, min_requests=10)
SLO_TPOT_S = 0.025  # saturated from 0.9 x 25 ms = 22.5 ms; room up to 11.25 ms
FULL, ROOMY = 0.030, 0.005  # predicted TPOTs
TICK = 0.5


def engine(name, role, waiting=0, decoding=0, tpot_s=ROOMY, kv_use=0.1) -> EngineView:
    return EngineView(name, role, waiting, decoding, tpot_s, kv_use)


def run(policy, frames, start=0.0, flipping=()):
    """Observe `frames` (engines, chosen) one TICK apart from `start`; the flips returned, by
    time. Each flip is taken as done at once (the next frame shows the pool after it)."""
    flips = []
    for i, (engines, chosen) in enumerate(frames):
        t = start + i * TICK
        flip = policy.observe(Observation(t, tuple(engines), chosen, t in flipping))
        if flip is not None:
            flips.append((t, flip))
            policy.done(t)
    return flips


def policy() -> RolePolicy:
    return RolePolicy(SETTINGS, SLO_TPOT_S)


def test_decode_bound_flips_the_idle_prefill_engine_after_the_window():
    """1P1D, D saturated, P idle, P/D traffic: P is the last that prefills, so it becomes any
    (it keeps prefilling and now decodes too) — at 2.0 s, the first observation a full window
    after the rule began to hold, not before."""
    pool = [engine("p", "prefill"), engine("d", "decode", decoding=40, tpot_s=FULL)]
    flips = run(policy(), [(pool, {"pd": 2})] * 6)
    assert flips == [(2.0, Flip("p", "prefill", "any", "decode_bound"))]


def test_decode_bound_without_p_d_traffic_makes_it_a_decode_engine():
    """KV nearly full on D (TPOT fine), no request went P/D: P becomes a decode engine."""
    pool = [engine("p", "prefill", waiting=99), engine("d", "decode", 0, 1, kv_use=0.95)]
    assert run(policy(), [(pool, {"whole": 1})] * 5) == [
        (2.0, Flip("p", "prefill", "decode", "decode_bound"))]


def test_an_idle_decode_engine_is_not_saturated_however_slow_its_step():
    """A step slower than the target with nothing decoding: another decode engine would step
    no faster, so nothing flips."""
    pool = [engine("p", "prefill"), engine("d", "decode", 0, 0, FULL)]
    assert run(policy(), [(pool, {})] * 10) == []


def test_a_miss_restarts_the_window():
    held = [engine("p", "prefill"), engine("d", "decode", 0, 8, FULL)]
    missed = [engine("p", "prefill", waiting=100), engine("d", "decode", 0, 8, FULL)]  # busy P
    frames = [(held, {})] * 3 + [(missed, {})] + [(held, {})] * 6
    assert run(policy(), frames) == [(4.0, Flip("p", "prefill", "decode", "decode_bound"))]


def test_nothing_in_the_cool_down_then_a_full_window_again():
    """2P1D, every decoder saturated: p0 flips at 2.0; p1 would be next, but the cool-down
    (5 s from 2.0) and then a fresh window put it at 9.0."""
    def pool(p0_role):
        return [engine("p0", p0_role, 0, 3, FULL), engine("p1", "prefill"),
                engine("d", "decode", 0, 8, FULL)]
    frames = [(pool("prefill"), {})] * 5 + [(pool("decode"), {})] * 16
    assert run(policy(), frames) == [
        (2.0, Flip("p0", "prefill", "decode", "decode_bound")),
        (9.0, Flip("p1", "prefill", "decode", "decode_bound"))]


def test_one_flip_in_flight_at_most():
    p = policy()
    pool = [engine("p", "prefill"), engine("d", "decode", 0, 8, FULL)]
    flips = [p.observe(Observation(i * TICK, tuple(pool))) for i in range(10)]
    assert flips[4] == Flip("p", "prefill", "decode", "decode_bound")
    assert flips[:4] == [None] * 4 and flips[5:] == [None] * 5  # never done: no second one
    assert p.describe(4.5)["pending"] == {"engine": "p", "from_role": "prefill",
                                          "to_role": "decode", "reason": "decode_bound"}


def test_an_ops_flip_pauses_the_rules_and_its_change_starts_the_cool_down():
    """An ops flip in flight at 1.0 restarts the window; d changed by it (seen at 1.5: decode
    -> any) starts a cool-down: the rule holds again from 6.5, flips at 8.5."""
    before = [engine("p", "prefill"), engine("d", "decode", 0, 8, FULL)]
    after = [engine("p", "prefill"), engine("d", "any", 0, 8, FULL)]
    frames = [(before, {})] * 3 + [(after, {})] * 16
    assert run(policy(), frames, flipping=(1.0,)) == [
        (8.5, Flip("p", "prefill", "decode", "decode_bound"))]


def test_prefill_bound_takes_the_lightest_decode_engine_with_room():
    """1P2D, P 1500 tokens behind: d1 becomes a prefill engine — d2 decodes fewer sequences
    but its KV is half full (no room), d0 decodes more."""
    pool = [engine("p", "prefill", waiting=1500), engine("d0", "decode", decoding=9),
            engine("d1", "decode", decoding=3), engine("d2", "decode", decoding=1,
                                                        kv_use=0.5)]
    assert run(policy(), [(pool, {"pd": 3})] * 5) == [
        (2.0, Flip("d1", "decode", "prefill", "prefill_bound"))]


def test_prefill_bound_never_takes_the_last_decode_engine():
    """1P1D: D has room, but it is the only engine that decodes (auto already sends prompts
    whole to D when P's queue makes that cheaper)."""
    pool = [engine("p", "prefill", waiting=5000), engine("d", "decode")]
    assert run(policy(), [(pool, {"pd": 3})] * 10) == []
    # nor with too little waiting: 2 prefill engines at 1500 and 400 average 950 < 1000
    pool = [engine("p0", "prefill", waiting=1500), engine("p1", "prefill", waiting=400),
            engine("d0", "decode"), engine("d1", "decode")]
    assert run(policy(), [(pool, {"pd": 3})] * 10) == []


def test_chat_like_traffic_turns_prefill_then_decode_engines_to_any():
    """Nearly all whole (19 of every 20, 95% >= 90%): P -> any once the rule held 2 s; after
    the cool-down, D -> any; then nothing is left to flip."""
    def pool(p_role, d_role):
        return [engine("p", p_role), engine("d", d_role, decoding=2)]
    chosen = {"whole": 19, "pd": 1}
    frames = ([(pool("prefill", "decode"), chosen)] * 5 + [(pool("any", "decode"), chosen)] * 14
              + [(pool("any", "any"), chosen)] * 10)
    assert run(policy(), frames) == [(2.0, Flip("p", "prefill", "any", "chat_like")),
                                     (9.0, Flip("d", "decode", "any", "chat_like"))]


def test_chat_like_needs_enough_choices_and_the_share():
    pool = [engine("p", "prefill"), engine("d", "decode")]
    assert run(policy(), [(pool, {"whole": 2})] * 12) == []  # 8 in a window, < 10
    assert run(policy(), [(pool, {"whole": 8, "pd": 2})] * 12) == []  # 80% < 90%


def test_keeps_needed_roles():
    pool = (engine("p", "prefill"), engine("d", "decode"))
    assert not keeps_needed_roles(pool, Flip("d", "decode", "prefill", "x"), False)
    assert not keeps_needed_roles(pool, Flip("p", "prefill", "decode", "x"), True)
    assert keeps_needed_roles(pool, Flip("p", "prefill", "decode", "x"), False)
    assert keeps_needed_roles(pool, Flip("p", "prefill", "any", "x"), True)


def test_settings_from_the_strategy_argument():
    assert FlipSettings.parse(False) is None
    assert FlipSettings.parse(True) == FlipSettings()
    assert FlipSettings.parse({"window_s": 3}).window_s == 3
    for value, message in [({"window_s": -1}, "flip_roles.window_s -1 must be >= 0"),
                           ({"whole_share": 1.5}, "flip_roles.whole_share 1.5 must be within"),
                           ({"min_requests": True}, "flip_roles.min_requests True must be a"),
                           ({"nope": 1}, "flip_roles has no setting nope"),
                           ("yes", "flip_roles 'yes' must be true, false or a table")]:
        with pytest.raises(ValueError, match=message):
            FlipSettings.parse(value)
    with pytest.raises(ValueError, match="flip_roles has no setting window"):
        Auto(flip_roles={"window": 1})
    auto = Auto(flip_roles={"cooldown_s": 60})
    assert auto.describe()["flip_roles"]["settings"]["cooldown_s"] == 60
    assert Auto().describe()["flip_roles"] is None


async def test_a_swap_ends_auto_s_steering_while_its_last_request_runs():
    """The steering task runs from `start` (observing an empty pool here) and ends when the
    host swaps auto out (`retire`), not after its last request: a swapped-out auto flips
    nothing under the strategy that replaced it."""
    host = StrategyHost(EnginePool(poll_interval_s=0.01))
    auto = await host.load(StrategySource.builtin("auto"), {"flip_roles": {"window_s": 0}})
    task = auto.instance.steering._task
    await asyncio.sleep(0.05)
    assert not task.done() and auto.describe()["settings"]["flip_roles"]["flips"] == []
    running = host.acquire()  # a request still on auto
    await host.load(StrategySource.builtin("data_parallel"))
    await asyncio.sleep(0)
    assert task.cancelled() and host.retired == [auto]
    host.release(running, finished=True)
    await host.close()
    assert Auto(flip_roles=False).steering is None


def test_a_decoder_with_every_seat_taken_is_saturated_whatever_its_step():
    """Chat lengths on 1P1D: D's 96 seats all taken (the rest of its requests queue for
    them) while its predicted step, short contexts, is roomy: decode_bound turns the idle P
    to any after the window. One seat free: nothing flips."""
    full = [engine("p", "prefill"), EngineView("d", "decode", 0, 96, ROOMY, 0.1, seats=96)]
    assert run(policy(), [(full, {"pd": 2})] * 6) == [
        (2.0, Flip("p", "prefill", "any", "decode_bound"))]
    free = [engine("p", "prefill"), EngineView("d", "decode", 0, 95, ROOMY, 0.1, seats=96)]
    assert run(policy(), [(free, {"pd": 2})] * 10) == []


def test_prefill_bound_counts_seats_as_room():
    """P 1500 tokens behind; d0 has more than half its seats taken (no room), d1 fewer."""
    pool = [engine("p", "prefill", waiting=1500),
            EngineView("d0", "decode", 0, 40, ROOMY, 0.1, seats=64),
            EngineView("d1", "decode", 0, 32, ROOMY, 0.1, seats=64)]
    assert run(policy(), [(pool, {"pd": 3})] * 5) == [
        (2.0, Flip("d1", "decode", "prefill", "prefill_bound"))]


def stretched(name, role="any", decoding=30, step_s=0.045, prompt_share=0.6):
    """An engine whose steps long prompts stretch: 45 ms (the TPOT target's 25 x 0.5 = 12.5
    ms is the line), 60% of its time on prompts."""
    return EngineView(name, role, 0, decoding, ROOMY, 0.1, 96, step_s, prompt_share)


def test_interference_turns_the_any_engine_decoding_least_to_prefill():
    """Two "any" engines (after a chat phase) computing 3,000-token prompts beside their
    decodes, both stepping 45 ms: e1, decoding fewer, becomes the prefill engine after the
    window, and the pool is 1P1D again."""
    pool = [stretched("e0", decoding=40), stretched("e1", decoding=25)]
    assert run(policy(), [(pool, {"whole": 8, "pd": 4})] * 6) == [
        (2.0, Flip("e1", "any", "prefill", "interference"))]


def test_interference_needs_every_decoder_stretched_and_by_prompts():
    """Not when one decoder steps under 12.5 ms, nor when the long steps are decodes' own
    (prompts 10% of the time: a full batch of long contexts, which a prefill engine would not
    help), nor when a prefill engine exists already (the other rules' pool)."""
    calm = [stretched("e0"), stretched("e1", step_s=0.012)]
    batch_bound = [stretched("e0", prompt_share=0.1), stretched("e1", prompt_share=0.1)]
    pd = [stretched("p", role="prefill", decoding=0), stretched("d0"), stretched("d1")]
    for pool in (calm, batch_bound, pd):
        assert run(policy(), [(pool, {"whole": 4, "pd": 4})] * 10) == [], pool


def test_interference_holds_through_steps_that_swing_around_the_old_line():
    """Two "any" engines computing 3,000-token prompts beside their decodes, their smoothed
    steps swinging 14-30 ms poll to poll (prompts 60% of the time): past 12.5 ms at every
    poll, so e1 becomes the prefill engine after the window, where the old line (20 ms) was
    missed at every other poll and never held. Chat-like traffic (7-ms steps, prompts 1% of
    the time) flips nothing."""
    swings = [0.014, 0.030, 0.016, 0.026]
    frames = [([stretched("e0", decoding=40, step_s=swings[i % 4]),
                stretched("e1", decoding=25, step_s=swings[(i + 1) % 4])], {"pd": 4})
              for i in range(10)]
    assert run(policy(), frames) == [(2.0, Flip("e1", "any", "prefill", "interference"))]
    chat = [stretched("e0", step_s=0.007, prompt_share=0.01),
            stretched("e1", step_s=0.007, prompt_share=0.01)]
    assert run(policy(), [(chat, {"whole": 3, "pd": 3})] * 20) == []
