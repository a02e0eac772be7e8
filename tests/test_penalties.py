"""logit_bias, min_tokens and the repetition / frequency / presence penalties.

The sampler on hand-made logits: each adjustment gives exactly the logits and tokens worked out
by hand, in vLLM's order; rows without options are untouched; the penalties' counts are kept on
the device, so a second step penalizes the first step's token before the host has read it.
Then the engine core with SmolLM2 (async scheduling on, so every step is sampled while the
previous step's token is still pending) against Hugging Face: repetition_penalty equals
`generate(repetition_penalty=)`, min_tokens its `min_new_tokens`, logit_bias its
`sequence_bias`, and frequency + presence a reference loop over its logits. No request leaves
a pool entry behind, aborted or not.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _hf_model, hf_generate, hf_greedy
from test_engine_core import make_core, random_prompts
from test_sampler import DEVICES, params

from engine.penalties import PenaltyPool, adjust_logits
from engine.sampler import Sampler, TokenMask, make_generator
from engine.sequence import Sequence
from microserve.messages import SamplingParams

INF = float("inf")
EOS = 4


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def pool_with(device, vocab: int, *requests: tuple[str, list[int], SamplingParams]):
    """A pool holding `requests` (id, prompt, params), and their sequences, in that order."""
    pool = PenaltyPool(vocab, device, [EOS])
    seqs = []
    for rid, prompt, p in requests:
        pool.add(rid, p)
        seqs.append(Sequence(rid, prompt, p, 0))
    return pool, seqs


def tensor(rows, device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, device=device)


def test_logit_bias_adds_and_greedy_takes_the_adjusted_argmax(device):
    p = params(temperature=0.0, logit_bias=((0, 2.5), (3, -1.0)))
    pool, seqs = pool_with(device, 4, ("a", [1], p))
    logits = tensor([[1.0, 2.0, 3.0, 0.5]], device)
    adjust = pool.step(seqs)
    assert adjust.counted == [] and adjust.pool is None  # a bias needs no counts
    assert adjust_logits(logits, adjust).tolist() == [[3.5, 2.0, 3.0, -0.5]]
    assert Sampler(4, device).sample(logits, [p], [None], adjust=adjust).token_ids == [0]


def test_min_tokens_bans_the_stop_ids_until_reached(device):
    """eos (unless ignore_eos) and stop_token_ids are impossible while fewer than min_tokens
    tokens are out; the pending token counts as out."""
    logits = tensor([[1.0, 0.0, 0.5, 2.0, 3.0]], device)  # eos (4) first, then stop id 3
    p = params(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    pool, [seq] = pool_with(device, 5, ("a", [1], p))
    sampler = Sampler(5, device)
    assert adjust_logits(logits, pool.step([seq])).tolist() == [[1.0, 0.0, 0.5, -INF, -INF]]
    assert sampler.sample(logits, [p], [None], adjust=pool.step([seq])).token_ids == [0]
    seq.output_token_ids.append(-1)  # PENDING: one out
    assert sampler.sample(logits, [p], [None], adjust=pool.step([seq])).token_ids == [0]
    seq.output_token_ids.append(0)
    assert pool.step([seq]) is None  # reached: nothing left to adjust
    assert sampler.sample(logits, [p], [None], adjust=pool.step([seq])).token_ids == [4]

    ignoring = params(temperature=0.0, min_tokens=1, stop_token_ids=(3,), ignore_eos=True)
    pool, seqs = pool_with(device, 5, ("b", [1], ignoring))
    assert adjust_logits(logits, pool.step(seqs)).tolist() == [
        [1.0, 0.0, 0.5, -INF, 3.0]]


def test_allowed_token_ids_leave_only_those(device):
    """allowed_token_ids: every other logit of the row -inf, the allowed ones as they were
    (a bias on them still adds); the row beside it untouched; greedy and sampling alike pick
    among the allowed."""
    allowed = params(temperature=0.0, allowed_token_ids=(1, 3), logit_bias=((3, 0.5), (0, 9.0)))
    free = params(temperature=0.0, logit_bias=((2, 1.0),))
    pool, seqs = pool_with(device, 5, ("a", [1], allowed), ("b", [2], free))
    logits = tensor([[1.0, 0.0, 0.5, 2.0, 3.0], [1.0, 0.0, 0.5, 2.0, 3.0]], device)
    adjust = pool.step(seqs)
    assert adjust.allowed_rows == [0] and adjust.allowed_at == [1, 3]
    assert adjust_logits(logits, adjust).tolist() == [[-INF, 0.0, -INF, 2.5, -INF],
                                                      [1.0, 0.0, 1.5, 2.0, 3.0]]
    assert Sampler(5, device).sample(logits, [allowed, free], [None, None],
                                     adjust=pool.step(seqs)).token_ids == [3, 4]
    hot = params(temperature=1.0, allowed_token_ids=(0, 2))
    pool, seqs = pool_with(device, 5, *[(f"h{i}", [1], hot) for i in range(200)])
    drawn = Sampler(5, device, seed=0).sample(logits[:1].expand(200, -1).contiguous(),
                                              [hot] * 200, [None] * 200,
                                              adjust=pool.step(seqs)).token_ids
    assert set(drawn) == {0, 2}


def test_repetition_penalty_divides_or_multiplies_seen_logits(device):
    """Hugging Face's rule on the prompt's tokens: 2.0 / 2 and -1.0 * 2; unseen ones stay."""
    p = params(temperature=0.0, repetition_penalty=2.0)
    pool, seqs = pool_with(device, 4, ("a", [1, 2, 1], p))
    logits = tensor([[1.0, 2.0, -1.0, 0.5]], device)
    adjust = pool.step(seqs)
    assert adjust_logits(logits, adjust).tolist() == [[1.0, 1.0, -2.0, 0.5]]
    # 1.0 ties 1.0: the lower id, where the raw argmax was token 1
    assert Sampler(4, device).sample(logits, [p], [None], adjust=adjust).token_ids == [0]


def test_all_five_in_order_and_counts_kept_on_the_device(device):
    """Two steps of one request, the second sampled before the first's token was read:

        raw                       [2.0,  1.0, 0.5, -1.0,  3.0]   prompt [3], eos 4
        step 1  bias +1 (1), +2 (3)  [2.0,  2.0, 0.5,  1.0,  3.0]
                min_tokens 1: eos    [2.0,  2.0, 0.5,  1.0, -inf]
                repetition 2 (3)     [2.0,  2.0, 0.5,  0.5, -inf]   -> token 0 (the tie's lower id)
        step 2  bias                 [2.0,  2.0, 0.5,  1.0,  3.0]   one token out: eos allowed
                repetition (0, 3)    [1.0,  2.0, 0.5,  0.5,  3.0]
                frequency 0.5 x 1, presence 0.25 (0)  [0.25, 2.0, 0.5, 0.5, 3.0]   -> token 4
    """
    p = params(temperature=0.0, logit_bias=((1, 1.0), (3, 2.0)), min_tokens=1,
               repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    pool, [seq] = pool_with(device, 5, ("a", [3], p))
    logits = tensor([[2.0, 1.0, 0.5, -1.0, 3.0]], device)
    sampler = Sampler(5, device)
    first_adjust = pool.step([seq])
    assert adjust_logits(logits, first_adjust).tolist() == [[2.0, 2.0, 0.5, 0.5, -INF]]
    first = sampler.sample_async(logits, [p], [None], adjust=first_adjust)
    seq.output_token_ids.append(-1)  # PENDING: the host has not read it
    second_adjust = pool.step([seq])
    assert adjust_logits(logits, second_adjust).tolist() == [[0.25, 2.0, 0.5, 0.5, 3.0]]
    second = sampler.sample_async(logits, [p], [None], adjust=second_adjust)
    assert (first.result().token_ids, second.result().token_ids) == ([0], [4])
    assert pool.counts[pool._entries["a"].row].tolist() == [1, 0, 0, 0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_adjusting_and_counting_never_wait_for_the_gpu():
    """Under CUDA's sync debug mode (an error on any host sync), two steps of every kind of
    adjustment sample and count; the counts are right afterwards."""
    device = torch.device("cuda")
    p = params(temperature=0.7, logit_bias=((1, 1.0),), min_tokens=1, repetition_penalty=1.3,
               frequency_penalty=0.5, presence_penalty=0.25)
    pool, seqs = pool_with(device, 64, ("a", [3, 5], p), ("b", [7], params(temperature=0.0,
                                                                           presence_penalty=1.0)))
    logits = torch.randn(3, 64, device=device)
    sampler = Sampler(64, device, seed=0)
    pool.step(seqs)  # warm up lazily initialized CUDA state outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = []
        for _ in range(2):
            all_params = [params(), *[s.params for s in seqs]]
            adjust = pool.step([Sequence("plain", [1], all_params[0], 0), *seqs])
            pending.append(sampler.sample_async(logits, all_params, [None] * 3, adjust=adjust))
            for s in seqs:
                s.output_token_ids.append(-1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = [r.result().token_ids for r in pending]
    for rid, row in (("a", 1), ("b", 2)):
        expected = torch.zeros(64, dtype=torch.int32)
        for step in tokens:
            expected[step[row]] += 1
        assert torch.equal(pool.counts[pool._entries[rid].row].cpu(), expected)


def test_rows_without_options_are_bit_identical(device):
    """Plain rows, a seeded sampled row and a masked row beside two adjusted rows: the same
    logits and tokens as without the adjusted rows' options; logprobs stay raw."""
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)).to(device)
    plain = [params(temperature=0.0, logprobs=1), params(temperature=0.9, seed=5),
             params(temperature=0.0)]
    adjusted = [params(temperature=0.0, repetition_penalty=1.5, logprobs=0),
                params(temperature=0.8, seed=9, frequency_penalty=1.0, logit_bias=((7, 5.0),))]
    row_params = [plain[0], adjusted[0], plain[1], adjusted[1], plain[2]]
    pool, _ = pool_with(device, vocab, ("x", [1, 2, 3], adjusted[0]), ("y", [4], adjusted[1]))
    seqs = [Sequence(rid, [1], p, 0) for rid, p in zip("pxqyr", row_params)]
    adjust = pool.step(seqs)
    assert adjust.rows == [1, 3] and adjust.counted == [0, 1]
    out = adjust_logits(logits, adjust)
    assert all(torch.equal(out[i], logits[i]) for i in (0, 2, 4))
    assert not torch.equal(out[1], logits[1]) and not torch.equal(out[3], logits[3])

    mask = TokenMask(rows=[4], bitmask=torch.tensor([[0b1010, 0]], dtype=torch.int32))
    def run(adjust):
        generators = [make_generator(p.seed, device) for p in row_params]
        return Sampler(vocab, device, seed=0).sample(logits, row_params, generators, mask,
                                                     adjust)
    with_options, without = run(adjust), run(None)
    for i in (0, 2, 4):
        assert with_options.token_ids[i] == without.token_ids[i]
    assert with_options.token_ids[4] in (1, 3)
    assert with_options.token_ids[1] == out[1].argmax().item()
    raw = logits.log_softmax(dim=-1)
    assert with_options.logprobs[1].logprob == pytest.approx(
        raw[1, with_options.token_ids[1]].item())
    assert with_options.logprobs[0] == without.logprobs[0]


def test_pool_grows_reuses_rows_and_starts_them_clean(device):
    vocab = 8
    counted = params(repetition_penalty=1.2)
    pool = PenaltyPool(vocab, device, [EOS])
    seqs = [Sequence(f"r{i}", [i], counted, 0) for i in range(5)]
    for seq in seqs:  # queued requests hold no row until they are first sampled
        pool.add(seq.request_id, counted)
    assert pool.counts.shape == (0, vocab)
    pool.add("bias", params(logit_bias=((2, 1.0),)))  # never a row
    adjust = pool.step(seqs + [Sequence("bias", [1], params(logit_bias=((2, 1.0),)), 0)])
    assert adjust.counted == [0, 1, 2, 3, 4] and adjust.rows == [0, 1, 2, 3, 4, 5]
    assert pool.counts.shape == (8, vocab) and len(pool) == 6  # past the first 4 rows
    assert pool._entries["bias"].row is None
    row = pool._entries["r2"].row
    assert pool.in_prompt[row].tolist() == [t == 2 for t in range(vocab)]
    pool.check_integrity()
    pool.step(seqs)  # later steps keep the rows
    assert pool._entries["r2"].row == row
    pool.counts[row, 5] = 3  # as if it had sampled token 5 three times
    pool.remove("r2")
    pool.remove("bias")
    pool.remove("unknown")
    pool.add("new", counted)
    pool.step([Sequence("new", [6], counted, 0)])
    assert pool._entries["new"].row == row
    assert pool.counts[row].tolist() == [0] * vocab
    assert pool.in_prompt[row].tolist() == [t == 6 for t in range(vocab)]
    pool.check_integrity()
    pool._free_rows.append(row)  # a row both free and held
    with pytest.raises(Exception, match="penalty pool rows"):
        pool.check_integrity()


def test_params_without_options_take_no_entry(device):
    pool = PenaltyPool(8, device, [EOS])
    pool.add("plain", params(temperature=0.5, top_p=0.9, stop_token_ids=(3,)))
    assert len(pool) == 0
    assert pool.step([Sequence("plain", [1], params(), 0)]) is None


# ---- the engine core against Hugging Face (SmolLM2, fp32 on CPU) ----------------------------

N_NEW = 24
LIST = "List the numbers from 1 to 20, separated by commas."
YES_NO = "Is the sky blue? Answer yes or no."  # greedy: "No." and eos after 3 tokens


def chat_prompt(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


def hf_frequency_presence(model_dir, prompt, max_new_tokens, frequency, presence, eos):
    """Greedy over Hugging Face's logits with vLLM's rule, one step at a time: subtract
    frequency x count and presence x (count > 0), counts over the output so far."""
    model = _hf_model(model_dir)
    counts = torch.zeros(model.config.vocab_size, dtype=torch.int32)
    tokens = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            logits = step.logits[0, -1].float().clone()
            logits -= frequency * counts
            logits -= presence * (counts > 0)
            token = int(logits.argmax())
            tokens.append(token)
            counts[token] += 1
            if token in eos:
                break
            step = model(torch.tensor([[token]]), past_key_values=step.past_key_values,
                         use_cache=True)
    return tokens


def run_core(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, p) in requests.items():
        core.add_request(rid, prompt, p)
    tokens = {rid: [] for rid in requests}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    core.check_integrity()
    assert len(core.penalties) == 0
    return tokens


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from microserve.tokenizer import Tokenizer

    return smollm2_dir, Tokenizer.from_dir(smollm2_dir)


@pytest.mark.slow
def test_smollm2_adjusted_greedy_equals_hugging_face(smollm2):
    """One batch, async scheduling, chunked prefill: each adjusted request gives Hugging
    Face's tokens, which differ from the plain greedy ones (so the test can fail), and a plain
    request beside them gives the plain greedy tokens."""
    model_dir, tok = smollm2
    eos = [2]
    listing, yes_no = chat_prompt(tok, LIST), chat_prompt(tok, YES_NO)
    plain = hf_generate(model_dir, listing, N_NEW)
    want = {
        "plain": plain,
        "repetition": hf_generate(model_dir, listing, N_NEW, repetition_penalty=1.3),
        "min_tokens": hf_generate(model_dir, yes_no, N_NEW, min_new_tokens=8),
        "bias": hf_generate(model_dir, listing, N_NEW,
                            sequence_bias={(28,): -100.0, (30,): 4.0}),
        "frequency": hf_frequency_presence(model_dir, listing, N_NEW, 1.5, 1.0, eos),
    }
    assert len(hf_generate(model_dir, yes_no, N_NEW)) < 8 <= len(want["min_tokens"])
    assert all(want[k] != plain for k in ("repetition", "bias", "frequency"))
    greedy = dict(max_tokens=N_NEW, temperature=0.0)
    requests = {
        "plain": (listing, SamplingParams(**greedy)),
        "repetition": (listing, SamplingParams(**greedy, repetition_penalty=1.3)),
        "min_tokens": (yes_no, SamplingParams(**greedy, min_tokens=8)),
        "bias": (listing, SamplingParams(**greedy, logit_bias=((28, -100.0), (30, 4.0)))),
        "frequency": (listing, SamplingParams(**greedy, frequency_penalty=1.5,
                                              presence_penalty=1.0)),
    }
    core = make_core(model_dir, page_size=16, num_pages=64, max_num_batched_tokens=32,
                     async_scheduling=True)
    assert run_core(core, requests) == want


@pytest.mark.slow
def test_smollm2_abort_and_finish_leave_no_pool_entry(smollm2):
    model_dir, tok = smollm2
    core = make_core(model_dir, page_size=16, num_pages=64, async_scheduling=True)
    prompt = chat_prompt(tok, LIST)
    for rid in ("a", "b", "c"):
        core.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                     repetition_penalty=1.2, min_tokens=2))
    core.step()
    core.step()
    assert sorted(core.penalties.request_ids()) == ["a", "b", "c"]
    assert core.abort_request("b").finish_reason == "abort"
    assert sorted(core.penalties.request_ids()) == ["a", "c"]
    core.check_integrity()
    while core.has_work():
        core.step()
    core.check_integrity()
    assert len(core.penalties) == 0


# ---- preemption keeps the counts (tiny random Llama) ----------------------------------------


def test_preempted_requests_keep_their_counts(tiny_model_dir):
    """With pages short, sequences are preempted and recomputed: their penalties still count
    the tokens they had, so the tokens equal those of a run without preemption (and differ
    from plain greedy ones)."""
    prompts = random_prompts([5, 17, 40, 64, 90], seed=11)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=1.8,
                       frequency_penalty=0.7, presence_penalty=0.3)
    requests = {f"r{i}": (prompt, p) for i, prompt in enumerate(prompts)}
    roomy = run_core(make_core(tiny_model_dir, async_scheduling=True), requests)
    short = make_core(tiny_model_dir, num_pages=40, enable_prefix_cache=False,
                      async_scheduling=True)
    assert run_core(short, requests) == roomy
    assert short.scheduler.num_preemptions > 0
    plain = hf_greedy(tiny_model_dir, prompts, 32)
    assert [roomy[f"r{i}"] for i in range(len(prompts))] != plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_gives_the_cpu_engines_adjusted_tokens(tiny_model_dir):
    """fp32 tiny Llama on CUDA (graphs, Triton argmax, async scheduling): the same tokens as
    the CPU engine for every adjustment, in one batch with a plain request."""
    from engine.config import EngineConfig
    from engine.core import EngineCore

    prompts = random_prompts([9, 30, 50, 17], seed=5)
    plain = hf_greedy(tiny_model_dir, prompts[:1], 32)[0]
    stop = plain[2]  # greedy stops at its 3rd token; min_tokens makes it go on
    base = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
    requests = {
        "plain": (prompts[0], SamplingParams(**base)),
        "min_tokens": (prompts[0], SamplingParams(**base, stop_token_ids=(stop,),
                                                  min_tokens=8)),
        "repetition": (prompts[1], SamplingParams(**base, repetition_penalty=1.7)),
        "bias": (prompts[2], SamplingParams(**base, logit_bias=((7, 3.0), (plain[0], -5.0)))),
        "frequency": (prompts[3], SamplingParams(**base, frequency_penalty=1.2,
                                                 presence_penalty=0.4)),
        "sampled": (prompts[1], SamplingParams(max_tokens=32, temperature=0.8, seed=7,
                                               repetition_penalty=1.3, ignore_eos=True)),
    }
    cpu = run_core(make_core(tiny_model_dir, async_scheduling=True), requests)
    assert cpu["plain"] == plain and len(cpu["min_tokens"]) > 8
    assert cpu["min_tokens"][8:].count(stop) <= 1 and stop not in cpu["min_tokens"][:8]
    gpu = run_core(EngineCore(EngineConfig(model=tiny_model_dir, device="cuda", dtype="float32",
                                           page_size=16, num_pages=128, max_num_seqs=16)),
                   requests)
    greedy_ids = [k for k in requests if k != "sampled"]
    assert {k: gpu[k] for k in greedy_ids} == {k: cpu[k] for k in greedy_ids}
    assert len(gpu["sampled"]) == 32
