"""What a scheduling policy can gain on one engine with a seat limit: a discrete-event model.

    python -m bench.scripts.policy_model --rates 22,28,32,36 --requests 1200

It replays bench.serve's heavy-tail workload (the same lengths and Poisson arrivals for every
policy, `--seed`) through a model of the engine's step loop: at most `--seats` sequences run;
each step decodes every running sequence that has its prompt and computes up to `--budget`
prompt tokens; a step takes

    step = fixed + per_seq * running + per_prompt_token * prompt tokens in it

fitted to the H200's `bench.policies` runs of 2026-11-28 (docs/benchmarks.md). Policies:

    fcfs      arrival order, no preemption
    mlfq      the engine's skip-join MLFQ (engine/policies.py): quanta of predicted step
              seconds, doubling per queue; a waiting sequence takes the seat of a running one
              in a lower queue; the seat given up costs a re-admission (its last partial page
              recomputed)
    srpt      an oracle: least remaining output tokens first, preemptive (the bound no policy
              that does not know output lengths reaches)
    sjf       an oracle: least total output tokens first, preemptive (the engine's `priority`
              with each request's output length as its priority)
    mlfq-hold mlfq, but a starved sequence stays at the top until it ends (as under
              `priority`) instead of for one quantum

Every policy but fcfs promotes a sequence that has not run for `--starvation-s`, as the
engine does (engine/policies.py); srpt and sjf to the top until it ends.

It prints mean and p99 JCT and TTFT per policy and rate, and each policy's mean JCT ratio to
fcfs's, and its p99 JCT's: the ceiling on what reordering can gain here, before anything the
real engine loses to preemption beyond the model's re-admission cost.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from bench.serve import WORKLOADS, draw_len

PAGE = 16


@dataclass
class StepModel:
    fixed_s: float = 0.005
    per_seq_s: float = 0.00004
    per_prompt_token_s: float = 0.0000207

    def step(self, running: int, prompt_tokens: int) -> float:
        return self.fixed_s + self.per_seq_s * running + self.per_prompt_token_s * prompt_tokens


@dataclass
class Job:
    arrival: float
    prompt: int
    output: int
    computed: int = 0  # prompt tokens computed (KV held)
    made: int = 0  # output tokens made
    first: float | None = None
    done: float | None = None
    level: int = 0
    used_s: float = 0.0
    last_ran: float = 0.0
    order: int = 0
    promoted: bool = False  # srpt, sjf: starved past the bound, at the top for good
    readmit: int = 0  # tokens a re-admission computes again before it decodes


def workload(n: int, rate: float, seed: int, max_len: int,
             specs: tuple[str, str] = WORKLOADS["heavy-tail"]) -> list[Job]:
    """bench.serve's lengths for `seed` (the same draws; `specs`: its --input-len and
    --output-len, heavy-tail's by default), Poisson arrivals."""
    rng = random.Random(seed)
    in_spec, out_spec = specs
    lengths = [(draw_len(rng, in_spec, max_len), draw_len(rng, out_spec, max_len))
               for _ in range(n)]
    clock, t, jobs = random.Random(f"arrivals/{seed}"), 0.0, []
    for i, (n_in, n_out) in enumerate(lengths):
        t += clock.expovariate(rate)
        jobs.append(Job(t, n_in, n_out, order=i))
    return jobs


def simulate(jobs: list[Job], policy: str, model: StepModel, seats: int, budget: int,
             starvation_s: float = 10.0) -> list[Job]:
    jobs = [Job(j.arrival, j.prompt, j.output, order=j.order) for j in jobs]
    base = 8 * model.step(1, 1)
    quantum = [base * 2 ** i for i in range(8)]

    def rank(j: Job) -> tuple:
        if policy == "fcfs":
            return (j.order,)
        if policy == "mlfq":
            return (j.level, j.order)
        if policy == "mlfq-hold":  # a starved sequence stays at the top until it ends
            return (not j.promoted, j.level, j.order)
        if policy == "srpt":
            return (not j.promoted, j.output - j.made, j.order)
        return (not j.promoted, j.output, j.order)  # sjf

    def join(j: Job) -> None:
        first = model.step(1, min(j.prompt, budget))  # skip-join
        j.level = next((i for i, q in enumerate(quantum) if q >= first), 7)

    def preempt(j: Job) -> None:
        """Its pages go to the prefix cache: whole pages of the KV it holds are reused on
        re-admission, the rest (with the last token, whose KV is not computed yet) is computed
        again."""
        held = j.computed + max(j.made - 1, 0)
        cached = held // PAGE * PAGE
        if j.made:
            j.readmit = j.prompt + j.made - cached
        else:
            j.computed = cached

    now, nxt = 0.0, 0
    waiting: list[Job] = []
    running: list[Job] = []
    while nxt < len(jobs) or waiting or running:
        if not waiting and not running:
            now = max(now, jobs[nxt].arrival)
        while nxt < len(jobs) and jobs[nxt].arrival <= now:
            j = jobs[nxt]
            j.last_ran = now
            join(j)
            waiting.append(j)
            nxt += 1
        for j in waiting + running if policy != "fcfs" else ():
            if now - j.last_ran > starvation_s:  # starved: promoted, as the engine does
                if policy == "mlfq":  # to queue 0 with a fresh quantum
                    j.level, j.used_s, j.last_ran = 0, 0.0, now
                else:  # to the top until it ends
                    j.promoted = True
        waiting.sort(key=rank)
        preemptive = policy != "fcfs"
        for j in list(waiting):
            if len(running) < seats:
                waiting.remove(j)
                running.append(j)
            elif preemptive:
                worst = max(running, key=rank)
                if rank(worst)[:-1] > rank(j)[:-1]:
                    running.remove(worst)
                    preempt(worst)
                    waiting.append(worst)
                    waiting.remove(j)
                    running.append(j)
                else:
                    break
            else:
                break
        # one step: decodes, then prompt chunks in rank order within the budget
        left, prompt_tokens, decoded, chunks = budget, 0, [], []
        for j in sorted(running, key=rank):
            need = (j.prompt - j.computed) + j.readmit
            if need <= 0:
                decoded.append(j)
            elif left > 0:
                n = min(need, left)
                chunks.append((j, n))
                left -= n
                prompt_tokens += n
        dt = model.step(len(decoded) + len(chunks), prompt_tokens)
        now += dt
        for j, n in chunks:
            if j.readmit:  # recomputed past its cached pages: the step samples its next token
                j.readmit -= n
                j.made += 0 if j.readmit else 1
            else:
                j.computed += n
                if j.computed == j.prompt:
                    j.first, j.made = now, 1
            j.last_ran = now
            j.used_s += model.step(1, n)
        for j in decoded:
            j.made += 1
            j.last_ran = now
            j.used_s += model.step(1, 1)
        for j in decoded + [c[0] for c in chunks]:
            if policy.startswith("mlfq") and j.used_s >= quantum[j.level] and j.level < 7:
                j.level, j.used_s = j.level + 1, 0.0
            if j.made >= j.output and j.done is None:
                j.done = now
                running.remove(j)
    return jobs


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="22,28,32,36")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--policies", default="fcfs,mlfq,mlfq-hold,srpt,sjf",
                    help="fcfs first: the others are compared to it")
    ap.add_argument("--seats", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-len", default=WORKLOADS["heavy-tail"][0],
                    help="as bench.serve's (default: the heavy-tail workload's)")
    ap.add_argument("--output-len", default=WORKLOADS["heavy-tail"][1])
    ap.add_argument("--starvation-s", type=float, default=10.0,
                    help="the engine's --scheduling-starvation-s")
    args = ap.parse_args()
    model = StepModel()
    print(f"{'rate':>5} {'policy':>9} {'JCT mean':>9} {'JCT p99':>8} {'TTFT mean':>10} "
          f"{'TTFT p99':>9} {'mean: fcfs/it':>14} {'p99: it/fcfs':>13}")
    for rate in (float(r) for r in args.rates.split(",")):
        jobs = workload(args.requests, rate, args.seed, args.max_len,
                        (args.input_len, args.output_len))
        base = None
        for policy in args.policies.split(","):
            done = simulate(jobs, policy, model, args.seats, args.budget, args.starvation_s)
            jct = [(j.done - j.arrival) * 1e3 for j in done]
            ttft = [(j.first - j.arrival) * 1e3 for j in done]
            mean, p99 = sum(jct) / len(jct), pct(jct, .99)
            base = base or (mean, p99)
            print(f"{rate:5.0f} {policy:>9} {mean:9.0f} {p99:8.0f} "
                  f"{sum(ttft) / len(ttft):10.0f} {pct(ttft, .99):9.0f} "
                  f"{base[0] / mean:14.2f} {p99 / base[1]:13.2f}")


if __name__ == "__main__":
    main()
