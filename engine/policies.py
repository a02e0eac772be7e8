"""Scheduling policies: in which order the scheduler runs and admits sequences, and whom it
preempts. Plain Python (no torch): tested on a fake clock to the exact step.

    fcfs      arrival order; preempts (for pages) the newest.
    priority  a request's `priority` (vLLM's semantics: lower runs first; ties by arrival).
    mlfq      FastServe's skip-join multi-level feedback queue (seed paper 003): K queues, the
              quantum of queue i is base * 2**i; a new sequence joins the highest queue whose
              quantum covers its predicted first iteration, and drops a queue each time it
              has used up its queue's quantum.

Starvation. Under `priority` and `mlfq` a sequence that has not run for longer than
`starvation_s` (waiting, or running but given no tokens) is promoted: to the top of `priority`
for good, to queue 0 of `mlfq` with a fresh quantum. A promoted sequence outranks every
unpromoted one, so it runs at the first step after its bound unless older promoted sequences
fill the step. Under `fcfs` nothing that arrived later is admitted before a sequence that
needs its KV computed (Scheduler's `blocked` rule): its wait is bounded by the work ahead of it.

Scale: `refresh` looks at every sequence once per step: O(waiting + running), a few hundred.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "mlfq")
# vLLM takes any integer; ours fit a 32-bit int, where they travel (microserve/bounds.py)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class PrefillProfile:
    """Predicted seconds of a step that computes `n` tokens of one sequence: a + b * n,
    fitted from steps the engine timed at start-up (engine/core/profile.py)."""

    fixed_s: float
    per_token_s: float

    def predict(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> PrefillProfile:
        """Least squares over (tokens, seconds) samples; the slope and intercept kept >= 0
        (a noisy CPU timing must not predict a negative time)."""
        n = len(samples)
        mean_x = sum(x for x, _ in samples) / n
        mean_y = sum(y for _, y in samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in samples)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var if var else 0.0
        slope = max(slope, 0.0)
        return cls(max(mean_y - slope * mean_x, 0.0), slope)


@dataclass
class _Entry:
    """The policy's record of one sequence (written by the policy only)."""

    last_ran: float  # clock time it last had tokens scheduled (or was added)
    promoted: bool = False  # starved past the bound (priority: for good)
    level: int = 0  # mlfq: its queue
    used_s: float = 0.0  # mlfq: predicted seconds run in its queue


class SchedulingPolicy(ABC):
    """The order of the scheduler's work. The Scheduler calls, and only it:

    - `add(seq, first_chunk)` when a sequence enters (not when a preempted one comes back);
      `remove(seq)` when it leaves for good.
    - `refresh(sequences)` at the start of each step: promotes the starved.
    - `ran(scheduled)` after each step's schedule, with (sequence, tokens) pairs scheduled.
    - `rank(seq)`: smaller runs first. The scheduler packs decodes before prefill chunks,
      each in rank order, then admits waiting sequences in rank order (`admit_order`).
    - `preemption_victim(running)` when a running sequence needs a page and none is left: a
      sequence of `running` (it may be the one that needs it).
    - If `preempts`, a waiting sequence that cannot be admitted (no seat, no pages) may take
      the place of running sequences it outranks (`outranks`), worst first; the scheduler
      releases their pages (whole pages stay in the prefix cache) and recomputes them later,
      or swaps them to a host tier. For pages only if `takes_pages_to_admit`.

    Nothing here touches pages or the queues: the scheduler does, in the order this says.
    """

    name: str
    preempts: bool = False
    # Whether a waiting sequence short of pages may take those of running sequences it outranks
    # (their KV recomputed later, or swapped to a host tier). Under mlfq, no: every sequence
    # sinks below newer ones within a few quanta, so taking pages to admit each new arrival
    # takes them from sequences that have not finished, which lose their turn again and again.
    # On an H200 with ~2,000-token prompts, a 2,048-page pool and 12 arrivals a second
    # (docs/benchmarks.md, 2026-11-28): by recompute, 3,752 preemptions for 400 requests and 29
    # that waited 60 s without starting; by swap, 1,250 preemptions (1,023 swapped) and mean
    # JCT 22.9 s against 10.9 s with mlfq waiting for pages and no tier.
    takes_pages_to_admit: bool = True

    def __init__(self, starvation_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.starvation_s = starvation_s
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self.promotions = 0  # counter for /metrics

    def add(self, seq: Sequence, first_chunk: int) -> None:
        """`first_chunk`: the tokens its first step would compute (prompt less KV held,
        within the step budget)."""
        self._entries[seq.request_id] = _Entry(self.clock())

    def remove(self, seq: Sequence) -> None:
        self._entries.pop(seq.request_id, None)

    def refresh(self, sequences: Iterable[Sequence]) -> None:
        if self.starvation_s is None:
            return
        now = self.clock()
        for seq in sequences:
            entry = self._entries.get(seq.request_id)
            if (entry is not None and now - entry.last_ran > self.starvation_s
                    and not self._at_top(entry)):
                self._promote(entry, now)
                self.promotions += 1

    def _at_top(self, entry: _Entry) -> bool:
        return entry.promoted

    def _promote(self, entry: _Entry, now: float) -> None:
        entry.promoted, entry.last_ran = True, now

    def ran(self, scheduled: list[tuple[Sequence, int]]) -> None:
        now = self.clock()
        for seq, num_tokens in scheduled:
            entry = self._entries.get(seq.request_id)
            if entry is not None:
                entry.last_ran = now
                self._charge(entry, num_tokens)

    def _charge(self, entry: _Entry, num_tokens: int) -> None:
        """A step ran `num_tokens` of the sequence (mlfq counts its quantum here)."""

    @abstractmethod
    def rank(self, seq: Sequence) -> tuple:
        """Smaller runs first; total over the sequences: its last element is the arrival."""

    def outranks(self, a: Sequence, b: Sequence) -> bool:
        """Whether waiting `a` may take the place of running `b`: its rank is above b's by more
        than arrival (the rank's last element). Equals never preempt each other: an older
        request would otherwise push out a newer one holding KV received from a peer, only to
        be recomputed the same way later."""
        return self.rank(a)[:-1] < self.rank(b)[:-1]

    def admit_order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return sorted(waiting, key=self.rank)

    def run_order(self, running: list[Sequence]) -> list[Sequence]:
        return sorted(running, key=self.rank)

    def preemption_victim(self, running: list[Sequence]) -> Sequence:
        return max(running, key=self.rank)

    def stats(self) -> dict[str, int]:
        """Gauges for /metrics, by name."""
        return {}

    @property
    def num_sequences(self) -> int:
        """Sequences it keeps a record of: those in the scheduler (none under FCFS)."""
        return len(self._entries)


class FCFS(SchedulingPolicy):
    """Arrival order; preempts (for pages) the most recent arrival. A preempted sequence goes
    back to the head of the queue (Scheduler._preempt), so the queue's order is kept as is."""

    name = "fcfs"

    def add(self, seq: Sequence, first_chunk: int) -> None:
        pass  # no per-sequence state: the queue's order is the policy

    def ran(self, scheduled: list[tuple[Sequence, int]]) -> None:
        pass

    def rank(self, seq: Sequence) -> tuple:
        return (seq.arrival,)

    def admit_order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return list(waiting)

    def run_order(self, running: list[Sequence]) -> list[Sequence]:
        return running


class Priority(SchedulingPolicy):
    """`seq.priority`, lower first, ties by arrival; the promoted above all, by arrival."""

    name = "priority"
    preempts = True

    def rank(self, seq: Sequence) -> tuple:
        entry = self._entries.get(seq.request_id)
        if entry is not None and entry.promoted:
            return (0, 0, seq.arrival)
        return (1, seq.priority, seq.arrival)


class SkipJoinMLFQ(SchedulingPolicy):
    """FastServe's skip-join MLFQ. Quanta are predicted seconds of running (`profile`): a
    step that computes n tokens of a sequence charges it profile.predict(n), so a prefill
    chunk costs what it takes and a decode step about one iteration.

        queue:    0        1          2              K-1
        quantum:  base     2 base     4 base   ...   (none: the last queue keeps it)
        joins:    the first queue whose quantum >= predict(first chunk)
    """

    name = "mlfq"
    preempts = True
    takes_pages_to_admit = False  # short of pages it waits (a seat it still takes)

    def __init__(self, profile: PrefillProfile, num_levels: int = 8,
                 base_quantum_s: float | None = None, starvation_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(starvation_s, clock)
        if num_levels < 1:
            raise ValueError(f"mlfq num_levels must be >= 1, got {num_levels}")
        self.profile = profile
        self.num_levels = num_levels
        # default: a queue-0 job runs ~8 decode iterations before its first demotion
        self.base_quantum_s = base_quantum_s or 8 * profile.predict(1)
        if not self.base_quantum_s > 0:
            raise ValueError(f"mlfq base quantum must be > 0 s, got {self.base_quantum_s}")
        self.demotions = 0  # counter for /metrics

    def quantum(self, level: int) -> float:
        return self.base_quantum_s * 2**level

    def add(self, seq: Sequence, first_chunk: int) -> None:
        first = self.profile.predict(first_chunk)
        level = next((i for i in range(self.num_levels) if self.quantum(i) >= first),
                     self.num_levels - 1)
        self._entries[seq.request_id] = _Entry(self.clock(), level=level)

    def level(self, seq: Sequence) -> int:
        return self._entries[seq.request_id].level

    def _at_top(self, entry: _Entry) -> bool:
        return entry.level == 0

    def _promote(self, entry: _Entry, now: float) -> None:
        entry.level, entry.used_s, entry.last_ran = 0, 0.0, now

    def _charge(self, entry: _Entry, num_tokens: int) -> None:
        entry.used_s += self.profile.predict(num_tokens)
        if entry.used_s >= self.quantum(entry.level) and entry.level < self.num_levels - 1:
            entry.level, entry.used_s = entry.level + 1, 0.0
            self.demotions += 1

    def rank(self, seq: Sequence) -> tuple:
        entry = self._entries.get(seq.request_id)
        return (entry.level if entry is not None else 0, seq.arrival)

    def stats(self) -> dict[str, int]:
        counts = Counter(entry.level for entry in self._entries.values())
        return {f"level_{i}": counts.get(i, 0) for i in range(self.num_levels)}


def make_policy(name: str, *, starvation_s: float, profile: PrefillProfile | None = None,
                num_levels: int = 8, base_quantum_s: float | None = None,
                clock: Callable[[], float] = time.monotonic) -> SchedulingPolicy:
    """The policy `name` (one of POLICIES); mlfq needs the engine's prefill `profile`."""
    if name == "fcfs":
        return FCFS(clock=clock)
    if name == "priority":
        return Priority(starvation_s, clock)
    if name == "mlfq":
        if profile is None:
            raise ValueError("mlfq needs a prefill-time profile")
        return SkipJoinMLFQ(profile, num_levels, base_quantum_s, starvation_s, clock)
    raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}; got {name!r}")
