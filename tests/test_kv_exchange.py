"""prep_recv / remote_send / start_generate / commit between two engine cores in one process.

Two EngineCores on the tiny random Llama exchange KV through the real transfer backends (shm
maps the receiver's memfd pool, tcp goes through its listener thread). Every split of a request
gives exactly the greedy tokens one engine alone gives (Hugging Face's); both prefix cases of
paper §3.5 are covered; every fault leaves both engines with no held, reserved or leaked page.
The live-process version of these flows, over HTTP, is tests/test_microserving_engines.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest
import torch
from conftest import hf_greedy
from test_engine_core import greedy, random_prompts

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_exchange import slot_tensor
from engine.requests import RequestState
from kvcache.integrity import IntegrityError
from microserve.backend import MicroservingError, RequestRejected
from microserve.messages import CommitResponse, FinishReason, RemoteSendResponse
from kvcache.transfer.auth import kv_digest, sign, transfer_key

N_NEW = 12
KEY = transfer_key("test-engine-key")
PAGE = 4


def make_core(model_dir, kind, **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("num_pages", 128)
    return EngineCore(EngineConfig(model=model_dir, kv_transfer=kind, **kw), transfer_key=KEY)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def pair(request, tiny_model_dir):
    p = make_core(tiny_model_dir, request.param)
    d = make_core(tiny_model_dir, request.param)
    yield p, d
    p.close()
    d.close()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([45, 30, 61, 23], seed=7)


@pytest.fixture(scope="module")
def ref(tiny_model_dir, prompts):
    return hf_greedy(tiny_model_dir, prompts, N_NEW)


def send(p: EngineCore, rid, prompt, begin, end, kv_addr, timeout_s=30.0, sampling=None):
    """remote_send on P, stepping P until the call is answered (as its core loop would);
    with `sampling` (end = len(prompt)) it also samples the first output token."""
    p.remote_send(rid, prompt, begin, end, kv_addr, sampling)
    return answered(p, rid, timeout_s)


def answered(p: EngineCore, rid, timeout_s=30.0):
    """Step P until its remote_send `rid` is answered; the answer (an error is raised)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.has_work():
            p.step()
        for got_rid, outcome in p.poll():
            assert got_rid == rid
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        time.sleep(0.001)
    raise AssertionError("remote_send did not complete")


def generate(core: EngineCore, rid, prompt, begin=0):
    core.add_request(rid, prompt, greedy(N_NEW), begin)
    tokens, cached = [], None
    while core.has_work():
        for out in core.step():
            assert out.request_id == rid
            tokens += out.token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def assert_clean(*cores):
    for core in cores:
        core.check_integrity()
        assert core.kv.stats().used_pages == 0, "pages still held"
        assert len(core.requests) == 0, "requests still in the table"


def reset(*cores):
    """Forget cached prefixes so each test starts from an empty cache."""
    for core in cores:
        core.kv.cache.evict(core.kv.cache.num_evictable())


def test_slot_tensor_expands_run_length_ranges_to_every_slot():
    ranges = [(48, 5), (16, 16), (7, 1), (100, 3)]
    want = [s for start, n in ranges for s in range(start, start + n)]
    got = slot_tensor(ranges)
    assert got.dtype == torch.long and got.tolist() == want
    assert slot_tensor([]).tolist() == []
    assert slot_tensor([(3, 1)]).tolist() == [3]


def test_pd_no_cache(pair, prompts, ref):
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    r = d.exchange.prep_recv("a", prompt, -1, None)
    assert r.matched == 0 and r.kv_addr.begin == 0
    assert r.kv_addr.end == len(prompt) - 1
    out = send(p, "a", prompt, 0, -1, r.kv_addr)
    assert out == RemoteSendResponse(sent=len(prompt) - 1, computed=len(prompt) - 1, reused=0)
    tokens, cached = generate(d, "a", prompt, begin=len(prompt) - 1)
    assert tokens == ref[0]
    assert cached == len(prompt) - 1  # only the last prompt token was computed on D
    assert_clean(p, d)


def test_a_prefill_engine_takes_prompt_only_steps_of_its_larger_budget(tiny_model_dir, prompts,
                                                                        ref):
    """P never decodes, so every one of its steps has the prompt-only budget (32 here, 8 with
    decodes): 60 tokens sent in steps of 32 and 28, and D's tokens are Hugging Face's."""
    p = make_core(tiny_model_dir, "shm", max_num_batched_tokens=8, max_prefill_step_tokens=32)
    d = make_core(tiny_model_dir, "shm")
    try:
        schedule, steps = p.scheduler.schedule, []

        def recording():
            out = schedule()
            steps.append([e.num_new_tokens for e in out.scheduled])
            return out

        p.scheduler.schedule = recording
        prompt = prompts[2]  # 61 tokens
        r = d.exchange.prep_recv("a", prompt, -1, None)
        out = send(p, "a", prompt, 0, -1, r.kv_addr)
        assert out == RemoteSendResponse(sent=60, computed=60, reused=0)
        assert [s for s in steps if s] == [[32], [28]]
        assert generate(d, "a", prompt, begin=60) == (ref[2], 60)
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_pd_prefix_on_d_sends_only_the_rest(pair, prompts, ref):
    """Case 2 of §3.5: D holds a prefix P does not; P computes from 0 but sends [matched, end)."""
    p, d = pair
    reset(p, d)
    prompt = prompts[1]
    generate(d, "warm", prompt[:20] + [5, 6, 7])  # D caches prompt[:20] (five pages)
    r = d.exchange.prep_recv("b", prompt, -1, None)
    assert r.matched == 20
    out = send(p, "b", prompt, r.matched, -1, r.kv_addr)
    assert out == RemoteSendResponse(sent=len(prompt) - 1 - 20, computed=len(prompt) - 1,
                                     reused=0)
    tokens, _ = generate(d, "b", prompt, begin=len(prompt) - 1)
    assert tokens == ref[1]
    assert_clean(p, d)


def test_pd_longer_prefix_on_p_is_copied(pair, prompts, ref):
    """Case 1 of §3.5: P holds more than D; its cached pages are copied, the rest computed."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    generate(p, "warm", prompt[:40] + [9])  # P caches prompt[:40]
    generate(d, "warm", prompt[:8] + [9])  # D caches prompt[:8]
    r = d.exchange.prep_recv("c", prompt, -1, None)
    assert r.matched == 8
    out = send(p, "c", prompt, 8, -1, r.kv_addr)
    assert out == RemoteSendResponse(sent=len(prompt) - 1 - 8, computed=len(prompt) - 1 - 40,
                                     reused=32)
    tokens, _ = generate(d, "c", prompt, begin=len(prompt) - 1)
    assert tokens == ref[2]
    assert_clean(p, d)


def test_pd_skips_p_when_d_holds_the_prefix(pair, prompts, ref):
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    generate(d, "warm", prompt[:-1] + [3])
    r = d.exchange.prep_recv("s", prompt, -1, None)
    assert r.matched == (len(prompt) - 1) // PAGE * PAGE
    tokens, cached = generate(d, "s", prompt, begin=r.matched)
    assert tokens == ref[0] and cached == r.matched
    assert_clean(p, d)


# ---- the first token sampled by the sender, handed over with the KV ------------------------------


def generate_from(core: EngineCore, rid, prompt, first_token, params):
    """start_generate with the handed-over first token: its output comes from add_request
    itself, before any step; then the rest as `generate` steps them."""
    first = core.add_request(rid, prompt, params, len(prompt), first_token)
    assert first.request_id == rid and first.token_ids == [first_token]
    outs = [first]
    while core.has_work():
        outs += core.step()
    assert all(o.request_id == rid for o in outs)
    assert [o.finish_reason is not None for o in outs] == [False] * (len(outs) - 1) + [True]
    return [t for o in outs for t in o.token_ids], outs


@pytest.mark.parametrize("p_cached", [0, 40, 44])
def test_p_samples_the_first_token_and_d_decodes_on(pair, prompts, ref, p_cached):
    """P computes the whole prompt (at least its last token, even when it holds all of it:
    its logits are sampled), sends all its KV and answers with the first token; D emits it at
    once and decodes on, computing no prompt token: the tokens are one engine's greedy ones."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]  # 61 tokens
    n = len(prompt)
    if p_cached:
        generate(p, "warm", prompt[:p_cached] + [9])
    r = d.exchange.prep_recv("f", prompt, n, None)
    assert r.matched == 0 and r.kv_addr.end == n
    out = send(p, "f", prompt, 0, n, r.kv_addr, sampling=greedy(N_NEW))
    reused = min(p_cached, (n - 1) // PAGE * PAGE)
    assert out == RemoteSendResponse(sent=n, computed=n - reused, reused=reused,
                                     first_token=ref[2][0])
    steps = d.stats()
    tokens, outs = generate_from(d, "f", prompt, out.first_token, greedy(N_NEW))
    assert tokens == ref[2]
    assert outs[0].num_cached_tokens == n  # D computed no prompt token
    assert d.stats().prompt_tokens - steps.prompt_tokens == n
    assert_clean(p, d)


def test_a_handed_over_first_token_can_end_the_request(pair, prompts, ref):
    """max_tokens 1, or a stop token: the first token is the whole answer, out at once, and
    the received KV is left cached on D, nothing held."""
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    n = len(prompt)
    for rid, params, reason in [("one", greedy(1), FinishReason.LENGTH),
                                ("stop", greedy(N_NEW, stop_token_ids=(ref[0][0],)),
                                 FinishReason.STOP)]:
        r = d.exchange.prep_recv(rid, prompt, n, None)
        out = send(p, rid, prompt, r.matched, n, r.kv_addr, sampling=params)
        assert out.first_token == ref[0][0]
        first = d.add_request(rid, prompt, params, n, out.first_token)
        assert first.token_ids == [ref[0][0]] and first.finish_reason == reason
        assert not d.has_work()
        assert_clean(p, d)
    assert d.kv.cache.match(prompt).matched_len == n // PAGE * PAGE  # cached for next time


def test_a_first_token_the_caller_delivered_is_not_emitted_again(pair, prompts, ref):
    """first_token_delivered (the router gave P's token to its client already): D's outputs
    begin with the second token, exactly one engine's greedy ones after the first; the first
    still counts (the usage, max_tokens). A request it ends answers one final output of no
    tokens; without a first_token the flag is refused."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    n = len(prompt)
    r = d.exchange.prep_recv("dl", prompt, n, None)
    out = send(p, "dl", prompt, 0, n, r.kv_addr, sampling=greedy(N_NEW))
    assert out.first_token == ref[2][0]
    assert d.add_request("dl", prompt, greedy(N_NEW), n, out.first_token,
                         first_token_delivered=True) is None
    outs = []
    while d.has_work():
        outs += d.step()
    assert [t for o in outs for t in o.token_ids] == ref[2][1:]  # not the first again
    assert [o.finish_reason for o in outs] == [None] * (N_NEW - 2) + [FinishReason.LENGTH]
    assert d.requests.get("dl") is None
    for rid, params, reason in [("dl1", greedy(1), FinishReason.LENGTH),
                                ("dls", greedy(N_NEW, stop_token_ids=(ref[2][0],)),
                                 FinishReason.STOP)]:
        r = d.exchange.prep_recv(rid, prompt, n, None)
        send(p, rid, prompt, r.matched, n, r.kv_addr, sampling=params)
        last = d.add_request(rid, prompt, params, n, ref[2][0], first_token_delivered=True)
        assert (last.token_ids, last.finish_reason, last.num_cached_tokens) == ([], reason, n)
        assert not d.has_work()
    with pytest.raises(MicroservingError, match="first_token_delivered needs the first_token"
                       ) as e:
        d.add_request("dl0", prompt, greedy(), 0, first_token_delivered=True)
    assert (e.value.status, e.value.param) == (400, "first_token_delivered")
    assert_clean(p, d)


def test_handing_over_the_first_token_refuses_what_it_cannot_do(pair, prompts):
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    n = len(prompt)
    r = d.exchange.prep_recv("h", prompt, n, None)
    with pytest.raises(MicroservingError, match="end must be the prompt length") as e:
        p.remote_send("h", prompt, 0, n - 1, r.kv_addr, greedy())
    assert e.value.param == "end"
    for bad in (greedy(logprobs=0), greedy(grammar='{"grammars": []}')):
        with pytest.raises(MicroservingError, match="grammar or with logprobs") as e:
            p.remote_send("h", prompt, 0, n, r.kv_addr, bad)
        assert e.value.param == "sampling"
    for bad in (greedy(repetition_penalty=1.2), greedy(frequency_penalty=0.1),
                greedy(presence_penalty=-0.1), greedy(logit_bias=((5, 1.0),)),
                greedy(min_tokens=1)):
        with pytest.raises(MicroservingError, match="a remote_send samples no token with "
                           "logit_bias, min_tokens or penalties") as e:
            p.remote_send("h", prompt, 0, n, r.kv_addr, bad)
        assert (e.value.status, e.value.param) == (400, "sampling")
    with pytest.raises(RequestRejected, match="max_tokens"):  # the request's own bounds
        p.remote_send("h", prompt, 0, n, r.kv_addr, greedy(10**6))
    assert_clean(p)
    with pytest.raises(MicroservingError, match="begin must be the prompt length") as e:
        d.add_request("h", prompt, greedy(), n - 1, 5)
    assert e.value.param == "begin"
    with pytest.raises(MicroservingError, match="out of range") as e:
        d.add_request("h", prompt, greedy(), n, 10**9)
    assert e.value.param == "first_token"
    with pytest.raises(MicroservingError, match="no logprobs") as e:
        d.add_request("h", prompt, greedy(logprobs=1), n, 5)
    for bad in (greedy(repetition_penalty=1.2), greedy(logit_bias=((5, 1.0),)),
                greedy(min_tokens=2)):
        with pytest.raises(MicroservingError, match="no logit_bias, min_tokens or penalties "
                           "applied") as e:
            d.add_request("h", prompt, bad, n, 5)
        assert (e.value.status, e.value.param) == (400, "first_token")
    d.abort_request("h")
    # Without the whole prompt received there is nothing to decode from.
    r = d.exchange.prep_recv("h", prompt, n - 1, None)
    with pytest.raises(MicroservingError, match="beyond the") as e:
        d.add_request("h", prompt, greedy(), n, 5)
    d.abort_request("h")
    with pytest.raises(MicroservingError, match="no prep_recv"):
        d.add_request("h2", prompt, greedy(), n, 5)
    with pytest.raises(MicroservingError, match="no prep_recv"):  # nothing kept for it
        d.add_request("h3", prompt, greedy(repetition_penalty=1.2), n - 1)
    assert len(d.penalties) == 0
    assert_clean(p, d)


def test_a_sampling_send_aborted_or_failed_before_its_token_leaves_nothing(pair, prompts):
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    n = len(prompt)
    r = d.exchange.prep_recv("ab", prompt, n, None)
    p.remote_send("ab", prompt, 0, n, r.kv_addr, greedy())
    assert p.abort_request("ab") is None
    (rid, outcome), = p.poll()
    assert rid == "ab" and isinstance(outcome, MicroservingError) and outcome.status == 409
    d.abort_request("ab")
    # A step that raises after the send computed, before its token is read: the send fails.
    r = d.exchange.prep_recv("lost", prompt, n, None)
    p.remote_send("lost", prompt, 0, n, r.kv_addr, greedy())
    while p.requests.get("lost").state is RequestState.SENDING:
        p._launch()  # launched, never resolved: the token stays unknown
    assert p.exchange.unsampled() == ["lost"]
    p.fail_requests("the step failed")
    answers = []
    deadline = time.monotonic() + 10
    while not answers and time.monotonic() < deadline:
        answers = p.poll()
    (rid, outcome), = answers
    assert rid == "lost" and outcome.status == 500
    d.abort_request("lost")
    assert_clean(p, d)


def test_balanced_pd(pair, prompts, ref):
    """The last 20% of the prompt is prefilled on D (paper §3.3)."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    split = int(len(prompt) * 0.8)
    r = d.exchange.prep_recv("bal", prompt, split, None)
    out = send(p, "bal", prompt, 0, split, r.kv_addr)
    assert out.sent == split
    tokens, cached = generate(d, "bal", prompt, begin=split)
    assert tokens == ref[2] and cached == split
    assert_clean(p, d)


def test_context_migration(pair, tiny_model_dir):
    """prep_recv + remote_send + commit moves a context; a later request on the receiver finds
    it cached, computes only the rest, and gives the tokens the sender would."""
    p, d = pair
    reset(p, d)
    context, question = random_prompts([70, 9], seed=3)
    want, _ = generate(p, "on-p", context + question)
    r = d.exchange.prep_recv("mig", context, len(context), None)
    send(p, "mig", context, 0, len(context), r.kv_addr)
    assert d.exchange.commit("mig", pin=False) == CommitResponse(cached=68, pinned=False)
    tokens, cached = generate(d, "after", context + question)
    assert cached == 68 and tokens == want
    assert_clean(p, d)


def test_commit_pins(pair):
    p, d = pair
    reset(p, d)
    (context,) = random_prompts([24], seed=4)
    r = d.exchange.prep_recv("pin", context, len(context), None)
    send(p, "pin", context, 0, len(context), r.kv_addr)
    assert d.exchange.commit("pin", pin=True) == CommitResponse(cached=24, pinned=True)
    assert d.kv.stats().pinned_pages == 6
    assert d.kv.cache.num_evictable() == 0
    assert d.kv.unpin(context) == 24
    assert_clean(p, d)


# ---- bad input and faults ----------------------------------------------------------------------


def test_bad_indices_and_addresses(pair, prompts):
    p, d = pair
    prompt = prompts[3]  # 23 tokens
    with pytest.raises(MicroservingError, match="end 24 out of range for a 23-token prompt"):
        d.exchange.prep_recv("x", prompt, 24, None)
    r = d.exchange.prep_recv("x", prompt, -1, None)
    addr = r.kv_addr
    with pytest.raises(MicroservingError, match="begin -30 out of range"):
        p.remote_send("x", prompt, -30, -1, addr)
    with pytest.raises(MicroservingError, match="begin 10 is after end 5"):
        p.remote_send("x", prompt, 10, 5, addr)
    with pytest.raises(MicroservingError, match=re.escape(
            "kv_addr reserves positions [0, 22) but the send covers [10, 22) (begin 10, end "
            "22)")) as e:
        p.remote_send("x", prompt, 10, -1, addr)
    assert (e.value.status, e.value.param) == (400, "kv_addr")
    with pytest.raises(MicroservingError, match="already in use") as e:
        d.exchange.prep_recv("x", prompt, -1, None)
    assert e.value.status == 409
    too_long = [5] * (128 * PAGE + 2)  # more than the whole pool: never fits, so not a 503
    with pytest.raises(MicroservingError, match=rf"end {128 * PAGE + 1}: receiving "
                       rf"{128 * PAGE + 1} tokens needs 129 KV pages, but this engine's pool "
                       r"has 128 pages") as e:
        d.exchange.prep_recv("big", too_long, -1, None)
    assert e.value.status == 400
    with pytest.raises(RequestRejected, match="prompt token id 99999 out of range"):
        d.exchange.prep_recv("y", [1, 99999], -1, None)
    with pytest.raises(MicroservingError, match="no prep_recv reservation") as e:
        d.exchange.commit("nope", False)
    assert e.value.status == 404
    with pytest.raises(MicroservingError, match="begin 23 leaves no prompt token"):
        d.add_request("x", prompt, greedy(), begin=23)
    with pytest.raises(MicroservingError, match="begin 22 beyond the 0 tokens of this prompt"):
        d.add_request("z", prompt, greedy(), begin=22)
    with pytest.raises(MicroservingError, match="prompt differs at position 0"):
        d.add_request("x", [prompt[0] + 1] + prompt[1:], greedy(), begin=5)
    assert d.abort_request("x") is None  # the reservation is dropped, no token stream
    assert_clean(p, d)


def test_layout_mismatch_names_both_layouts(tiny_model_dir, pair, prompts):
    p, _ = pair
    other = make_core(tiny_model_dir, "shm", page_size=8, num_pages=32)
    try:
        r = other.exchange.prep_recv("m", prompts[0], -1, None)
        with pytest.raises(MicroservingError, match="KV layout mismatch in page_size") as e:
            p.remote_send("m", prompts[0], 0, -1, r.kv_addr)
        assert "'page_size': 4" in str(e.value) and "'page_size': 8" in str(e.value)
        other.abort_request("m")
        assert_clean(p, other)
    finally:
        other.close()


def test_abort_during_send_and_after_prep_recv(pair, prompts):
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    r = d.exchange.prep_recv("ab", prompt, -1, None)
    p.remote_send("ab", prompt, 0, -1, r.kv_addr)
    assert p.abort_request("ab") is None
    (rid, outcome), = p.poll()
    assert rid == "ab" and isinstance(outcome, MicroservingError) and outcome.status == 409
    assert d.abort_request("ab") is None
    assert_clean(p, d)


def test_lease_expiry_frees_and_counts(pair, prompts):
    p, d = pair
    before = d.stats().kv_leases_expired
    d.exchange.prep_recv("lease", prompts[0], -1, 0.05)
    assert d.exchange.expire_leases(time.monotonic()) == 0
    assert d.exchange.expire_leases(time.monotonic() + 0.1) == 1
    assert d.stats().kv_leases_expired == before + 1
    assert_clean(p, d)


def test_send_into_a_closed_window_fails(pair, prompts):
    """The receiver aborted (or its lease ran out) before the sender wrote: the one-sided
    write is refused, remote_send answers 502, and the sender holds nothing."""
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    r = d.exchange.prep_recv("late", prompt, -1, None)
    d.abort_request("late")
    with pytest.raises(MicroservingError, match="KV transfer failed") as e:
        send(p, "late", prompt, 0, -1, r.kv_addr)
    assert e.value.status == 502
    assert_clean(p, d)


# ---- an abort in any state leaves nothing behind ------------------------------------------------


@pytest.fixture(scope="module")
def bare(tiny_model_dir):
    """P and D without a prefix cache, so a page let go is a free page. P computes 16 tokens a
    step (a send is seen mid-compute); D has 24 pages."""
    p = make_core(tiny_model_dir, "shm", enable_prefix_cache=False, max_num_batched_tokens=16)
    d = make_core(tiny_model_dir, "shm", enable_prefix_cache=False, num_pages=24)
    yield p, d
    p.close()
    d.close()


def into_state(p: EngineCore, d: EngineCore, prompt: list[int], hog: list[int],
               state: RequestState) -> EngineCore:
    """Put request "x" in `state` on P (a send) or D; returns that engine. RECV_WAITING: "hog"
    holds 15 of D's 24 pages; a send: D holds a reservation for "x"."""
    if state is RequestState.RECV_WAITING:
        assert d.exchange.prep_recv("hog", hog, -1, None).matched == 0
        assert d.exchange.prep_recv("x", prompt, -1, None) is None  # 11 more pages: waits
    elif state is RequestState.RESERVED:
        d.exchange.prep_recv("x", prompt, -1, None)
    elif state is RequestState.GENERATING:
        d.add_request("x", prompt, greedy())
        d.step()
        assert d.stats().kv_pages_used == 12 and d.stats().running == 1
    else:  # PARKED: a send not told where to send yet
        addr = None if state is RequestState.PARKED else d.exchange.prep_recv(
            "x", prompt, -1, None).kv_addr
        p.remote_send("x", prompt, 0, -1, addr)
        p.step()
        assert p.stats().kv_pages_used == 4 and p.stats().running == 1  # 16 of 44 tokens
        while state is not RequestState.SENDING and p.requests.get("x").state is not state:
            p.step()
    core = p if state in SENDER_STATES else d
    assert core.requests.get("x").state is state
    return core


SENDER_STATES = (RequestState.SENDING, RequestState.FLUSHING, RequestState.PARKED)


def abort_the_rest(p: EngineCore, d: EngineCore) -> None:
    """Abort what into_state left besides "x"; then both engines hold nothing at all."""
    for rid in ("hog", "x"):
        d.abort_request(rid)
    for engine in (p, d):
        engine.poll()
        engine.check_integrity()
        stats = engine.stats()
        assert len(engine.requests) == 0
        assert (stats.kv_pages_free, stats.kv_pages_used, stats.kv_pages_cached,
                stats.running, stats.waiting) == (stats.kv_pages_total, 0, 0, 0, 0)
        assert (stats.kv_reservations, stats.kv_send_jobs, stats.kv_recv_waiting) == (0, 0, 0)


@pytest.mark.parametrize("state", RequestState)
def test_an_abort_in_any_state_leaves_no_request_and_every_page_free(bare, prompts, state):
    p, d = bare
    core = into_state(p, d, prompts[0], prompts[2], state)  # prompts[0]: 45 tokens, 11 pages
    out = core.abort_request("x")
    assert "x" not in core.requests
    stats = core.stats()
    used = 15 if state is RequestState.RECV_WAITING else 0  # "hog"'s
    assert (stats.kv_pages_used, stats.running, stats.waiting) == (used, 0, 0)
    assert (stats.kv_send_jobs, stats.kv_recv_waiting) == (0, 0)
    if state is RequestState.GENERATING:
        assert out.finish_reason == FinishReason.ABORT and out.token_ids == []
    else:
        assert out is None
    if state is RequestState.RECV_WAITING or state in SENDER_STATES:
        (rid, answer), = core.poll()  # the call waiting for its answer gets a 409
        assert rid == "x" and answer.status == 409
    abort_the_rest(p, d)


@pytest.mark.parametrize("state", RequestState)
def test_an_id_in_any_state_is_in_use_for_every_call(bare, prompts, state):
    """One lookup answers them all; start_generate may only take over a reservation."""
    p, d = bare
    prompt = prompts[0]
    core = into_state(p, d, prompt, prompts[2], state)
    addr = p.exchange.prep_recv("addr", prompt, -1, None).kv_addr  # a valid one to send to
    calls = [lambda: core.exchange.prep_recv("x", prompt, -1, None),
             lambda: core.remote_send("x", prompt, 0, -1, addr)]
    if state is not RequestState.RESERVED:
        calls.append(lambda: core.add_request("x", prompt, greedy()))
    for call in calls:
        with pytest.raises(MicroservingError, match="request_id 'x' is already in use") as e:
            call()
        assert e.value.status == 409
    assert core.requests.get("x").state is state
    p.abort_request("addr")
    core.abort_request("x")
    abort_the_rest(p, d)


def test_check_integrity_catches_pages_held_by_a_request_gone_from_the_table(bare, prompts):
    _, d = bare
    d.exchange.prep_recv("x", prompts[0], -1, None)
    entry = d.requests.finish("x")  # behind the exchange's back: its pages stay held
    with pytest.raises(IntegrityError, match=r"pages held by \{'x'\}"):
        d.check_integrity()
    d.requests.reserve("x", entry.reservation)
    d.abort_request("x")
    assert_clean(d)


# ---- what a caller cannot make an engine do ----------------------------------------------------


def test_leases_are_finite_and_bounded(pair, prompts):
    p, d = pair
    for lease_s in (math.inf, 1e308, 601.0, 0.0, -1.0):
        with pytest.raises(MicroservingError) as e:
            d.exchange.prep_recv("lease", prompts[0], -1, lease_s)
        assert (e.value.status, e.value.param) == (400, "lease_s")
        assert str(e.value) == (f"lease_s {lease_s} must be in (0, 600.0] (this engine's "
                                "--kv-lease-max-s)")
    d.exchange.prep_recv("lease", prompts[0], -1, 600.0)  # the maximum is fine
    assert d.requests.get("lease").reservation.deadline <= time.monotonic() + 600.0
    d.exchange.abort("lease")
    assert_clean(p, d)


def test_remote_send_refuses_a_transfer_descriptor_not_signed_by_the_deployment(pair, prompts):
    p, d = pair
    prompt = prompts[1]
    r = d.exchange.prep_recv("forged", prompt, -1, None)
    addr = r.kv_addr
    real = addr.transfer
    stranger = transfer_key("another deployment")
    peers = dict(p.exchange.sender._peers)  # those of earlier tests
    unsigned = {k: v for k, v in real.items() if k != "mac"}
    for transfer in (unsigned, {**real, "pid": 1}, {**real, "port": 1},
                     sign(unsigned, stranger), {"kind": "tcp", "host": "10.0.0.1", "port": 22}):
        with pytest.raises(MicroservingError) as e:
            p.remote_send("forged", prompt, 0, -1,
                                   dataclasses.replace(addr, transfer=transfer))
        assert (e.value.status, e.value.param) == (400, "kv_addr.transfer")
        assert str(e.value).startswith("refusing to send: the transfer descriptor is not signed")
    assert p.stats().kv_send_jobs == 0 and p.exchange.sender._peers == peers  # nothing opened
    d.exchange.abort("forged")
    assert_clean(p, d)


def refused_send(p: EngineCore, d: EngineCore, rid, prompt, kv_addr) -> MicroservingError:
    """remote_send of `prompt` into `kv_addr`, refused before anything moved: P opened,
    computed and holds nothing, and D's pool is byte-for-byte what it was."""
    pool = d.transfer.kv.clone()
    peers = dict(p.exchange.sender._peers)
    with pytest.raises(MicroservingError) as e:
        p.remote_send(rid, prompt, kv_addr.begin, kv_addr.end, kv_addr)
    assert rid not in p.requests and p.stats().kv_pages_used == 0
    assert p.exchange.sender._jobs == {} and p.exchange.sender._peers == peers
    assert torch.equal(d.transfer.kv, pool)
    return e.value


def test_a_kv_addr_moved_to_other_slots_is_refused_before_any_byte_moves(pair, prompts, ref):
    """Issue 39: a genuine kv_addr whose ranges were edited to slots 0..43, or to the slots D
    reserved for another request, or whose window was swapped, is refused with a 400 that
    names the ranges and the window: the receiver signed the slots with the window."""
    p, d = pair
    reset(p, d)
    prompt = prompts[0]  # 45 tokens: 44 slots
    victim = d.exchange.prep_recv("victim", random_prompts([45], seed=11)[0], -1, None).kv_addr
    addr = d.exchange.prep_recv("x", prompt, -1, None).kv_addr
    index = addr.window[0]
    for ranges in ([(0, 44)], victim.ranges):
        error = refused_send(p, d, "x", prompt, dataclasses.replace(addr, ranges=ranges))
        shown = [list(r) for r in ranges]
        assert (error.status, error.param) == (400, "kv_addr.ranges")
        assert str(error) == (
            f"refusing to send: kv_addr's ranges {shown} for window {index} are not what its "
            "receiver reserved (the receiver's signature over begin, end, ranges, window and "
            "digest does not verify): pass the prep_recv answer's kv_addr unchanged")
    swapped = dataclasses.replace(addr, window=victim.window)
    assert refused_send(p, d, "x", prompt, swapped).param == "kv_addr.ranges"
    unsigned = dataclasses.replace(addr, mac="")
    assert refused_send(p, d, "x", prompt, unsigned).param == "kv_addr.ranges"
    # The kv_addr as prep_recv answered it goes through, and D generates one engine's tokens.
    send(p, "x", prompt, 0, -1, addr)
    assert generate(d, "x", prompt, begin=len(prompt) - 1)[0] == ref[0]
    d.abort_request("victim")
    assert_clean(p, d)


def test_a_send_of_another_prompt_into_a_window_is_refused_before_any_byte_moves(pair, prompts):
    """Issue 39: a kv_addr reserved for prompt X, and P asked to send prompt Y's KV (the same
    length; or X with another prefix before D's match): refused at P with a 400."""
    p, d = pair
    reset(p, d)
    x = prompts[2]  # 61 tokens
    y = random_prompts([61], seed=12)[0]
    generate(d, "warm", x[:20] + [5])  # D matches x[:20]: the window holds x[20:60]
    addr = d.exchange.prep_recv("x", x, -1, None).kv_addr
    assert addr.begin == 20
    for other in (y, y[:20] + x[20:]):  # the window's tokens after another prefix: other KV
        error = refused_send(p, d, "x", other, addr)
        assert (error.status, error.param) == (400, "prompt")
        assert str(error) == (
            f"refusing to send: kv_addr's window {addr.window[0]} was reserved for another "
            "prompt (the digest of prompt[:60] differs from the one its receiver signed): its "
            "KV would be served for tokens it was not computed from")
    d.abort_request("x")
    assert_clean(p, d)


def skip_the_senders_checks(p: EngineCore, monkeypatch) -> None:
    """Make P a sender with a bug: it checks nothing of a kv_addr and seals the window with
    the digest of whatever it sent."""
    monkeypatch.setattr(p.exchange, "_check_addr",
                        lambda addr, begin, tokens: kv_digest(tokens, begin))


def test_d_refuses_kv_of_other_tokens_and_its_cache_stays_clean(pair, prompts, ref, monkeypatch):
    """Issue 39: even a sender that checks nothing cannot make D serve prompt Y's KV for
    prompt X: the window's seal is the digest of Y, so start_generate and commit fail with a
    409, the pages are freed, and X on D afterwards gives a clean engine's tokens, nothing of
    it cached."""
    p, d = pair
    reset(p, d)
    x, y = prompts[0], random_prompts([45], seed=13)[0]
    skip_the_senders_checks(p, monkeypatch)
    for rid, adopt in (("gen", lambda: d.add_request("gen", x, greedy(), len(x) - 1)),
                       ("mig", lambda: d.exchange.commit("mig", pin=False))):
        addr = d.exchange.prep_recv(rid, x, -1, None).kv_addr
        assert send(p, rid, y, 0, -1, addr).sent == 44  # the bytes did land in D's window
        with pytest.raises(MicroservingError) as e:
            adopt()
        assert (e.value.status, e.value.param, e.value.code) == (409, "request_id", "kv_refused")
        assert str(e.value) == (
            f"the KV received for positions [0, 44) of request_id {rid!r} was computed for "
            "other tokens than the prompt prep_recv reserved it for (the sender's digest "
            "differs); refused, and its pages freed")
        assert_clean(p, d)
        assert d.kv.stats().cached_pages == 0  # nothing of it entered the prefix cache
    tokens, cached = generate(d, "after", x)
    assert tokens == ref[0] and cached == 0


def test_a_tcp_receiver_drops_writes_outside_the_window_even_from_a_careless_sender(
        pair, prompts, monkeypatch):
    """tcp's receiver applies the writes itself, so it checks every write's slots against the
    window's reservation: a sender that skipped its checks and writes the slots of an edited
    kv_addr gets a 502 naming them, and D's pool is untouched. (shm and the GPU backends have
    no receiver on the data path: there the sending engine's checks above are what hold.)"""
    p, d = pair
    if d.transfer.kind != "tcp":
        pytest.skip("only a tcp receiver applies writes itself")
    reset(p, d)
    prompt = prompts[0]
    victim = d.exchange.prep_recv("victim", random_prompts([45], seed=11)[0], -1, None).kv_addr
    addr = d.exchange.prep_recv("x", prompt, -1, None).kv_addr
    skip_the_senders_checks(p, monkeypatch)
    pool = d.transfer.kv.clone()
    with pytest.raises(MicroservingError) as e:
        send(p, "x", prompt, 0, -1, dataclasses.replace(addr, ranges=victim.ranges))
    assert e.value.status == 502
    first = slot_tensor(victim.ranges)[:4].tolist()
    assert str(e.value).endswith(
        f"slots {first} are outside the 44 slots reserved for window {addr.window[0]}; the "
        "write was dropped")
    assert torch.equal(d.transfer.kv, pool)
    with pytest.raises(MicroservingError, match="no KV arrived"):  # and nothing was sealed
        d.exchange.commit("x", pin=False)
    d.abort_request("victim")
    assert_clean(p, d)


def test_kv_that_never_arrived_is_not_adopted(pair, prompts, ref):
    """start_generate or commit from a reservation no remote_send completed (none came, or it
    still runs): refused with a 409 and the pages freed, instead of serving the pool's stale
    bytes as the prompt's KV."""
    p, d = pair
    reset(p, d)
    x = prompts[0]
    d.exchange.prep_recv("none", x, -1, None)
    with pytest.raises(MicroservingError) as e:
        d.add_request("none", x, greedy(), len(x) - 1)
    assert (e.value.status, e.value.code) == (409, "kv_refused")
    assert str(e.value) == (
        "no KV arrived for positions [0, 44) of request_id 'none': no remote_send completed "
        "into the window prep_recv reserved for them; refused, and its pages freed")
    d.exchange.prep_recv("none", x, -1, None)
    with pytest.raises(MicroservingError, match="no KV arrived for positions"):
        d.exchange.commit("none", pin=True)
    assert_clean(p, d)
    assert d.kv.stats().cached_pages == 0
    d.exchange.prep_recv("none", x, -1, None)  # nothing received is used: nothing to refuse
    assert generate(d, "none", x)[0] == ref[0]
    assert_clean(p, d)


def test_an_engine_without_a_key_neither_receives_nor_sends(tiny_model_dir, prompts):
    lone = EngineCore(EngineConfig(model=tiny_model_dir, page_size=PAGE, num_pages=64))
    assert lone.info.kv_transfer == "none"  # auto: no key, no transfer
    with pytest.raises(MicroservingError, match="this engine cannot receive KV") as e:
        lone.exchange.prep_recv("x", prompts[0], -1, None)
    assert e.value.status == 400
    keyed = make_core(tiny_model_dir, "shm")
    addr = keyed.exchange.prep_recv("x", prompts[0], -1, None).kv_addr
    with pytest.raises(MicroservingError, match="no engine key .--api-key. to verify"):
        lone.remote_send("x", prompts[0], 0, -1, addr)
    keyed.exchange.abort("x")
    assert_clean(lone, keyed)
    lone.close()
    keyed.close()
    with pytest.raises(ValueError, match="--kv-transfer tcp needs an engine key"):
        EngineCore(EngineConfig(model=tiny_model_dir, kv_transfer="tcp", num_pages=8))


# ---- under pressure: prep_recv waits its turn, leases follow the sender ------------------------


@pytest.fixture(scope="module")
def small_d(tiny_model_dir):
    """A receiver with 24 pages (96 tokens): a few prompts fill it."""
    d = make_core(tiny_model_dir, "shm", num_pages=24)
    yield d
    d.close()


def answers(core: EngineCore) -> dict:
    """The deferred answers poll() gives now, by request id."""
    core.exchange.admit_waiting(time.monotonic())
    return dict(core.poll())


def test_prep_recv_waits_in_order_for_pages_and_the_waited_reservation_works(
        pair, small_d, prompts, ref):
    p, d = pair[0], small_d
    reset(p, d)
    assert d.exchange.prep_recv("first", prompts[2], -1, None).matched == 0  # 15 of 24 pages
    assert d.kv.pool.num_free == 9
    assert d.exchange.prep_recv("big", prompts[0], -1, None) is None  # 11 pages: waits
    assert d.exchange.prep_recv("small", prompts[3], -1, None) is None  # 6 fit, but FIFO
    assert d.stats().kv_recv_waiting == 2 and d.kv.pool.num_free == 9
    assert answers(d) == {}
    with pytest.raises(MicroservingError, match="'big' is already in use"):
        d.exchange.prep_recv("big", prompts[0], -1, None)
    d.abort_request("first")  # its pages come back: both waiting calls fit, in order
    granted = answers(d)
    assert list(granted) == ["big", "small"]
    assert d.kv.pool.num_free == 24 - 11 - 6 and d.stats().kv_recv_waiting == 0
    big = granted["big"]
    assert big.matched == 0 and big.kv_addr.end == len(prompts[0]) - 1
    out = send(p, "big", prompts[0], 0, -1, big.kv_addr)
    assert out.sent == len(prompts[0]) - 1
    tokens, _ = generate(d, "big", prompts[0], begin=len(prompts[0]) - 1)
    assert tokens == ref[0]
    d.abort_request("small")
    assert_clean(p, d)
    assert d.stats().kv_recv_waiting == 0


def test_a_waiting_prep_recv_gives_up_after_wait_s_or_when_aborted(pair, small_d, prompts):
    d = small_d
    reset(d)
    d.exchange.prep_recv("hog", prompts[2], -1, None)
    before = d.stats().kv_recv_wait_timeouts
    with pytest.raises(MicroservingError, match=r"no KV pages free to receive 44 tokens \(11 "
                       r"pages; 9 free\)") as e:
        d.exchange.prep_recv("now", prompts[0], -1, None, wait_s=0)  # 0: the old 503 at once
    assert e.value.status == 503
    assert d.exchange.prep_recv("patient", prompts[0], -1, None, wait_s=0.05) is None
    assert d.exchange.prep_recv("gone", prompts[0], -1, None) is None
    assert d.exchange.next_deadline() <= time.monotonic() + 0.05
    time.sleep(0.06)
    (rid, error), = answers(d).items()
    assert rid == "patient" and (error.status, error.code) == (503, "kv_wait_timeout")
    assert str(error) == ("waited 0.05 s for KV pages to receive 44 tokens (11 pages; 9 free, "
                          "1 more calls waiting); retry later")
    assert d.stats().kv_recv_wait_timeouts == before + 1
    assert d.abort_request("gone") is None
    (rid, error), = answers(d).items()
    assert rid == "gone" and error.status == 409
    for wait_s in (math.inf, -1.0, 3601.0):
        with pytest.raises(MicroservingError, match=rf"wait_s {wait_s} must be in \[0, 3600.0\]"):
            d.exchange.prep_recv("w", prompts[0], -1, None, wait_s=wait_s)
    d.abort_request("hog")
    assert_clean(d)


def test_prep_recv_leaves_a_page_for_each_running_sequence(pair, small_d, prompts):
    """Reserving must not make D's next decode step preempt: one free page per running
    sequence stays free (or evictable)."""
    d = small_d
    reset(d)
    d.add_request("run", prompts[3], greedy(4))  # 23 tokens + 4: 7 pages once running
    d.step()
    assert len(d.scheduler.running) == 1 and d.kv.pool.num_free == 24 - 6
    filler = [7] * (4 * 12 + 1)  # 12 pages: leaves 6 free
    assert d.exchange.prep_recv("fill", filler, -1, None).matched == 0
    exact = [9] * (4 * 6 + 1)  # 6 pages would fit, but leave no page for "run"
    assert d.exchange.prep_recv("exact", exact, -1, None) is None
    while d.has_work():
        d.step()  # "run" finishes: its pages are free (or cached)
    assert list(answers(d)) == ["exact"]
    for rid in ("fill", "exact"):
        d.abort_request(rid)
    assert_clean(d)


def wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_sender_renews_the_lease_while_it_holds_the_job(pair, prompts):
    """Queued on P for longer than D's lease, the reservation lives; once P drops the job,
    it expires one lease after the last renewal."""
    p, d = pair
    reset(p, d)
    prompt = prompts[1]
    r = d.exchange.prep_recv("renew", prompt, -1, 0.5)
    res = d.requests.get("renew").reservation
    granted = res.deadline - 0.5
    assert d.transfer.renewed_at(res.window) is None
    p.remote_send("renew", prompt, 0, -1, r.kv_addr)  # queued: P is not stepped
    p.exchange.sender.renew_all()
    wait_for(lambda: (d.transfer.renewed_at(res.window) or 0) > granted)  # tcp: a frame
    renewed = d.transfer.renewed_at(res.window)
    assert d.exchange.expire_leases(granted + 0.5) == 0  # would have expired without renewals
    assert d.requests.get("renew").reservation.deadline >= renewed + 0.5
    assert p.abort_request("renew") is None  # P lets go: no more renewals
    last = d.transfer.renewed_at(res.window)
    time.sleep(0.3)  # more than a renewal interval: nobody renews now
    assert d.transfer.renewed_at(res.window) == last
    assert d.exchange.expire_leases(last + 0.49) == 0
    assert d.exchange.expire_leases(last + 0.5) == 1
    p.poll()
    assert_clean(p, d)


def test_a_closed_window_stops_the_sender_before_it_computes(tiny_model_dir, prompts):
    """shm: the receiver aborted while the send waited in P's queue; P's next renewal sees the
    closed window and drops the job without computing it."""
    p = make_core(tiny_model_dir, "shm")
    d = make_core(tiny_model_dir, "shm")
    try:
        prompt = prompts[0]
        r = d.exchange.prep_recv("dropped", prompt, -1, None)
        p.remote_send("dropped", prompt, 0, -1, r.kv_addr)
        d.abort_request("dropped")
        p.exchange.sender.renew_all()
        (rid, error), = p.poll()
        assert rid == "dropped" and error.status == 502
        assert "closed window" in str(error)
        assert not p.has_work()  # never computed
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_a_smaller_call_behind_a_head_that_leaves_is_tried_at_once(pair, small_d, prompts):
    d = small_d
    reset(d)
    d.exchange.prep_recv("hog", prompts[2], -1, None)  # 15 of 24 pages
    assert d.exchange.prep_recv("big", prompts[0], -1, None) is None  # 11: waits
    assert d.exchange.prep_recv("small", prompts[3], -1, None) is None  # 6: waits behind it
    assert answers(d) == {}
    d.abort_request("big")  # the head goes: "small" fits in what is free now
    got = answers(d)
    assert got["big"].status == 409 and got["small"].matched == 0
    for rid in ("hog", "small"):
        d.abort_request(rid)
    assert_clean(d)


@pytest.mark.parametrize(("device", "has_key", "kind"), [
    ("cpu", True, "shm"), ("cuda", True, "cuda_ipc"), ("cuda:1", True, "cuda_ipc"),
    ("cpu", False, "none"), ("cuda", False, "none")])
def test_auto_receives_by_the_devices_own_way_only_with_an_engine_key(device, has_key, kind):
    config = EngineConfig(model="m", device=device)
    assert config.resolved_kv_transfer(has_key=has_key) == kind
    assert EngineConfig(model="m", device=device, kv_transfer="tcp").resolved_kv_transfer() == "tcp"


def test_a_remote_send_failing_while_it_copies_its_cached_prefix_leaves_nothing(
        pair, prompts, ref, monkeypatch):
    """The cached part of a send is written at once; if that raises, the call fails and
    neither its pages nor its transfer job outlive it."""
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    generate(p, "warm", prompt)  # prompt's pages now in P's prefix cache
    addr = d.exchange.prep_recv("copy-fails", prompt, -1, None).kv_addr

    def broken(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(p.exchange.sender, "write_all_layers", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        p.remote_send("copy-fails", prompt, 0, -1, addr)
    assert "copy-fails" not in p.exchange.sender._jobs
    d.exchange.abort("copy-fails")
    assert_clean(p, d)
    monkeypatch.undo()  # and the same send then goes through
    addr = d.exchange.prep_recv("copy-fails", prompt, -1, None).kv_addr
    assert send(p, "copy-fails", prompt, 0, -1, addr).reused > 0
    d.exchange.abort("copy-fails")
    assert_clean(p, d)


# ---- a remote_send started before its destination is known (send_to) ------------------------


@pytest.mark.parametrize("parked", [False, True])
def test_send_to_names_the_destination_of_a_send_that_started_without_it(
        pair, prompts, ref, parked):
    """P starts computing before D's prep_recv answered (the router runs them side by side);
    send_to then copies what P holds (its cached prefix, or all of it once parked) from D's
    match on, and the rest goes as computed. Both prefix cases of §3.5 at once: P holds
    prompt[:40], D prompt[:8]. D's tokens are one engine's greedy ones."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]  # 61 tokens
    n = len(prompt)
    generate(p, "warm", prompt[:40] + [9])
    generate(d, "warm", prompt[:8] + [9])
    p.remote_send("e", prompt, 0, n, None, greedy(N_NEW))
    assert p.requests.get("e").state is RequestState.SENDING
    while parked and p.requests.get("e").state is not RequestState.PARKED:
        p.step()
    assert p.poll() == []  # nothing to answer before it was sent
    r = d.exchange.prep_recv("e", prompt, n, None)
    assert r.matched == 8
    copied = p.exchange.send_to("e", r.matched, r.kv_addr).copied
    assert copied == (n - 8 if parked else 40 - 8)
    out = answered(p, "e")
    assert out == RemoteSendResponse(sent=n - 8, computed=n - 40, reused=32,
                                     first_token=ref[2][0])
    tokens, outs = generate_from(d, "e", prompt, out.first_token, greedy(N_NEW))
    assert tokens == ref[2] and outs[0].num_cached_tokens == n
    assert_clean(p, d)


def test_send_to_mid_compute_copies_the_chunks_done_and_sends_the_rest(bare, prompts, ref):
    p, d = bare  # P computes 16 tokens a step
    prompt = prompts[0]  # 45 tokens
    p.remote_send("m", prompt, 0, -1, None)
    p.step()
    r = d.exchange.prep_recv("m", prompt, -1, None)
    assert p.exchange.send_to("m", r.matched, r.kv_addr).copied == 16
    assert answered(p, "m") == RemoteSendResponse(sent=44, computed=44, reused=0)
    tokens, cached = generate(d, "m", prompt, begin=44)
    assert tokens == ref[0] and cached == 44
    abort_the_rest(p, d)


def test_send_to_and_remote_send_without_kv_addr_refuse_what_they_cannot_do(pair, prompts):
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    addr = d.exchange.prep_recv("r", prompt, -1, None).kv_addr
    with pytest.raises(MicroservingError, match="begin 4 without kv_addr: a remote_send that "
                       "does not know its destination yet gets begin with send_to") as e:
        p.remote_send("q", prompt, 4, -1, None)
    assert e.value.status == 400 and "q" not in p.requests
    p.remote_send("sent", prompt, 0, -1, addr)  # a send that has its destination already
    with pytest.raises(MicroservingError, match="no remote_send waiting for its destination "
                       "under request_id 'sent'") as e:
        p.exchange.send_to("sent", 0, addr)
    assert e.value.status == 404
    p.abort_request("sent")
    p.remote_send("q", prompt, 0, -1, None)
    with pytest.raises(MicroservingError, match="begin 45 is after the send's end 44") as e:
        p.exchange.send_to("q", 45, addr)
    with pytest.raises(MicroservingError, match=re.escape(
            "kv_addr reserves positions [0, 44) but the send covers [4, 44)")):
        p.exchange.send_to("q", 4, addr)
    assert p.requests.get("q").job.dst_slots is None  # still waiting for a good one
    for rid in ("q", "r"):
        p.abort_request(rid)
        d.abort_request(rid)
    p.poll()
    assert_clean(p, d)


def test_a_parked_send_whose_send_to_never_comes_is_dropped_after_the_lease(pair, prompts):
    p, _ = pair
    reset(p)
    lease = p.exchange.lease_s
    p.exchange.lease_s = 0.05
    try:
        called = time.monotonic()
        p.remote_send("late", prompts[1], 0, -1, None)
        while p.requests.get("late").state is not RequestState.PARKED:
            p.step()
        assert p.exchange.next_deadline() <= time.monotonic() + 0.05
        assert p.exchange.expire_leases(called) == 0  # not yet (however long the steps took)
        assert p.exchange.expire_leases(time.monotonic() + 0.05) == 1
    finally:
        p.exchange.lease_s = lease
    (rid, error), = p.poll()
    assert rid == "late" and error.status == 408
    assert str(error) == ("no send_to named where to send request 'late' within 0.05 s of its "
                          "remote_send (this engine's --kv-lease-s)")
    assert_clean(p)


def test_a_send_no_step_starts_within_its_queue_time_fails_and_holds_nothing(pair, prompts):
    """queue_s bounds the wait for the first step: a send still queued past it is a 503
    (queue_timeout), out of the scheduler, its pages freed; one a step has started on is not;
    one the core takes up only after its queue time is refused at once."""
    p, _ = pair
    reset(p)
    before = p.stats().kv_send_queue_timeouts
    called = time.monotonic()
    p.remote_send("started", prompts[0], 0, -1, None, queue_s=0.05)
    p.step()  # its first chunk: it has started
    p.remote_send("queued", prompts[1], 0, -1, None, queue_s=0.05)
    assert p.exchange.next_deadline() <= time.monotonic() + 0.05
    assert p.expire(called) == 0  # not yet
    assert p.kv.stats().used_pages > 0 and p.scheduler.has_work()
    assert p.expire(time.monotonic() + 0.05) == 1
    (rid, error), = p.poll()
    assert (rid, error.status, error.code) == ("queued", 503, "queue_timeout")
    assert str(error) == ("waited 0.05 s for this engine to start computing request 'queued' "
                          "(its queue_s): it is busy; retry later")
    assert "queued" not in p.requests and all(
        s.request_id == "started" for s in [*p.scheduler.waiting, *p.scheduler.running])
    with pytest.raises(MicroservingError) as stale:  # taken up 1 s after its frontend got it
        p.remote_send("stale", prompts[2], 0, -1, None, received_at=time.perf_counter() - 1,
                      queue_s=0.5)
    assert (stale.value.status, stale.value.code) == (503, "queue_timeout")
    assert "stale" not in p.requests
    assert p.stats().kv_send_queue_timeouts == before + 2
    p.abort_request("started")
    assert [(rid, e.status) for rid, e in p.poll()] == [("started", 409)]
    assert_clean(p)


def test_a_send_to_that_overtook_its_remote_send_is_kept_for_it(pair, prompts, ref):
    """The router makes send_to as soon as D answers; on the way to P it may pass the
    remote_send it names. P keeps it: the send then starts with its destination."""
    p, d = pair
    reset(p, d)
    prompt = prompts[0]
    r = d.exchange.prep_recv("o", prompt, -1, None)
    assert p.exchange.send_to("o", r.matched, r.kv_addr).copied == 0
    with pytest.raises(MicroservingError, match="send_to for request_id 'o' was made already"):
        p.exchange.send_to("o", r.matched, r.kv_addr)
    assert "o" not in p.requests
    out = send(p, "o", prompt, 0, -1, None)
    assert out == RemoteSendResponse(sent=len(prompt) - 1, computed=len(prompt) - 1, reused=0)
    tokens, _ = generate(d, "o", prompt, begin=len(prompt) - 1)
    assert tokens == ref[0]
    # one kept for a send that never comes goes with an abort, or after the lease
    p.exchange.send_to("gone", 0, r.kv_addr)
    assert p.abort_request("gone") is None and not p.exchange.forget_address("gone")
    p.exchange.send_to("late", 0, r.kv_addr)
    assert p.exchange.next_deadline() <= time.monotonic() + p.exchange.lease_s
    p.exchange.expire_leases(time.monotonic() + p.exchange.lease_s + 1)
    assert not p.exchange.forget_address("late") and p.exchange.next_deadline() is None
    assert_clean(p, d)


def test_an_abort_that_overtook_its_early_send_refuses_that_send_alone(pair, prompts, ref):
    """The router drops an early send (no kv_addr) with one abort, which may reach P first:
    said to be for an early send, it is kept, and the send is refused when it comes (409,
    nothing held). The router's next calls under the same id go through: the one-after-the-
    other remote_send (with kv_addr) and D's generation. A plain abort keeps nothing; a kept
    one is cleared by a remote_send with kv_addr, or goes after the lease."""
    p, d = pair
    reset(p, d)
    prompt = prompts[2]
    n = len(prompt)
    assert p.abort_request("ov") is None and p.exchange.next_deadline() is None  # plain
    assert p.abort_request("ov", early_send=True) is None
    assert p.exchange.next_deadline() <= time.monotonic() + p.exchange.lease_s
    with pytest.raises(MicroservingError, match="request 'ov' was aborted") as e:
        p.remote_send("ov", prompt, 0, n, None, greedy(N_NEW))
    assert e.value.status == 409
    assert "ov" not in p.requests and p.exchange.next_deadline() is None and not p.poll()
    assert_clean(p)
    r = d.exchange.prep_recv("ov", prompt, n, None)
    out = send(p, "ov", prompt, r.matched, n, r.kv_addr, sampling=greedy(N_NEW))
    assert out.first_token == ref[2][0]
    tokens, _ = generate_from(d, "ov", prompt, out.first_token, greedy(N_NEW))
    assert tokens == ref[2]
    # kept after its early send came and went (the abort came after the send's answer): the
    # router's next remote_send, with kv_addr, goes through and clears it
    p.abort_request("stale", early_send=True)
    r = d.exchange.prep_recv("stale", prompt, n, None)
    assert send(p, "stale", prompt, r.matched, n, r.kv_addr).sent == n - r.matched
    assert p.exchange.next_deadline() is None
    d.abort_request("stale")
    # kept, but no send comes: it goes after the lease
    p.abort_request("never", early_send=True)
    assert p.exchange.next_deadline() is not None
    p.exchange.expire_leases(time.monotonic() + p.exchange.lease_s + 1)
    assert p.exchange.next_deadline() is None
    assert_clean(p, d)


def test_an_asynchronous_sender_answers_right_after_the_step_that_finished_its_send(
        tiny_model_dir, prompts, ref):
    """With async scheduling, once the step that computed a send's last chunk (and sampled its
    token) is read back, the core waits for that send's KV to land (KVExchange.await_flushes)
    before the next poll, which then answers it: not a step later."""
    p = make_core(tiny_model_dir, "shm", async_scheduling=True, max_num_batched_tokens=16)
    d = make_core(tiny_model_dir, "shm")
    try:
        prompt = prompts[2]  # 61 tokens: four chunks of 16
        n = len(prompt)
        p.add_request("busy", prompts[0], greedy(40))  # keeps P stepping throughout
        waits, steps = [], 0  # the step during which the core waited for "s"'s KV
        real = p.exchange.await_flushes
        p.exchange.await_flushes = lambda ids, t: (waits.append(steps) if "s" in ids else None,
                                                   real(ids, t))[1]
        r = d.exchange.prep_recv("s", prompt, n, None)
        p.remote_send("s", prompt, 0, n, r.kv_addr, greedy(N_NEW))
        job = p.exchange.requests.get("s").job
        chunk_steps = []  # the steps that scheduled a chunk of "s"
        real_sends_for = p.exchange.sends_for
        p.exchange.sends_for = lambda seq, start, num: (
            chunk_steps.append(steps) if seq.request_id == "s" else None,
            real_sends_for(seq, start, num))[1]
        answer = None
        while answer is None:
            steps += 1
            p.step()
            assert steps < 50
            for rid, outcome in p.poll():
                assert rid == "s" and not isinstance(outcome, Exception)
                answer = outcome
        # The step that read back the send's last chunk (and its token) waited for its KV, and
        # the poll right after it answered: its number is the last wait's.
        assert waits and waits[-1] == steps
        assert answer.first_token == ref[2][0]
        assert answer.timing.prefill_s > 0 and answer.timing.tail_s >= 0
        # its chunks' span: from the step of its first chunk to that of its last, the fifth (each
        # step's 16 tokens less the busy request's decode token: 61 = 4 x 15 + 1)
        assert chunk_steps == list(range(chunk_steps[0], chunk_steps[0] + 5))
        assert answer.timing.chunks_s == pytest.approx(job.last_step_at - job.first_step_at)
        assert 0 < answer.timing.chunks_s < answer.timing.prefill_s
        d.exchange.abort("s")
        while p.has_work():
            p.step()
            p.poll()
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


class _Timeline:
    """Records the order of an engine's launches and its waits for them (DeviceTimeline's
    calls; on CPU the real one does nothing, so nothing would show)."""

    def __init__(self):
        self.events, self.launches = [], 0

    def begin(self, decodes=0, prompt_tokens=0):
        self.launches += 1
        self.events.append(("launch", self.launches))
        return self.launches

    def end(self, started):
        return started

    def wait(self, done):
        self.events.append(("wait", done))


def test_a_sender_whose_steps_sample_nothing_stays_one_step_ahead_of_the_device(
        tiny_model_dir, prompts):
    """A balanced P's steps sample nothing (the receiver computes the prompt's rest and samples
    its token), so no read-back makes the asynchronous core wait for the device: it must wait
    for each step all the same before launching the one after next, or it packs each chunk
    into a step of its own as soon as it arrives, queued on the GPU beyond the scheduler's
    reach. Four sends of 16-token chunks: every step k is waited for before step k + 2 is
    launched, and each is waited for once."""
    p = make_core(tiny_model_dir, "shm", async_scheduling=True, max_num_batched_tokens=16)
    d = make_core(tiny_model_dir, "shm")
    try:
        p.device_timeline = timeline = _Timeline()
        for i, prompt in enumerate(prompts):
            rid = f"s{i}"
            r = d.exchange.prep_recv(rid, prompt, len(prompt), None)
            p.remote_send(rid, prompt, 0, len(prompt), r.kv_addr)  # no sampling
        answers = {}
        for _ in range(60):
            p.step()
            answers.update(p.poll())
            if len(answers) == len(prompts):
                break
        assert sorted(answers) == [f"s{i}" for i in range(len(prompts))]
        assert all(a.first_token is None for a in answers.values())
        while p.has_work():
            p.step()
        chunks = sum(-(-len(prompt) // 16) for prompt in prompts)  # 3 + 2 + 4 + 2 steps' worth
        events = timeline.events
        launched = [n for kind, n in events if kind == "launch"]
        waited = [n for kind, n in events if kind == "wait"]
        assert launched == list(range(1, len(launched) + 1)) and len(launched) <= chunks
        assert waited == launched  # each step waited for, once, in order
        for k in launched[:-2]:
            assert events.index(("wait", k)) < events.index(("launch", k + 2))
        for rid in answers:
            d.exchange.abort(rid)
        assert_clean(p, d)
    finally:
        p.close()
        d.close()
