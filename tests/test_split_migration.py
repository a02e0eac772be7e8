"""BlockLLM's split migration between two engine cores (shm and tcp): the receiver computes
the head of a context as a request of its own while the sender copies the tail into the
receiver's reservation (`prep_recv(own=k)`); on commit or start_generate the receiver grafts
the head's cached pages before the received tail. The receiver's KV equals the sender's to the
byte, later requests find the whole context cached and give the sender's greedy tokens, and
a head that is not there when the reservation is adopted is computed again rather than
served wrong."""

from __future__ import annotations

import pytest
import torch
from test_engine_core import random_prompts
from test_kv_exchange import (PAGE, answered, assert_clean, generate, pair, prompts,  # noqa: F401
                              reset, send)

from microserve.backend import MicroservingError
from microserve.messages import CommitResponse, SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def compute_head(core, rid, tokens) -> None:
    """The receiver's own part: a one-token request for prompt[:own], whose whole pages it
    caches when it ends."""
    core.add_request(rid, tokens, ONE)
    while core.has_work():
        core.step()


def slots_of(core, tokens) -> torch.Tensor:
    match = core.kv.cache.match(tokens)
    assert match.matched_len == len(tokens) // PAGE * PAGE
    return torch.tensor([p * PAGE + k for p in match.pages for k in range(PAGE)])


def test_the_receiver_computes_the_head_while_the_sender_copies_the_tail(pair):
    p, d = pair
    reset(p, d)
    context, question = random_prompts([70, 9], seed=21)
    want, _ = generate(p, "on-p", context + question)  # p caches the context
    r = d.exchange.prep_recv("split", context, len(context), None, own=32)
    assert (r.matched, r.kv_addr.begin, r.kv_addr.end, r.kv_addr.num_slots) == (0, 32, 70, 38)
    compute_head(d, "split-head", context[:32])  # on D, meanwhile
    sent = send(p, "split", context, 32, len(context), r.kv_addr)
    # P copies its cached pages [32, 68) and computes the last partial page's 2 tokens
    assert (sent.sent, sent.computed, sent.reused) == (38, 2, 36)
    assert d.exchange.commit("split", pin=False) == CommitResponse(cached=68, pinned=False)
    assert d.exchange.counters["kv_tokens_received"] >= 38
    # the head computed here, the tail copied: the sender's KV to the byte
    assert torch.equal(d.transfer.kv.flatten(2, 3)[:, :, slots_of(d, context)],
                       p.transfer.kv.flatten(2, 3)[:, :, slots_of(p, context)])
    tokens, cached = generate(d, "after", context + question)
    assert cached == 68 and tokens == want
    assert_clean(p, d)


def test_a_split_generate_adopts_the_grafted_head(pair):
    """start_generate after the split, as a strategy would run it: D computes nothing of the
    context again."""
    p, d = pair
    reset(p, d)
    (prompt,) = random_prompts([53], seed=22)
    want, _ = generate(p, "ref", prompt)
    r = d.exchange.prep_recv("gen", prompt, -1, None, own=24)
    compute_head(d, "gen-head", prompt[:24])
    send(p, "gen", prompt, 24, len(prompt) - 1, r.kv_addr)
    tokens, cached = generate(d, "gen", prompt, begin=len(prompt) - 1)
    assert cached == len(prompt) - 1 and tokens == want
    assert_clean(p, d)


def test_a_head_that_is_not_there_is_computed_again_not_served(pair):
    """Nobody computed the head on D: commit caches nothing past what D matched, and a
    generation adopting the reservation recomputes from there (the received tail's KV is
    written again, with the same values): the tokens are still right."""
    p, d = pair
    reset(p, d)
    (prompt,) = random_prompts([40], seed=23)
    want, _ = generate(p, "ref", prompt)
    r = d.exchange.prep_recv("nohead", prompt, len(prompt), None, own=16)
    send(p, "nohead", prompt, 16, len(prompt), r.kv_addr)
    assert d.exchange.commit("nohead", pin=False) == CommitResponse(cached=0, pinned=False)
    assert d.kv.cache.match(prompt).matched_len == 0
    r = d.exchange.prep_recv("nohead2", prompt, -1, None, own=16)
    send(p, "nohead2", prompt, 16, len(prompt) - 1, r.kv_addr)
    tokens, cached = generate(d, "nohead2", prompt, begin=len(prompt) - 1)
    assert cached == 0 and tokens == want  # computed whole on D
    assert_clean(p, d)


@pytest.mark.parametrize("own,why", [(6, "own 6 must be a multiple of the page size 4 in "
                                        r"\[0, end 40\)"),
                                     (40, r"own 40 must be a multiple .* \[0, end 40\)")])
def test_an_own_part_that_is_not_whole_pages_before_the_end_is_refused(pair, own, why):
    p, d = pair
    (prompt,) = random_prompts([40], seed=24)
    with pytest.raises(MicroservingError, match=why) as e:
        d.exchange.prep_recv("bad-own", prompt, len(prompt), None, own=own)
    assert (e.value.status, e.value.param) == (400, "own")
    assert_clean(p, d)
