"""The microserving API between real engine daemons: SmolLM2-135M, real HTTP, real KV transfer.

Engines: `p` (a prefill engine), `d_shm` and `d_tcp` (decode engines that receive KV through
shared memory and through their TCP listener). Each split of a request (1P1D with and without
cached prefixes on either side, balanced P/D, context migration) must give exactly Hugging
Face's greedy tokens, which one engine alone gives (tests/test_engine_server.py). Faults are
driven over HTTP, including killing the receiver's process during a remote_send. After every
test each live engine is idle with its KV cache intact and no page held or reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import time

import httpx
import pytest
from conftest import DAEMON_LOGS, hf_greedy
from daemons import ENGINE_KEY, LIVE, Daemon, serve, serve_together
from deployments import assert_quiet

from microserve.backend import MicroservingError
from microserve.messages import (AbortRequest, CommitRequest, PrepRecvRequest, RemoteSendRequest,
                                 SamplingParams, SendToRequest)
from microserve.microserving_client import EngineClient
from microserve.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

# Wrong or misplaced KV shows in the first tokens; each one more costs ~0.1 s of decoding on
# the engine and as much for Hugging Face's reference on the 2-core machine.
N_NEW = 8
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
WARM = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # only caches the prompt
TEXT = (
    "Paged attention stores the key and value cache of each sequence in fixed-size pages, so "
    "memory is allocated on demand and shared between requests that start with the same "
    "prefix. A radix tree over token ids finds the longest cached prefix of a new prompt. "
    "Prefill computes the cache for the whole prompt at once and is bound by arithmetic; "
    "decode adds one token per step and is bound by memory bandwidth. Disaggregation runs the "
    "two phases on different engines and moves the cache between them. "
)
ENGINE_ARGS = ("--num-pages", "256", "--max-model-len", "4096", "--api-key", ENGINE_KEY)


def daemon(smollm2_dir, tmp_path_factory, name: str, *args: str) -> Daemon:
    log = tmp_path_factory.mktemp(name) / "daemon.log"
    return Daemon(smollm2_dir, log, name, *ENGINE_ARGS, *args)


@pytest.fixture(scope="module")
def engines(smollm2_dir, tmp_path_factory):
    # P: a small step budget makes a long remote_send take many steps (see the kill test).
    yield from serve_together(
        daemon(smollm2_dir, tmp_path_factory, "p", "--max-num-batched-tokens", "128"),
        daemon(smollm2_dir, tmp_path_factory, "d-shm", "--kv-transfer", "shm"),
        daemon(smollm2_dir, tmp_path_factory, "d-tcp", "--kv-transfer", "tcp"))


@pytest.fixture(scope="module")
def p(engines):
    return engines[0]


@pytest.fixture(scope="module")
def d_shm(engines):
    return engines[1]


@pytest.fixture(scope="module")
def d_tcp(engines):
    return engines[2]


@pytest.fixture(params=["shm", "tcp"])
def d(request, d_shm, d_tcp):
    return d_shm if request.param == "shm" else d_tcp


@pytest.fixture(autouse=True)
def engines_quiet_and_intact(request):
    request.node.stash[DAEMON_LOGS] = [e.log_path for e in LIVE]
    yield
    for engine in LIVE:
        assert engine.proc.poll() is None, f"engine {engine.name!r} died"
        assert_quiet(engine.name, engine.url)


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def collect(engine: EngineClient, rid: str, prompt: list[int], begin: int = 0,
                  params: SamplingParams = GREEDY, first_token: int | None = None):
    tokens, usage = [], None
    async for chunk in engine.start_generate(rid, prompt, begin, params, first_token):
        tokens += chunk.token_ids
        usage = chunk.usage or usage
    return tokens, usage


def client(daemon: Daemon) -> EngineClient:
    return EngineClient(daemon.url, api_key=daemon.key)


# ---- 1P1D, balanced, migration ---------------------------------------------------------------


async def test_pd_splits_give_single_engine_tokens(p, d, tok, smollm2_dir):
    """For one receiver kind: no cache; a prefix already on D (P computes it, sends the rest);
    D holding the whole prefix (P skipped); P holding a longer prefix than D (copied from
    P's cache); balanced (the last 20% prefilled on D)."""
    kind = d.name
    base = ids(tok, f"[{kind}] " + TEXT)  # ~130 tokens, unique per receiver kind
    prompts = {
        "nocache": ids(tok, f"Case one on {kind}. ") + base,
        "d-prefix": base + ids(tok, " What does decode do?"),
        "d-all": base + ids(tok, " What does prefill do?"),
        "p-longer": base + base[:40] + ids(tok, " Explain the radix tree."),
        "balanced": ids(tok, f"Case five on {kind}. ") + base + base,
    }
    want = dict(zip(prompts, hf_greedy(smollm2_dir, list(prompts.values()), N_NEW)))
    P, D = client(p), client(d)
    try:
        rid = f"{kind}-nocache"
        prompt = prompts["nocache"]
        r = await D.call(PrepRecvRequest(rid, prompt, end=-1))
        assert r.matched == 0 and r.kv_addr.num_slots == len(prompt) - 1
        sent = await P.call(RemoteSendRequest(rid, prompt, 0, -1, r.kv_addr))
        n = len(prompt) - 1
        assert (sent.sent, sent.computed, sent.reused) == (n, n, 0)
        tokens, usage = await collect(D, rid, prompt, begin=n)
        assert tokens == want["nocache"]
        assert (usage.prompt_tokens, usage.cached_tokens) == (len(prompt), n)

        # D caches `base` by serving a request on it alone.
        await collect(D, f"{kind}-warm-d", base + ids(tok, " Anything else?"), params=WARM)
        matched_base = len(base) // 16 * 16

        rid, prompt = f"{kind}-d-prefix", prompts["d-prefix"]
        r = await D.call(PrepRecvRequest(rid, prompt))
        assert r.matched == matched_base
        sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, -1, r.kv_addr))
        n = len(prompt) - 1
        assert (sent.sent, sent.reused) == (n - r.matched, 0)
        assert (await collect(D, rid, prompt, begin=n))[0] == want["d-prefix"]

        rid, prompt = f"{kind}-d-all", prompts["d-all"]
        r = await D.call(PrepRecvRequest(rid, prompt))
        assert r.matched == matched_base
        tokens, usage = await collect(D, rid, prompt, begin=r.matched)  # no remote_send
        assert tokens == want["d-all"] and usage.cached_tokens == r.matched

        rid, prompt = f"{kind}-p-longer", prompts["p-longer"]
        # P caches base + base[:40]; D holds only base (matched_base tokens).
        await collect(P, f"{kind}-warm-p", base + base[:40] + ids(tok, " Why?"), params=WARM)
        r = await D.call(PrepRecvRequest(rid, prompt))
        assert r.matched == matched_base
        sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, -1, r.kv_addr))
        p_cached = (len(base) + 40) // 16 * 16
        n = len(prompt) - 1
        assert (sent.sent, sent.reused, sent.computed) == (
            n - r.matched, p_cached - r.matched, n - p_cached)
        assert (await collect(D, rid, prompt, begin=n))[0] == want["p-longer"]

        rid, prompt = f"{kind}-balanced", prompts["balanced"]
        split = int(len(prompt) * 0.8)
        r = await D.call(PrepRecvRequest(rid, prompt, end=split))
        sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, split, r.kv_addr))
        assert sent.sent == split - r.matched
        tokens, usage = await collect(D, rid, prompt, begin=split)
        assert tokens == want["balanced"] and usage.cached_tokens == split
    finally:
        await P.aclose()
        await D.aclose()


async def test_p_hands_its_sampled_first_token_to_d(p, d, tok, smollm2_dir):
    """remote_send with sampling sends the whole prompt and answers with the first token; D's
    start_generate from the prompt's end emits it and decodes on: Hugging Face's tokens."""
    prompt = ids(tok, f"First token handed over to {d.name}. " + TEXT)
    want, = hf_greedy(smollm2_dir, [prompt], N_NEW)
    n, rid = len(prompt), f"{d.name}-first"
    P, D = client(p), client(d)
    try:
        r = await D.call(PrepRecvRequest(rid, prompt, end=n))
        sent = await P.call(RemoteSendRequest(rid, prompt, 0, n, r.kv_addr, GREEDY))
        assert (sent.sent, sent.computed, sent.first_token) == (n, n, want[0])
        with pytest.raises(MicroservingError, match="begin must be the prompt length") as e:
            await anext(D.start_generate(rid + "-bad", prompt, n - 1, GREEDY,
                                         first_token=want[0]))
        assert (e.value.status, e.value.param) == (400, "begin")
        tokens, usage = [], None
        async for chunk in D.start_generate(rid, prompt, n, GREEDY, first_token=want[0]):
            tokens += chunk.token_ids
            usage = chunk.usage or usage
        assert tokens == want
        assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (
            n, n, N_NEW)
    finally:
        await P.aclose()
        await D.aclose()


async def test_a_first_token_the_caller_delivered_travels_once(p, d, tok, smollm2_dir):
    """first_token_delivered (the router gave P's token to its client already): D's stream
    begins with the second token, and its usage still counts the first. A first token that
    ends the request (max_tokens 1) comes back as one chunk of no tokens with the finish."""
    prompt = ids(tok, f"Delivered once, by {d.name}. " + TEXT)
    want, = hf_greedy(smollm2_dir, [prompt], N_NEW)
    n = len(prompt)
    P, D = client(p), client(d)
    try:
        for rid, params in [(f"{d.name}-once", GREEDY),
                            (f"{d.name}-once-1", dataclasses.replace(GREEDY, max_tokens=1))]:
            r = await D.call(PrepRecvRequest(rid, prompt, end=n))
            sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, n, r.kv_addr, params))
            assert sent.first_token == want[0]
            chunks = [c async for c in D.start_generate(rid, prompt, n, params,
                                                        first_token=want[0],
                                                        first_token_delivered=True)]
            usage = chunks[-1].usage
            assert [t for c in chunks for t in c.token_ids] == want[1:params.max_tokens]
            assert chunks[0].cached_tokens is None  # the delivered token's chunk said it
            assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (
                n, n, params.max_tokens)
            assert chunks[-1].finish_reason == "length"
        with pytest.raises(MicroservingError, match="first_token_delivered needs") as e:
            await anext(D.start_generate(f"{d.name}-once-0", prompt, 0, GREEDY,
                                         first_token_delivered=True))
        assert (e.value.status, e.value.param) == (400, "first_token_delivered")
    finally:
        await P.aclose()
        await D.aclose()


async def test_p_starts_before_d_answers_and_send_to_names_where(p, d, tok, smollm2_dir):
    """The router's flow: P's remote_send without kv_addr goes out beside D's prep_recv; P
    computes (128 tokens a step) into its own pages; send_to, made when D answers, copies what
    P holds and the rest follows as computed. Hugging Face's tokens; nothing left held."""
    prompt = ids(tok, f"Started before its destination, to {d.name}. " + TEXT)
    want, = hf_greedy(smollm2_dir, [prompt], N_NEW)
    n, rid = len(prompt), f"{d.name}-early"
    P, D = client(p), client(d)
    try:
        sending = asyncio.ensure_future(P.call(RemoteSendRequest(rid, prompt, 0, n, None, GREEDY)))
        r = await D.call(PrepRecvRequest(rid, prompt, end=n, wait_s=0))
        await asyncio.sleep(0.05)  # P is well into its compute, or done and parked
        assert not sending.done()
        addressed = await P.call(SendToRequest(rid, r.matched, r.kv_addr))
        assert 0 < addressed.copied <= n
        sent = await sending
        assert (sent.sent, sent.computed, sent.first_token) == (n, n, want[0])
        tokens, _ = await collect(D, rid, prompt, n, first_token=want[0])
        assert tokens == want
    finally:
        await P.aclose()
        await D.aclose()


async def test_one_abort_ahead_of_its_early_send_refuses_it(p, d_shm, tok, smollm2_dir):
    """The router's early send dropped with one abort that reached P before the send (made
    here in that order): the send is refused (409) holding nothing, and the calls that follow
    under the same id, one after the other, give Hugging Face's tokens."""
    prompt = ids(tok, "Aborted before it came. " + TEXT)
    want, = hf_greedy(smollm2_dir, [prompt], N_NEW)
    n, rid = len(prompt), "abort-ahead"
    P, D = client(p), client(d_shm)
    try:
        assert (await P.call(AbortRequest(rid, early_send=True))).aborted
        with pytest.raises(MicroservingError, match=f"request '{rid}' was aborted") as e:
            await P.call(RemoteSendRequest(rid, prompt, 0, n, None, GREEDY))
        assert e.value.status == 409
        r = await D.call(PrepRecvRequest(rid, prompt, end=n))
        sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, n, r.kv_addr, GREEDY))
        assert sent.first_token == want[0]
        tokens, _ = await collect(D, rid, prompt, n, first_token=want[0])
        assert tokens == want
    finally:
        await P.aclose()
        await D.aclose()


async def test_context_migration_of_1000_tokens(p, d, tok):
    """prep_recv + remote_send + commit move a 1,000-token context from P to D; the next
    request on D finds it cached, computes only the rest, and gives P's tokens."""
    # One context for both receivers: P computes it once (the second run finds it in P's cache
    # for its reference request, as the first run's send does); each receiver starts empty.
    context = (ids(tok, "Migration. ") + ids(tok, TEXT) * 12)[:1000]
    assert len(context) == 1000
    question = ids(tok, " Summarize the text above in one sentence.")
    P, D = client(p), client(d)
    try:
        want, _ = await collect(P, f"{d.name}-mig-ref", context + question)
        rid = f"{d.name}-mig"
        r = await D.call(PrepRecvRequest(rid, context, end=len(context)))
        sent = await P.call(RemoteSendRequest(rid, context, r.matched, len(context), r.kv_addr))
        # P's cache holds the context's 62 whole pages; the 8 tokens after them are recomputed.
        assert (sent.sent, sent.reused, sent.computed) == (1000 - r.matched, 992 - r.matched, 8)
        committed = await D.call(CommitRequest(rid))
        assert committed.cached == 992  # whole 16-token pages of the 1,000
        tokens, usage = await collect(D, f"{d.name}-mig-after", context + question)
        assert usage.cached_tokens == 992 and tokens == want
    finally:
        await P.aclose()
        await D.aclose()


# ---- bad input and faults --------------------------------------------------------------------


async def test_bad_calls_get_specific_errors(p, d_shm, tok):
    P, D = client(p), client(d_shm)
    prompt = ids(tok, TEXT)[:100]
    try:
        with pytest.raises(MicroservingError, match="end 101 out of range for a 100-token"):
            await D.call(PrepRecvRequest("bad", prompt, end=101))
        r = await D.call(PrepRecvRequest("bad", prompt, end=-1))
        with pytest.raises(MicroservingError) as e:
            await D.call(PrepRecvRequest("bad", prompt))
        assert e.value.status == 409 and e.value.param == "request_id"
        with pytest.raises(MicroservingError, match=re.escape(
                "kv_addr reserves positions [0, 99) but the send covers [50, 99)")):
            await P.call(RemoteSendRequest("bad", prompt, 50, -1, r.kv_addr))
        with pytest.raises(MicroservingError, match="begin 99 beyond the 0 tokens") as e:
            await collect(P, "other", prompt, begin=99)
        assert e.value.status == 400 and e.value.param == "begin"
        with pytest.raises(MicroservingError) as e:
            await D.call(CommitRequest("no-such-request"))
        assert e.value.status == 404
        assert (await D.call(AbortRequest("bad"))).aborted  # after prep_recv: the reservation is freed
        assert not (await D.call(AbortRequest("bad"))).aborted
    finally:
        await P.aclose()
        await D.aclose()


async def test_a_kv_addr_writes_only_its_window_and_only_its_prompt(p, d, tok, smollm2_dir):
    """Issue 39 over HTTP: a genuine kv_addr whose ranges were moved to another request's
    slots, and one reserved for prompt X that P is asked to fill with prompt Y's KV, both
    answer a 400 before a byte moves (they answered 200 `sent 64` before). X on D afterwards
    gives Hugging Face's tokens; the autouse check finds nothing held."""
    x = ids(tok, f"Prompt X on {d.name}. " + TEXT)[:65]
    y = ids(tok, f"Prompt Y on {d.name}. Something else entirely. " + TEXT)[:65]
    want, = hf_greedy(smollm2_dir, [x], N_NEW)
    P, D = client(p), client(d)
    try:
        other = (await D.call(PrepRecvRequest("other", y))).kv_addr  # pages of another request
        r = await D.call(PrepRecvRequest("x", x))
        assert r.kv_addr.num_slots == 64 and other.ranges != r.kv_addr.ranges
        moved = dataclasses.replace(r.kv_addr, ranges=other.ranges)
        with pytest.raises(MicroservingError) as e:
            await P.call(RemoteSendRequest("x", x, 0, -1, moved))
        assert (e.value.status, e.value.param) == (400, "kv_addr.ranges")
        assert str(e.value) == (
            f"refusing to send: kv_addr's ranges {[list(r) for r in other.ranges]} for window "
            f"{r.kv_addr.window[0]} are not what its receiver reserved (the receiver's "
            "signature over begin, end, ranges, window and digest does not verify): pass the "
            "prep_recv answer's kv_addr unchanged")
        with pytest.raises(MicroservingError) as e:
            await P.call(RemoteSendRequest("x", y, 0, -1, r.kv_addr))
        assert (e.value.status, e.value.param) == (400, "prompt")
        assert str(e.value).startswith(f"refusing to send: kv_addr's window "
                                       f"{r.kv_addr.window[0]} was reserved for another prompt")
        assert (await D.call(AbortRequest("x"))).aborted and (await D.call(AbortRequest("other"))).aborted
        tokens, usage = await collect(D, "x-after", x)
        assert tokens == want and usage.cached_tokens == 0
    finally:
        await P.aclose()
        await D.aclose()


async def test_layout_mismatch_is_refused_with_both_layouts(p, smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("other-layout") / "daemon.log"
    gen = serve(Daemon(smollm2_dir, log, "other-layout", "--num-pages", "64",
                       "--page-size", "32", "--dtype", "bfloat16", "--api-key", ENGINE_KEY))
    other = next(gen)
    O, P = client(other), client(p)
    try:
        r = await O.call(PrepRecvRequest("layout", [5] * 40))
        with pytest.raises(MicroservingError, match="KV layout mismatch in dtype, page_size") as e:
            await P.call(RemoteSendRequest("layout", [5] * 40, 0, -1, r.kv_addr))
        assert e.value.status == 400 and e.value.param == "kv_addr.layout"
        assert "'page_size': 16" in str(e.value) and "'page_size': 32" in str(e.value)
        assert (await O.call(AbortRequest("layout"))).aborted
    finally:
        await O.aclose()
        await P.aclose()
        next(gen, None)  # stop the daemon


async def test_abort_during_remote_send(p, d_tcp, tok):
    P, D = client(p), client(d_tcp)
    prompt = (ids(tok, "Abort me. ") + ids(tok, TEXT) * 12)[:1000]
    try:
        r = await D.call(PrepRecvRequest("ab", prompt))
        send = asyncio.create_task(P.call(RemoteSendRequest("ab", prompt, 0, -1, r.kv_addr)))
        await asyncio.sleep(0.2)
        assert (await P.call(AbortRequest("ab"))).aborted
        with pytest.raises(MicroservingError, match="was aborted") as e:
            await send
        assert e.value.status == 409
        assert (await D.call(AbortRequest("ab"))).aborted
    finally:
        await P.aclose()
        await D.aclose()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
async def test_receiver_killed_during_remote_send(p, tok, kind, smollm2_dir, tmp_path_factory):
    """The receiver's engine core dies while P computes and writes: remote_send answers 502,
    and P holds nothing afterwards (the autouse check)."""
    log = tmp_path_factory.mktemp(f"victim-{kind}") / "daemon.log"
    victim = Daemon(smollm2_dir, log, f"victim-{kind}", *ENGINE_ARGS, "--kv-transfer", kind)
    try:
        victim.wait_ready()
        P, V = client(p), client(victim)
        prompt = (ids(tok, f"Kill {kind}. ") + ids(tok, TEXT) * 24)[:2000]
        r = await V.call(PrepRecvRequest("victim", prompt))
        send = asyncio.create_task(P.call(RemoteSendRequest("victim", prompt, 0, -1, r.kv_addr)))
        deadline = time.monotonic() + 30
        while (await P.stats()).stats.kv_send_jobs == 0:  # the send has started
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        os.kill(victim.core_pid(), signal.SIGKILL)
        with pytest.raises(MicroservingError, match="KV transfer failed") as e:
            await asyncio.wait_for(send, 60)
        assert e.value.status == 502
        await P.aclose()
        await V.aclose()
    finally:
        victim.stop()


async def test_bearer_token_guards_the_api(p):
    """P's --api-key (every engine of this module has one) guards /microserving and /v1, not
    /health. (P rather than a daemon of its own: starting one costs ~10 s.)"""
    for path in ("/microserving/stats", "/v1/models"):
        assert httpx.get(p.url + path).status_code == 401
    assert httpx.get(p.url + "/health").status_code == 200
    G = EngineClient(p.url, api_key=ENGINE_KEY)
    r = await G.call(PrepRecvRequest("t", [5, 6, 7]))
    assert r.matched == 0
    assert (await G.call(AbortRequest("t"))).aborted
    await G.aclose()
    bad = EngineClient(p.url, api_key="wrong")
    with pytest.raises(MicroservingError) as e:
        await bad.call(PrepRecvRequest("t", [5, 6, 7]))
    assert e.value.status == 401
    await bad.aclose()
