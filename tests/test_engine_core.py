"""The engine core's greedy tokens equal Hugging Face transformers', under continuous batching:
mixed prompt lengths in one batch, prefix-cache hits, chunked prefill, and preemption.
After every scenario the KV cache is intact and no finished request holds a page."""

from __future__ import annotations

import random
import time

import pytest

from conftest import TINY_VOCAB, hf_greedy
from engine.config import EngineConfig
from engine.core import EngineCore
from microserve.backend import MicroservingError
from microserve.messages import SamplingParams

N_NEW = 32
SMOLLM2_NEW = 16  # enough for the checked answer; each token costs SmolLM2 twice (HF and ours)


def greedy(max_tokens=N_NEW, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_all(core: EngineCore, prompts: dict[str, list[int]], params=None) -> dict:
    """Submit all prompts at once, step until done; returns request id -> (tokens, cached)."""
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params or greedy())
    tokens = {rid: [] for rid in prompts}
    cached, finished = {}, set()
    while core.has_work():
        for out in core.step():
            assert out.request_id not in finished, "output after the finishing one"
            tokens[out.request_id] += out.token_ids
            cached[out.request_id] = out.num_cached_tokens
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert finished == set(prompts), "a request ended without a finish reason"
    core.check_integrity()
    assert core.kv.stats().used_pages == 0, "a finished request still holds pages"
    return {rid: (tokens[rid], cached[rid]) for rid in prompts}


def random_prompts(lengths, seed=0, vocab=TINY_VOCAB):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def next_decode_step(core: EngineCore):
    """The batch of one decode step of every running sequence (each at its last token),
    and its input ids, to run through the model runner by hand."""
    from kvcache.forward import ForwardBatch, SeqForward

    seqs = list(core.scheduler.running)
    batch = ForwardBatch([SeqForward(s.request_id, s.num_computed_tokens, 1,
                                     core.kv.page_table(s.request_id)) for s in seqs],
                         core.kv.page_size)  # fmt: skip
    return batch, [s.token_ids()[-1] for s in seqs]


def make_core(model_dir, **kw):
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 256)
    return EngineCore(EngineConfig(model=model_dir, **kw))


# ---- tiny random Llama ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    prompts = random_prompts([1, 5, 17, 40, 64, 90])
    return prompts, hf_greedy(tiny_model_dir, prompts, N_NEW)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_mixed_batch_equals_hf(tiny_model_dir, tiny_ref, overlap):
    prompts, ref = tiny_ref
    core = make_core(tiny_model_dir, async_scheduling=overlap)
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i} (len {len(prompts[i])})"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_chunked_prefill_equals_hf(tiny_model_dir, tiny_ref, overlap):
    prompts, ref = tiny_ref
    # a budget of 7 splits every long prompt
    core = make_core(tiny_model_dir, max_num_batched_tokens=7, async_scheduling=overlap)
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i} (len {len(prompts[i])})"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_prompt_only_steps_take_the_larger_budget_and_equal_hf(tiny_model_dir, tiny_ref,
                                                                    overlap):
    """Steps of 7 tokens while anything decodes, of up to 50 when nothing does (the first
    step; a long prompt alone): the same tokens as Hugging Face's greedy decoding."""
    prompts, ref = tiny_ref
    core = make_core(tiny_model_dir, max_num_batched_tokens=7, max_prefill_step_tokens=50,
                     async_scheduling=overlap, enable_prefix_cache=False)
    schedule, steps = core.scheduler.schedule, []

    def recording():
        out = schedule()
        steps.append([(e.seq.request_id, e.num_new_tokens) for e in out.scheduled])
        return out

    core.scheduler.schedule = recording
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i} (len {len(prompts[i])})"
    # nothing decodes yet: 50 tokens (r0 1, r1 5, r2 17, r3 27 of its 40)
    assert steps[0] == [("r0", 1), ("r1", 5), ("r2", 17), ("r3", 27)]
    assert all(sum(n for _, n in step) <= 7 for step in steps[1:]), steps  # decodes in each
    steps.clear()
    assert run_all(core, {"alone": prompts[5]})["alone"][0] == ref[5]
    assert steps[:3] == [[("alone", 50)], [("alone", 40)], [("alone", 1)]]  # 90 tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_prefix_cache_hits_equal_hf(tiny_model_dir, overlap):
    (shared,) = random_prompts([37], seed=1)
    tails = random_prompts([3, 11, 1], seed=2)
    prompts = [shared + t for t in tails]
    ref = hf_greedy(tiny_model_dir, prompts, N_NEW)
    core = make_core(tiny_model_dir, async_scheduling=overlap)
    first = run_all(core, {"warm": prompts[0]})
    assert first["warm"] == (ref[0], 0)
    # The shared 37 tokens are cached in whole pages of 4: 36 tokens are reused by each.
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"] == (expected, 36), f"prompt {i}"
    # A prompt that is an exact repeat of a finished one (prompt + output) reuses nearly all.
    again = prompts[1] + ref[1]
    ref_again = hf_greedy(tiny_model_dir, [again], 8)[0]
    got = run_all(core, {"again": again}, greedy(8))
    assert got["again"] == (ref_again, (len(again) - 1) // 4 * 4)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_preemption_equals_hf(tiny_model_dir, tiny_ref, overlap):
    prompts, ref = tiny_ref
    # 40 pages of 4 = 160 slots for 6 sequences that grow to 32..122 tokens: decodes run out of
    # pages, newer sequences are preempted and recomputed, outputs must not change.
    core = make_core(tiny_model_dir, num_pages=40, enable_prefix_cache=False,
                     async_scheduling=overlap)
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    assert core.scheduler.num_preemptions > 0
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i}"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_tiny_abort_frees_pages(tiny_model_dir, overlap):
    core = make_core(tiny_model_dir, async_scheduling=overlap)
    for i, p in enumerate(random_prompts([30, 50, 9], seed=3)):
        core.add_request(f"r{i}", p, greedy())
    core.step()
    core.step()
    assert core.abort_request("r1").finish_reason == "abort"
    assert core.abort_request("nope") is None
    while core.has_work():
        core.step()
    core.check_integrity()
    assert core.kv.stats().used_pages == 0


@pytest.mark.parametrize("num_pages", [256, 40])
def test_the_start_up_requests_leave_nothing_behind(tiny_model_dir, tiny_ref, num_pages):
    """A CUDA engine serves its warm-up requests before it reports ready (here called on CPU,
    where start-up skips it): afterwards no request, held or cached page, counter or
    preemption remains, and the engine answers as one that never ran them. 40 pages of 4
    tokens: the warm-up shortens its prompts to fit."""
    core = make_core(tiny_model_dir, num_pages=num_pages)
    schedule, steps = core.scheduler.schedule, []

    def recording():
        out = schedule()
        steps.append(sorted(s.num_new_tokens for s in out.scheduled))
        return out

    core.scheduler.schedule = recording
    assert core.warm_up() > 0
    core.scheduler.schedule = schedule
    # each prompt length also arrives while two requests decode (a mixed step; on a GPU its
    # own Triton specializations, which a first Poisson arrival would otherwise compile)
    arrivals = {step[-1] for step in steps if step[:2] == [1, 1] and step[-1] > 1}
    assert arrivals == ({10, 40} if num_pages == 256 else {10}), steps  # the lengths that fit
    stats = core.kv.stats()
    assert (stats.used_pages, stats.cached_pages, stats.free_pages) == (0, 0, num_pages)
    assert core.counters == dict.fromkeys(core.counters, 0)
    assert core.scheduler.num_preemptions == 0 and not core.has_work()
    assert len(core.requests) == 0
    core.check_integrity()
    prompts, ref = tiny_ref
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, f"prompt {i}"


def test_the_warm_up_is_on_by_default_and_skip_warmup_turns_it_off():
    from launcher.cli import parser

    assert parser().parse_args(["engine"]).warmup is True
    assert parser().parse_args(["engine", "--skip-warmup"]).warmup is False
    assert EngineConfig(model="x").warmup is True


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_the_stats_interval_is_checked(seconds):
    from launcher.cli import parser

    assert parser().parse_args(["engine", "--log-stats-interval", "0"]).log_stats_interval_s == 0
    assert EngineConfig(model="x").log_stats_interval_s == 10.0
    with pytest.raises(ValueError, match=f"log_stats_interval_s must be .* got {seconds}"):
        EngineConfig(model="x", log_stats_interval_s=seconds)


def test_bad_requests_are_refused_with_numbers(tiny_model_dir):
    core = make_core(tiny_model_dir, num_pages=8, max_model_len=100)
    with pytest.raises(ValueError, match=r"prompt \(90 tokens\) \+ max_tokens \(20\) = 110 exceeds "
                       r"the maximum context length of 100 tokens"):
        core.add_request("a", [5] * 90, greedy(20))
    with pytest.raises(ValueError, match="exceeds the KV cache capacity of 32 tokens"):
        core.add_request("b", [5] * 30, greedy(20))
    with pytest.raises(ValueError, match=r"prompt token id 256 out of range \[0, 256\)"):
        core.add_request("c", [5, 256], greedy(2))
    with pytest.raises(ValueError, match="prompt is empty"):
        core.add_request("d", [], greedy(2))
    core.add_request("e", [5, 6], greedy(2))
    with pytest.raises(MicroservingError, match="request_id 'e' is already in use") as e:
        core.add_request("e", [5, 6], greedy(2))
    assert e.value.status == 409


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_stop_token_ids_and_eos(tiny_model_dir, tiny_ref, overlap):
    prompts, ref = tiny_ref
    core = make_core(tiny_model_dir, async_scheduling=overlap)
    stop_at = ref[3][5]
    first = ref[3].index(stop_at)
    params = SamplingParams(max_tokens=N_NEW, temperature=0.0, stop_token_ids=(stop_at,),
                            ignore_eos=True)
    got = run_all(core, {"s": prompts[3]}, params)
    assert got["s"][0] == ref[3][: first + 1]


# ---- SmolLM2 ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_batch_with_shared_prefix_and_chunks_equals_hf(smollm2_dir):
    from microserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue, and give one example of Rayleigh scattering.",
        "List three prime numbers.",
    ]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                   add_special_tokens=False)
        for q in questions
    ]
    ref = hf_greedy(smollm2_dir, prompts, SMOLLM2_NEW)
    core = make_core(smollm2_dir, page_size=16, num_pages=128, max_num_batched_tokens=40)
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(SMOLLM2_NEW))
    for i, expected in enumerate(ref):
        assert got[f"r{i}"][0] == expected, questions[i]
    # The system prompt is shared: a second round reuses it from the prefix cache.
    got = run_all(core, {f"again{i}": p for i, p in enumerate(prompts)}, greedy(SMOLLM2_NEW))
    for i, expected in enumerate(ref):
        assert got[f"again{i}"][0] == expected
        assert got[f"again{i}"][1] >= 16
    assert tok.decode(got["again0"][0]).startswith("The capital of France is Paris.")


def test_a_generation_no_step_starts_within_its_queue_time_fails_and_holds_nothing(
        tiny_model_dir):
    """start_generate's queue_s (the router's queue timeout) bounds the wait for the first
    step, as a remote_send's does: a generation still queued past it is a 503 (queue_timeout),
    out of the scheduler and the request table; one a step has started on is not; one the core
    takes up only after its queue time is refused at once."""
    core = make_core(tiny_model_dir, max_num_batched_tokens=16)
    long, short = random_prompts([64, 5])
    called = time.monotonic()
    core.add_request("started", long, greedy(2), queue_s=0.05)
    core.step()  # its first chunk: it has started; its prefill takes every step's budget
    core.add_request("queued", short, greedy(2), queue_s=0.05)
    assert core.next_deadline() <= time.monotonic() + 0.05
    assert core.expire(called) == 0 and core.take_rejected() == []  # not yet
    assert core.expire(time.monotonic() + 0.05) == 1
    (rid, error), = core.take_rejected()
    assert (rid, error.status, error.code) == ("queued", 503, "queue_timeout")
    assert str(error) == ("waited 0.05 s for this engine to start computing request 'queued' "
                          "(its queue_s): it is busy; retry later")
    assert "queued" not in core.requests and core.next_deadline() is None
    assert [s.request_id for s in [*core.scheduler.waiting, *core.scheduler.running]] == [
        "started"]
    with pytest.raises(MicroservingError) as stale:  # taken up 1 s after its frontend got it
        core.add_request("stale", short, greedy(2), queue_s=0.5,
                         received_at=time.perf_counter() - 1)
    assert (stale.value.status, stale.value.code) == (503, "queue_timeout")
    assert "stale" not in core.requests
    assert core.stats().generate_queue_timeouts == 2
    outputs = [o for _ in range(8) if core.has_work() for o in core.step()]
    assert [o.finish_reason for o in outputs if o.request_id == "started"] == [None, "length"]
    assert not core.has_work() and core.kv.stats().used_pages == 0
    core.check_integrity()
