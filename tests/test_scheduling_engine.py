"""Scheduling policies in a real engine core (the tiny random Llama on CPU): an urgent request
behind a long batch finishes first under `priority` and `mlfq`, last under `fcfs`, and every
request's greedy tokens are the same under each policy."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_VOCAB
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.policies import SkipJoinMLFQ
from microserve.messages import SamplingParams
from test_engine_core import random_prompts

LONG, SHORT = 40, 6  # output tokens of the batch's requests and of the urgent one


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def serve(core: EngineCore) -> tuple[dict[str, list[int]], list[str]]:
    """Four long low-priority requests fill the seats; two steps later an urgent short one
    (priority 0) comes. Returns each request's tokens and the order they finished in."""
    prompts = random_prompts([30, 25, 20, 35, 12], seed=3, vocab=TINY_VOCAB)
    for i, prompt in enumerate(prompts[:4]):
        core.add_request(f"batch{i}", prompt, greedy(LONG), priority=5)
    tokens, finished, steps = {}, [], 0
    while core.has_work():
        if steps == 2:
            core.add_request("urgent", prompts[4], greedy(SHORT), priority=0)
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason is not None:
                finished.append(out.request_id)
        steps += 1
    core.check_integrity()
    assert core.kv.stats().used_pages == 0
    assert core.scheduler.policy.num_sequences == 0  # a record per sequence, none left
    return tokens, finished


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    results = {}
    for policy in ("fcfs", "priority", "mlfq"):
        core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=256,
                                       max_num_seqs=4, scheduling_policy=policy))
        results[policy] = serve(core), core
    return results


def test_greedy_tokens_do_not_depend_on_the_policy(runs):
    (fcfs_tokens, _), _ = runs["fcfs"]
    assert sorted(fcfs_tokens) == ["batch0", "batch1", "batch2", "batch3", "urgent"]
    assert [len(t) for t in fcfs_tokens.values()] == [LONG] * 4 + [SHORT]
    for policy in ("priority", "mlfq"):
        (tokens, _), _ = runs[policy]
        assert tokens == fcfs_tokens, policy


def test_fcfs_makes_the_urgent_request_wait_for_a_seat(runs):
    (_, finished), core = runs["fcfs"]
    assert finished[-1] == "urgent"
    assert core.stats().preemptions == 0


def test_priority_runs_the_urgent_request_first(runs):
    (_, finished), core = runs["priority"]
    assert finished[0] == "urgent"
    # it took the seat of the newest of the equally ranked batch, recomputed afterwards
    assert core.stats().preemptions_by_reason == {"priority": 1}


def test_mlfq_runs_the_short_job_first_and_demotes_the_long_ones(runs):
    (_, finished), core = runs["mlfq"]
    assert finished[0] == "urgent"
    policy = core.scheduler.policy
    assert isinstance(policy, SkipJoinMLFQ)
    assert policy.profile.per_token_s >= 0 and policy.base_quantum_s > 0
    assert policy.demotions > 0
    assert core.stats().mlfq_queue_requests == [0] * policy.num_levels  # all finished


def test_metrics_show_preemptions_by_reason_and_the_mlfq_queues(runs):
    from engine.frontend.core_client import format_core_stats

    _, core = runs["priority"]
    text = format_core_stats(core.stats(), core.info)
    assert 'microserve_engine_preemptions_by_reason_total{reason="priority"} 1\n' in text
    assert 'microserve_engine_preemptions_by_reason_total{reason="pages"} 0\n' in text
    assert "microserve_engine_scheduling_promotions_total 0\n" in text
    assert "mlfq" not in text  # only an mlfq engine has queues
    _, core = runs["mlfq"]
    text = format_core_stats(core.stats(), core.info)
    assert all(f'microserve_engine_mlfq_queue_requests{{level="{i}"}} 0\n' in text
               for i in range(8))


@pytest.mark.parametrize("prompt_every", [1, 4])
def test_background_requests_leave_live_work_its_steps_and_keep_their_tokens(
        runs, tiny_model_dir, prompt_every):
    """The four batch requests at BACKGROUND_PRIORITY (batch lines), under fcfs with room for
    one background row of a step: while the urgent request runs, each step emits at most one
    background token; it finishes first, in SHORT steps after its prompt's; every request's
    greedy tokens equal the plain fcfs run's, also with their prompt chunks gathered into one
    step of four."""
    from microserve.bounds import BACKGROUND_PRIORITY

    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=256,
                                   max_num_seqs=8, background_max_seqs=1,
                                   background_max_tokens=4,
                                   background_prompt_every=prompt_every))
    prompts = random_prompts([30, 25, 20, 35, 12], seed=3, vocab=TINY_VOCAB)
    for i, prompt in enumerate(prompts[:4]):
        core.add_request(f"batch{i}", prompt, greedy(LONG), priority=BACKGROUND_PRIORITY)
    tokens, finished, per_step = {}, [], []
    while core.has_work():
        if len(per_step) == 2:
            core.add_request("urgent", prompts[4], greedy(SHORT), priority=0)
        emitted = {}
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            emitted[out.request_id] = len(out.token_ids)
            if out.finish_reason is not None:
                finished.append(out.request_id)
        per_step.append(emitted)
    core.check_integrity()
    assert core.kv.stats().used_pages == 0
    (fcfs_tokens, _), _ = runs["fcfs"]
    assert tokens == fcfs_tokens
    assert finished[0] == "urgent"
    live = [i for i, e in enumerate(per_step) if "urgent" in e]
    assert len(live) == SHORT and live[-1] - live[0] == SHORT - 1  # a token every step
    # from the step after its prompt's: background rows share its steps one at a time
    assert all(sum(n for rid, n in per_step[i].items() if rid != "urgent") <= 1
               for i in live[1:])
    assert core.stats().preemptions == 0


# ---- over HTTP: a `microserve engine` process run with --scheduling-policy priority ----------


@pytest.fixture(scope="module")
def priority_engine(tiny_served_dir, tmp_path_factory):
    from daemons import Daemon, serve

    log = tmp_path_factory.mktemp("priority-engine") / "daemon.log"
    yield from serve(Daemon(tiny_served_dir, log, "tiny", "--scheduling-policy", "priority",
                            "--max-num-seqs", "1", "--page-size", "4", "--num-pages", "256",
                            "--cpu-threads", "1"))


async def test_over_http_an_urgent_request_overtakes_a_long_one_and_tokens_stay(priority_engine):
    """One seat: a long low-priority stream holds it; an urgent completion (`priority` in the
    body, as vLLM takes it) preempts it and finishes while the long one still streams. The
    long one's tokens are those it produces alone."""
    import asyncio
    import time

    import httpx

    low = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 150, "temperature": 0,
           "ignore_eos": True, "priority": 5}
    urgent = {"prompt": [20, 21, 22], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
              "priority": -1}
    async with httpx.AsyncClient(base_url=priority_engine.url + "/v1", timeout=120) as http:
        alone = (await http.post("/completions", json=low)).json()["choices"][0]["text"]
        done = {}
        started = asyncio.Event()

        async def stream_low():
            text = ""
            async with http.stream("POST", "/completions", json={**low, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        text += json.loads(line[6:])["choices"][0]["text"]
            done["low"] = time.perf_counter()
            return text

        task = asyncio.create_task(stream_low())
        await started.wait()
        response = await http.post("/completions", json=urgent)
        done["urgent"] = time.perf_counter()
        streamed = await task
        refused = await http.post("/completions", json={**urgent, "priority": -2**31 - 1})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert done["urgent"] < done["low"]
    assert streamed == alone
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    metrics = priority_engine.metrics()
    assert 'microserve_engine_preemptions_by_reason_total{reason="priority"} 1\n' in metrics
