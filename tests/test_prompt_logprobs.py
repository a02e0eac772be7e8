"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token scored by the model's
distribution after the tokens before it, as Hugging Face's forward pass over the whole prompt
gives it. What completions' `echo` with `logprobs` returns, and lm-evaluation-harness scores.

The real engine core on the tiny Llama (CPU, fp32): prompts prefilled in chunks across steps,
beside other requests, over a prefix another request cached, and through a preemption; the
logprobs equal Hugging Face's log-softmax and the top ids are Hugging Face's, in order.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _hf_model, hf_greedy
from test_engine_core import greedy, make_core, random_prompts, run_all

from microserve.backend import MicroservingError
from microserve.messages import SamplingParams

TOP = 3


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the log-distribution of token p + 1."""
    with torch.no_grad():
        logits = _hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1]
    return logits.double().log_softmax(dim=-1)


def scoring(max_tokens: int = 2, top: int = TOP) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=top)


def collect(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Run `requests` to the end; each one's tokens and its prompt logprobs (first output)."""
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in requests}
    scores = {}
    while core.has_work():
        for out in core.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in scores, "prompt logprobs sent twice"
                scores[out.request_id] = out.prompt_logprobs
            tokens[out.request_id] += out.token_ids
    return {rid: (tokens[rid], scores.get(rid)) for rid in requests}


def assert_hf_scores(model_dir: str, prompt: list[int], scores, top: int = TOP) -> None:
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert len(scores) == len(prompt) and scores[0] is None
    for j in range(1, len(prompt)):
        entry, row = scores[j], ref[j - 1]
        assert entry.token_id == prompt[j]
        assert entry.logprob == pytest.approx(float(row[prompt[j]]), abs=1e-4), j
        assert [t for t, _ in entry.top] == row.topk(top).indices.tolist(), j
        assert [v for _, v in entry.top] == pytest.approx(row.topk(top).values.tolist(),
                                                          abs=1e-4)


def test_prompt_logprobs_equal_hf_across_chunks_beside_other_requests(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=16)  # 40 tokens: 3 chunks
    prompts = random_prompts([40, 9, 2, 23])
    requests = {f"s{i}": (p, scoring()) for i, p in enumerate(prompts)}
    requests["plain"] = (random_prompts([30])[0], greedy(3))
    got = collect(core, requests)
    want = hf_greedy(tiny_model_dir, prompts, 2)
    for i, prompt in enumerate(prompts):
        tokens, scores = got[f"s{i}"]
        assert tokens == want[i]
        assert_hf_scores(tiny_model_dir, prompt, scores)
    assert got["plain"][1] is None
    core.check_integrity()


def test_a_cached_prefix_is_computed_again_to_be_scored(tiny_model_dir):
    core = make_core(tiny_model_dir)
    prompt = random_prompts([37])[0]
    assert collect(core, {"warm": (prompt, greedy(1))})["warm"][1] is None
    out = collect(core, {"scored": (prompt, scoring(top=0))})["scored"][1]
    assert_hf_scores(tiny_model_dir, prompt, out, top=0)
    assert core.stats().prompt_tokens_computed == 2 * len(prompt)  # nothing reused
    core.check_integrity()


def test_prompt_logprobs_survive_a_preemption(tiny_model_dir):
    # 12 pages of 4: two 20-token prompts decoding 20 tokens each cannot both stay
    core = make_core(tiny_model_dir, num_pages=12, max_num_batched_tokens=8)
    prompts = random_prompts([20, 21])
    got = collect(core, {f"s{i}": (p, scoring(max_tokens=20)) for i, p in enumerate(prompts)})
    assert core.stats().preemptions > 0
    want = hf_greedy(tiny_model_dir, prompts, 20)
    for i, prompt in enumerate(prompts):
        assert got[f"s{i}"][0] == want[i]
        assert_hf_scores(tiny_model_dir, prompt, got[f"s{i}"][1])
    core.check_integrity()


def test_a_request_aborted_while_its_prompt_is_scored_ends_cleanly(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=8)
    core.add_request("r", random_prompts([30])[0], scoring())
    core.step()
    core.step()  # two chunks of 8 in, scored or on their way
    out = core.abort_request("r")
    assert (out.token_ids, out.finish_reason, out.prompt_logprobs) == ([], "abort", None)
    while core.has_work():
        assert core.step() == []
    assert core.kv.stats().used_pages == 0
    core.check_integrity()


def test_prompt_logprobs_need_the_whole_prompt_here(tiny_model_dir):
    core = make_core(tiny_model_dir)
    prompt = random_prompts([12])[0]
    with pytest.raises(MicroservingError, match="prompt_logprobs needs the whole prompt"):
        core.add_request("r", prompt, scoring(), begin=8)
    with pytest.raises(MicroservingError, match="prompt_logprobs is for a generation"):
        core.remote_send("s", prompt, 0, len(prompt), None, scoring())
    one = run_all(core, {"one": random_prompts([1])[0]})  # nothing to score: still answers
    assert len(one["one"][0]) > 0
    core.check_integrity()


def test_n_choices_score_their_prompt_once_and_a_short_request_is_not_held_up(tiny_model_dir):
    """Issue 39: an echo with logprobs and n 4 scored its prompt once per choice, one after
    the other, and a one-line request waited behind all four."""
    core = make_core(tiny_model_dir, max_num_batched_tokens=16)
    prompt = random_prompts([64])[0]  # 4 steps of 16 to score
    short = random_prompts([3], seed=1)[0]
    for i in range(4):
        core.add_request(f"c{i}", prompt, scoring())
    core.add_request("short", short, greedy(2))
    first_at, scores, steps = {}, {}, 0
    while core.has_work():
        steps += 1
        for out in core.step():
            first_at.setdefault(out.request_id, steps)
            if out.prompt_logprobs is not None:
                scores[out.request_id] = out.prompt_logprobs
    # c0 scores the prompt in steps 1-4; then the short request, c1-c3 (which take c0's
    # scores and reuse its 15 whole pages below the last token) all start in step 5. Scored
    # once per choice, the short request's first token came in step 17.
    assert first_at == {"c0": 4, "c1": 5, "c2": 5, "c3": 5, "short": 5}
    assert core.stats().prompt_tokens_computed == 64 + 3 * 4 + 3
    for i in range(4):
        assert scores[f"c{i}"] == scores["c0"]
    assert_hf_scores(tiny_model_dir, prompt, scores["c0"])
    core.check_integrity()


def test_a_choice_scoring_a_different_top_computes_its_own_scores(tiny_model_dir):
    core = make_core(tiny_model_dir, max_num_batched_tokens=16)
    prompt = random_prompts([40])[0]
    got = collect(core, {"top3": (prompt, scoring()), "top1": (prompt, scoring(top=1)),
                         "plain": (prompt, greedy(2))})
    assert_hf_scores(tiny_model_dir, prompt, got["top3"][1])
    assert_hf_scores(tiny_model_dir, prompt, got["top1"][1], top=1)
    assert got["plain"][1] is None
    # top1 cannot take top3's scores: it computes the prompt again; plain reuses its pages
    assert core.stats().prompt_tokens_computed == 40 + 40 + 4
    core.check_integrity()
