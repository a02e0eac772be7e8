import dataclasses
import math
from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, TokenMask, make_generator
from microserve.messages import SamplingParams

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]

NUCLEUS_PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kwargs)


def random_logits(rows: int, vocab: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator).to(device)


def draw_many(sampler, probs, n, device, **kwargs) -> Counter:
    """n unseeded draws from one distribution, as one batch of n identical rows."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous().to(device)
    result = sampler.sample(logits, [params(**kwargs)] * n, [None] * n)
    return Counter(result.token_ids)


def test_greedy_equals_argmax(device):
    logits = random_logits(8, 100, seed=0, device=device)
    logits[3, 10] = logits[3, 70] = logits[3].max() + 1  # a tie: the lower id wins
    sampler = Sampler(100, device, seed=0)
    result = sampler.sample(logits, [params(temperature=0.0)] * 8, [None] * 8)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.token_ids[3] == 10
    assert result.logprobs == [None] * 8


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_is_greedy_at_any_temperature(device, temperature):
    logits = random_logits(6, 100, seed=1, device=device)
    sampler = Sampler(100, device, seed=0)
    result = sampler.sample(logits, [params(temperature=temperature, top_k=1)] * 6, [None] * 6)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_only_samples_the_nucleus(device):
    sampler = Sampler(4, device, seed=0)
    counts = draw_many(sampler, NUCLEUS_PROBS, 2000, device, top_p=0.8)
    assert set(counts) == {0, 1}
    # Within the nucleus the renormalised odds are 0.5 : 0.3.
    assert abs(counts[0] / 2000 - 0.625) < 0.05
    # Just past the boundary the third token joins; at 0.5 the top token alone reaches it.
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, top_p=0.81)) == {0, 1, 2}
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, top_p=0.5)) == {0}


def test_top_p_boundary_survives_float_rounding(device):
    # 0.4 + 0.2 + 0.2 reaches 0.8 exactly, but in float32 it sums one ulp short; the tie among the
    # 0.2s goes to the lower ids.
    sampler = Sampler(4, device, seed=0)
    assert set(draw_many(sampler, [0.4, 0.2, 0.2, 0.2], 2000, device, top_p=0.8)) == {0, 1, 2}


def test_top_k_only_samples_the_top_k(device):
    sampler = Sampler(5, device, seed=0)
    probs = [0.15, 0.3, 0.2, 0.1, 0.25]  # top 2: ids 1 and 4
    counts = draw_many(sampler, probs, 2000, device, top_k=2)
    assert set(counts) == {1, 4}
    assert set(draw_many(sampler, probs, 2000, device, top_k=3)) == {1, 2, 4}


def test_top_k_then_top_p(device):
    # top_k=3 keeps 0.3, 0.25, 0.2 -> renormalised 0.4, 0.33, 0.27; top_p=0.6 keeps the first two.
    sampler = Sampler(5, device, seed=0)
    counts = draw_many(sampler, [0.15, 0.3, 0.2, 0.1, 0.25], 2000, device, top_k=3, top_p=0.6)
    assert set(counts) == {1, 4}


def test_min_p_only_samples_tokens_near_the_top(device):
    """min_p drops tokens less likely than min_p x the most likely (0.5 here): with 0.5 the
    floor is 0.25, so 0.3 and 0.5 stay (odds 0.5 : 0.3 renormalised); with 0.6 only the top
    token; at 0 nothing is dropped."""
    sampler = Sampler(4, device, seed=0)
    counts = draw_many(sampler, NUCLEUS_PROBS, 2000, device, min_p=0.5)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.625) < 0.05
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, min_p=0.6)) == {0}
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, min_p=0.0)) == {0, 1, 2, 3}
    # after temperature: at 2.0 the probabilities flatten to ~0.42, 0.32, 0.16, 0.08 (a floor
    # of 0.21 at min_p 0.5 keeps two); at 0.5 they sharpen to 0.70, 0.25, ... (0.35: one)
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, min_p=0.5, temperature=2.0)) == {
        0, 1, 2}
    assert set(draw_many(sampler, NUCLEUS_PROBS, 2000, device, min_p=0.5, temperature=0.5)) == {0}


def test_min_p_before_top_p(device):
    """vLLM's order: min_p 0.25 drops 0.05 (floor 0.125), then top_p 0.82 over the rest
    (0.5, 0.3, 0.15 renormalised to 0.526, 0.316, 0.158: mass before the third 0.842, not
    below 0.82) drops the third; top_p first would have kept it (mass before it 0.8), and
    min_p after that too (0.15 >= 0.25 x 0.5)."""
    sampler = Sampler(4, device, seed=0)
    assert set(draw_many(sampler, NUCLEUS_PROBS, 3000, device, min_p=0.25, top_p=0.82)) == {
        0, 1}
    assert set(draw_many(sampler, NUCLEUS_PROBS, 3000, device, min_p=0.25, top_p=0.85)) == {
        0, 1, 2}


def test_min_p_one_at_any_temperature_is_greedy(device):
    """min_p 1 keeps only the most likely token (ties aside): the argmax, sampled or not."""
    logits = random_logits(6, 100, seed=7, device=device)
    sampler = Sampler(100, device, seed=0)
    result = sampler.sample(logits, [params(temperature=1.3, min_p=1.0)] * 6, [None] * 6)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_temperature_sharpens_and_flattens(device):
    sampler = Sampler(4, device, seed=0)
    n = 4000
    freq = {}
    for temperature in (0.5, 1.0, 2.0):
        counts = draw_many(sampler, NUCLEUS_PROBS, n, device, temperature=temperature)
        freq[temperature] = [counts[i] / n for i in range(4)]
    assert freq[0.5][0] > freq[1.0][0] > freq[2.0][0]  # the top token gains as T falls
    assert freq[0.5][3] < freq[1.0][3] < freq[2.0][3]  # the tail gains as T rises
    for temperature, observed in freq.items():
        weights = [p ** (1 / temperature) for p in NUCLEUS_PROBS]
        expected = [w / sum(weights) for w in weights]
        for o, e in zip(observed, expected):
            assert abs(o - e) < 5 * math.sqrt(e * (1 - e) / n)


SEEDED = params(temperature=1.0)
SEEDED_NUCLEUS = params(temperature=0.8, top_p=0.9, top_k=40)


def sample_alone(device, row_params, seed, steps, vocab=50):
    sampler = Sampler(vocab, device, seed=123)
    generator = make_generator(seed, device)
    tokens = []
    for step in range(steps):
        logits = random_logits(1, vocab, seed=1000 + step, device=device)
        tokens += sampler.sample(logits, [row_params], [generator]).token_ids
    return tokens


@pytest.mark.parametrize("row_params", [SEEDED, SEEDED_NUCLEUS], ids=["plain", "top_k_top_p"])
def test_same_seed_same_tokens_alone_and_in_a_batch(device, row_params):
    vocab, steps, position = 50, 20, 3
    alone = sample_alone(device, replace_seed(row_params, 7), seed=7, steps=steps)
    assert len(set(alone)) > 5  # actually random, not stuck on one token

    others = [
        params(temperature=0.7, top_p=0.5, seed=99),
        params(temperature=1.3),
        params(temperature=0.0, logprobs=2),
        params(temperature=1.0, top_k=3, seed=7),  # same seed, own generator
    ]
    batch_params = others[:position] + [replace_seed(row_params, 7)] + others[position:]
    batch_generators = [make_generator(p.seed, device) for p in batch_params]
    sampler = Sampler(vocab, device, seed=456)
    in_batch = []
    for step in range(steps):
        logits = random_logits(5, vocab, seed=2000 + step, device=device)
        logits[position] = random_logits(1, vocab, seed=1000 + step, device=device)[0]
        result = sampler.sample(logits, batch_params, batch_generators)
        in_batch.append(result.token_ids[position])
    assert in_batch == alone


def replace_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(p, seed=seed)


def test_different_seeds_different_tokens(device):
    first = sample_alone(device, params(seed=1), seed=1, steps=20)
    second = sample_alone(device, params(seed=2), seed=2, steps=20)
    assert first != second
    assert first == sample_alone(device, params(seed=1), seed=1, steps=20)


def test_greedy_row_does_not_advance_its_generator(device):
    sampler = Sampler(50, device, seed=0)
    generator = make_generator(5, device)
    logits = random_logits(1, 50, seed=3, device=device)
    sampler.sample(logits, [params(temperature=0.0, seed=5)], [generator])
    assert torch.equal(generator.get_state(), make_generator(5, device).get_state())


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.7])
def test_logprobs_are_of_the_raw_logits(device, temperature):
    vocab = 100
    logits = random_logits(3, vocab, seed=4, device=device)
    row_params = [
        params(temperature=temperature, logprobs=5, seed=11),
        params(temperature=temperature, logprobs=0, seed=12),
        params(temperature=temperature, seed=13),
    ]
    generators = [make_generator(p.seed, device) for p in row_params]
    result = Sampler(vocab, device, seed=0).sample(logits, row_params, generators)

    raw = torch.log_softmax(logits.cpu().double(), dim=-1)
    top_values, top_ids = raw.topk(5, dim=-1)
    first, second, third = result.logprobs
    assert first.token_id == result.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-5)
    assert [t for t, _ in first.top] == top_ids[0].tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values[0].tolist(), abs=1e-5)
    assert second.token_id == result.token_ids[1]
    assert second.logprob == pytest.approx(raw[1, second.token_id].item(), abs=1e-5)
    assert second.top == []
    assert third is None


def test_mixed_batch_gives_each_row_what_it_would_alone(device):
    vocab = 64
    logits = random_logits(7, vocab, seed=5, device=device)
    row_params = [
        params(temperature=0.0),
        params(temperature=0.9, top_p=0.8, seed=21, logprobs=3),
        params(temperature=0.0, logprobs=2),
        params(temperature=1.2, seed=22),
        params(temperature=0.6, top_k=5, seed=23),
        params(temperature=1.0, top_k=1, logprobs=1),
        params(temperature=1.1, min_p=0.2, seed=24),
    ]
    batch = Sampler(vocab, device, seed=0).sample(
        logits, row_params, [make_generator(p.seed, device) for p in row_params]
    )
    for i, p in enumerate(row_params):
        alone = Sampler(vocab, device, seed=1).sample(
            logits[i : i + 1], [p], [make_generator(p.seed, device)]
        )
        assert batch.token_ids[i] == alone.token_ids[0]
        assert batch.logprobs[i] == alone.logprobs[0]
    assert batch.token_ids[0] == logits[0].argmax().item()
    assert [lp is None for lp in batch.logprobs] == [True, False, False, True, True, False, True]


def test_padded_vocab_columns_are_never_sampled(device):
    logits = torch.zeros(200, 8, device=device)
    logits[:, 6:] = 100.0  # a padded lm_head's extra columns
    sampler = Sampler(6, device, seed=0)
    row_params = [params()] * 100 + [params(temperature=0.0)] * 100
    result = sampler.sample(logits, row_params, [None] * 200)
    assert max(result.token_ids) < 6


def _bitmask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """The int32 bitmask (bit t % 32 of word t // 32) allowing exactly `allowed` per row."""
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_mask_gives_the_argmax_of_the_allowed_tokens(device):
    """Masked rows choose among their allowed tokens only (bits in every word position, the
    sign bit included); the unmasked row and the logprobs (raw distribution) are untouched."""
    vocab = 100
    logits = random_logits(3, vocab, seed=1, device=device)
    allowed = [[5, 31, 63, 64, 99], [0, 32]]
    mask = TokenMask(rows=[0, 2], bitmask=_bitmask(allowed, vocab))
    sampler = Sampler(vocab, device, seed=0)
    before = logits.clone()
    result = sampler.sample(logits, [params(temperature=0.0, logprobs=0)] * 3, [None] * 3)
    assert result.token_ids == logits.argmax(dim=-1).tolist()  # no mask set: unconstrained
    result = sampler.sample(logits, [params(temperature=0.0, logprobs=0)] * 3, [None] * 3, mask)
    expected = [max(allowed[0], key=lambda t: logits[0, t].item()),
                logits[1].argmax().item(),
                max(allowed[1], key=lambda t: logits[2, t].item())]
    assert result.token_ids == expected
    raw = logits.log_softmax(dim=-1)
    assert [lp.logprob for lp in result.logprobs] == pytest.approx(
        [raw[i, t].item() for i, t in enumerate(expected)])
    assert torch.equal(logits, before)  # not modified


def test_masked_sampling_draws_only_allowed_tokens(device):
    vocab, n = 64, 400
    logits = torch.zeros(n, vocab, device=device)  # uniform: any token is as likely
    allowed = [3, 40, 63]
    mask = TokenMask(rows=list(range(n)), bitmask=_bitmask([allowed] * n, vocab))
    sampler = Sampler(vocab, device, seed=0)
    result = sampler.sample(logits, [params(temperature=1.0, top_p=0.9)] * n, [None] * n,
                            mask=mask)
    assert set(result.token_ids) == set(allowed)


def _whole_sort_filter(sampler: Sampler, logits: torch.Tensor, ps: list) -> torch.Tensor:
    """The filter by sorting every whole row: what the candidates path must reproduce."""
    vocab = logits.shape[-1]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in ps],
                     device=logits.device)
    top_p = torch.tensor([p.top_p for p in ps], device=logits.device)
    out = sampler._sorted_top_k_top_p(logits, k, top_p)
    untouched = torch.tensor([p.top_k <= 0 and p.top_p >= 1.0 for p in ps], device=logits.device)
    return torch.where(untouched[:, None], logits, out)


@pytest.mark.parametrize("scale,ties", [(3.0, False), (3.0, True), (0.3, False), (8.0, True)])
def test_top_k_top_p_from_candidates_equals_sorting_every_row(device, monkeypatch, scale, ties):
    """The rows' 64 most likely tokens first (TOP_CANDIDATES shrunk from 1,024 for a small
    vocabulary), the whole sort only where they do not settle the nucleus: the same kept set
    and logits as sorting every row, with ties (bf16-rounded logits: equal values keep the
    lower id first), top-k inside and past the candidates, flat rows whose nucleus reaches
    past them, and rows with neither filter left bit-identical."""
    import engine.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", 64)
    vocab = 3000
    logits = random_logits(16, vocab, seed=7, device=device) * scale
    if ties:
        logits = logits.to(torch.bfloat16).float()
    logits[15] = 0.5  # a flat row: every token tied
    sampler = Sampler(vocab, device, seed=0)
    assert sampler.candidates_first == (device.type == "cpu")
    sampler.candidates_first = True  # (a GPU's sampler sorts every row: test the path there too)
    cases = [params(top_p=0.9), params(top_p=0.5), params(top_k=10), params(top_k=64),
             params(top_k=65), params(top_k=500, top_p=0.7), params(top_k=20, top_p=0.95),
             params(), params(top_p=0.999), params(top_p=1e-9), params(top_k=1),
             params(top_p=0.3), params(top_k=vocab), params(top_k=3000, top_p=0.8),
             params(top_p=0.99), params(top_p=0.9)]
    got = sampler._apply_top_k_top_p(logits, cases)
    want = _whole_sort_filter(sampler, logits, cases)
    assert torch.equal(got, want)
    assert torch.equal(got[7], logits[7])  # no filter: untouched
    assert (got[9] > float("-inf")).sum() == 1  # a tiny top_p keeps the most likely token
    # the candidates settled the rows whose nucleus they hold (this test would pass vacuously
    # if none were), not the flat row's nor a top-k past them
    _, settled = Sampler._nucleus_of_candidates(
        logits, torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in cases],
                             device=device),
        torch.tensor([p.top_p for p in cases], device=device), 64)
    assert settled[[2, 9, 10]].all() and not settled[15] and not settled[4]
