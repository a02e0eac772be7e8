"""A model of LoRA slot pressure over two engines: how much adapter affinity can gain over round
robin when requests carry fresh prompts (nothing to share but the adapters' slots).

    python -m bench.scripts.lora_slot_model [--slots 8,16] [--skew 1.0,0]

Discrete events, no engine: each engine runs steps of its running requests (prompt chunks under
a 2,048-token budget, then one token each), a step taking 7 ms + 0.04 ms a prompt token + 0.05
ms a decoding row (fitted by hand to bench.lora_routing on two H100s, 2026-11-28, Zipf 1.0;
modelled vs measured output tokens/s: round robin 4,244 vs 3,963 at 8 slots and 5,339 vs 5,342
at 16; affinity 4,815 vs 4,933 and 5,705 vs 5,894). A waiting request runs only if its
adapter is in a slot or a slot can be had (free, or its adapter has no running request);
otherwise it waits, holding no one up, as the engine's scheduler does. A closed loop keeps
--concurrency requests in flight, each naming an adapter drawn from Zipf(--skew) (0:
uniform), 512 prompt and 128 output tokens, as bench.lora_routing sends.

Policies: `rr` (round robin), `affinity` (router/affinity.py's score, its stats polled every
0.5 s), `partition` (each adapter pinned to one engine, the popularity split evenly: it knows
the true popularity) and `no-slot-limit` (every adapter always resident: the ceiling).

What it shows: at 128 in flight with 8 slots an engine, every policy stays near 1.1-1.2x
round robin, while the ceiling is 1.46-1.6x. With 16 slots for 32 adapters, the requests of
the adapters left out wait whatever the router does; the router only chooses which ones.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict

STEP_S, PROMPT_TOKEN_S, DECODE_ROW_S, BUDGET = 0.007, 0.00004, 0.00005, 2048


class Request:
    def __init__(self, adapter: str, prompt: int, output: int):
        self.adapter, self.prompt, self.output = adapter, prompt, output
        self.computed = self.produced = 0


class Engine:
    def __init__(self, slots: int, adapters: list[str]):
        self.slots = slots
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # adapter -> its running requests, least recently used first; the first `slots`
        # registered start resident, as an engine given --lora-modules fills free slots
        self.resident: OrderedDict[str, int] = OrderedDict((a, 0) for a in adapters[:slots])
        self.open: dict[str, int] = {}  # the router's open calls, by adapter
        self.open_calls = 0
        self.polled: tuple[set[str], int] = (set(self.resident), 0)
        self.busy = False

    def acquire(self, adapter: str) -> bool:
        if adapter in self.resident:
            self.resident[adapter] += 1
            self.resident.move_to_end(adapter)
            return True
        idle = next((a for a, n in self.resident.items() if n == 0), None)
        if len(self.resident) < self.slots or idle is not None:
            if len(self.resident) >= self.slots:
                del self.resident[idle]
            self.resident[adapter] = 1
            return True
        return False

    def step(self) -> tuple[float, list[Request]]:
        for r in list(self.waiting):
            if self.acquire(r.adapter):
                self.waiting.remove(r)
                self.running.append(r)
        budget, prompt_tokens, rows = BUDGET, 0, 0
        for r in self.running:
            if r.computed < r.prompt:
                n = min(budget, r.prompt - r.computed)
                r.computed += n
                budget -= n
                prompt_tokens += n
                r.produced += r.computed == r.prompt
            else:
                r.produced += 1
                rows += 1
        done = [r for r in self.running if r.produced >= r.output]
        for r in done:
            self.running.remove(r)
            self.resident[r.adapter] -= 1
        return STEP_S + PROMPT_TOKEN_S * prompt_tokens + DECODE_ROW_S * rows, done


def draws(n: int, adapters: list[str], skew: float, seed: int) -> list[str]:
    weights = [1 / (k + 1) ** skew for k in range(len(adapters))]
    return random.Random(seed).choices(adapters, weights, k=n)


def affinity(request: Request, engines: list[Engine]) -> Engine:
    """router/affinity.py's score with its default weights (no prefix: fresh prompts)."""
    loads = [e.open_calls + e.polled[1] for e in engines]
    most = max(loads)

    def score(e: Engine, load: int) -> float:
        if request.adapter in e.open or request.adapter in e.polled[0]:
            part = 1.0
        elif len(e.open) >= e.slots:
            part = 0.3
        else:
            part = 0.8 if len(e.polled[0]) < e.slots else 0.6
        return part + 0.5 * (1 - load / most if most else 1)

    return max(zip(engines, loads), key=lambda el: score(*el))[0]


def partition(adapters: list[str], skew: float) -> dict[str, int]:
    """Each adapter to the engine with the least popularity so far, most popular first."""
    mass, home = [0.0, 0.0], {}
    for k, a in enumerate(adapters):
        home[a] = min((0, 1), key=lambda j: mass[j])
        mass[home[a]] += 1 / (k + 1) ** skew
    return home


def run(policy: str, slots: int, skew: float, seed: int, requests: int = 512,
        concurrency: int = 128, adapters: int = 32) -> float:
    """Output tokens/s of one closed-loop run."""
    names = [f"a{i}" for i in range(adapters)]
    order = draws(requests, names, skew, seed)
    limit = adapters if policy == "no-slot-limit" else slots
    engines = [Engine(limit, names), Engine(limit, names)]
    home = partition(names, skew)
    events: list = []
    tick, sent, finished, now = [0], [0], 0, 0.0

    def at(t: float, what: object) -> None:
        tick[0] += 1
        heapq.heappush(events, (t, tick[0], what))

    def send() -> None:
        r = Request(order[sent[0]], 512, 128)
        if policy == "affinity":
            e = affinity(r, engines)
        elif policy == "partition":
            e = engines[home[r.adapter]]
        else:
            e = engines[sent[0] % 2]
        sent[0] += 1
        r.engine = e
        e.open[r.adapter] = e.open.get(r.adapter, 0) + 1
        e.open_calls += 1
        e.waiting.append(r)
        if not e.busy:
            e.busy = True
            at(now, e)

    for _ in range(concurrency):
        send()
    at(0.5, "poll")
    while finished < requests:
        now, _, what = heapq.heappop(events)
        if what == "poll":
            for e in engines:
                e.polled = (set(e.resident), len(e.running) + len(e.waiting))
            at(now + 0.5, "poll")
            continue
        e = what
        if not e.running and not e.waiting:
            e.busy = False
            continue
        took, done = e.step()
        for r in done:
            finished += 1
            e.open[r.adapter] -= 1
            if not e.open[r.adapter]:
                del e.open[r.adapter]
            e.open_calls -= 1
            if sent[0] < requests:
                send()
        at(now + took, e)
    return requests * 128 / now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="8,16")
    ap.add_argument("--skew", default="1.0,0", help="Zipf exponents; 0: uniform")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=3, help="runs averaged per figure")
    args = ap.parse_args()
    policies = ("rr", "affinity", "partition", "no-slot-limit")
    for slots in map(int, args.slots.split(",")):
        for skew in map(float, args.skew.split(",")):
            speed = {p: sum(run(p, slots, skew, s, concurrency=args.concurrency)
                            for s in range(args.seeds)) / args.seeds for p in policies}
            print(f"slots {slots:3d}  skew {skew:g}:  " + "  ".join(
                f"{p} {v:,.0f} ({v / speed['rr']:.3f}x)" for p, v in speed.items()))


if __name__ == "__main__":
    main()
