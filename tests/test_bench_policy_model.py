"""bench.scripts.policy_model: the discrete-event model of one engine's seats under a
scheduling policy, on cases small enough to follow step by step."""

import pytest

from bench.scripts import policy_model as pm

UNIT = pm.StepModel(fixed_s=1.0, per_seq_s=0.0, per_prompt_token_s=0.0)  # every step 1 s


def jobs():
    # A: 1 prompt token, 10 out, at 0; B: 1 prompt token, 2 out, at 0.5 s
    return [pm.Job(0.0, 1, 10, order=0), pm.Job(0.5, 1, 2, order=1)]


def times(done):
    return [(j.first, j.done) for j in done]


def test_fcfs_runs_the_first_to_its_end_on_one_seat():
    done = pm.simulate(jobs(), "fcfs", UNIT, seats=1, budget=64)
    # A: its prompt step ends at 1 (first token), 9 decodes to 10; B then 11, 12
    assert times(done) == [(1.0, 10.0), (11.0, 12.0)]


def test_srpt_takes_the_seat_and_the_preempted_one_recomputes_past_its_pages():
    done = pm.simulate(jobs(), "srpt", UNIT, seats=1, budget=64)
    # B (1 left to A's 9) takes the seat at 1: prompt at 2, its last token at 3. A comes back
    # holding no whole page: the step at 4 computes its 2 tokens again and samples its 2nd,
    # then 8 decodes to 12.
    assert times(done) == [(1.0, 12.0), (2.0, 3.0)]


def test_a_starved_sequence_is_promoted_to_the_end():
    # C: a long job that a stream of short ones would starve under srpt
    work = [pm.Job(0.0, 1, 4, order=0)] + [pm.Job(0.5 + i, 1, 1, order=1 + i) for i in range(8)]
    never = pm.simulate(work, "srpt", UNIT, seats=1, budget=64, starvation_s=100.0)
    bound = pm.simulate(work, "srpt", UNIT, seats=1, budget=64, starvation_s=2.5)
    # never: each short job takes the seat as it comes (one step each, the last ends at 9);
    # C then recomputes and samples its 2nd token (10) and decodes its last 2 (12)
    assert never[0].done == 12.0
    # starved since 1: promoted in the loop at 4 (3 s > 2.5), it goes before B4 (waiting
    # since 3.5, not starved yet at 6) and ends at 7
    assert bound[0].done == 7.0
    assert [j.done for j in bound[1:]] == [2.0, 3.0, 4.0, 8.0, 9.0, 10.0, 11.0, 12.0]


def test_mlfq_demotes_after_its_quantum():
    model = pm.StepModel(fixed_s=0.01, per_seq_s=0.0, per_prompt_token_s=0.0)
    [job] = pm.simulate([pm.Job(0.0, 1, 100, order=0)], "mlfq", model, seats=1, budget=64)
    # quanta of 8, 16, 32, 64 one-token steps: queue 3 after 8 + 16 + 32 = 56 steps
    assert job.level == 3 and job.done == pytest.approx(1.0)


def test_the_workload_is_bench_serves():
    from types import SimpleNamespace

    from bench.serve import workload
    args = SimpleNamespace(seed=3, workload="heavy-tail", input_len="", output_len="",
                           max_len=1024, num_requests=50, vocab=10, prompt_seed=None)
    lengths = [(len(p), n) for p, n in workload(args)]
    assert [(j.prompt, j.output) for j in pm.workload(50, 10.0, 3, 1024)] == lengths
