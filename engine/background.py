"""Background work: requests that fill the steps live requests leave (a batch job's lines).

A sequence whose `priority` is at or past `Background.priority` (the router sends batch lines at
microserve.bounds.BACKGROUND_PRIORITY) is background. While any other sequence runs or waits, a
step gives background sequences at most `max_seqs` rows (decodes, prefill chunks and admissions
together) and `max_tokens` tokens, so live requests keep their time per token; with no other
work they run as any sequence does. The scheduler (engine/scheduler.py) also lets a live
sequence that finds no seat or no pages take those of background ones, under any policy, and
never promotes a background sequence for starvation: it would then outrank the live requests
it fills in for. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(frozen=True)
class Background:
    """Which sequences are background, and the room a step leaves them beside other work."""

    priority: int  # a sequence's priority at or past this: background
    max_seqs: int  # rows (decodes, prefill chunks, admissions) a step gives background work
    max_tokens: int  # tokens of those rows

    def __post_init__(self):
        if self.max_seqs < 0 or self.max_tokens < 0:
            raise ValueError(f"background limits must be >= 0, got {self.max_seqs} sequences "
                             f"and {self.max_tokens} tokens a step")

    def of(self, seq: Sequence) -> bool:
        return seq.priority >= self.priority


@dataclass
class StepRoom:
    """One step's room for background sequences, used up as the scheduler packs the step."""

    background: Background | None
    seqs: float = float("inf")
    tokens: float = float("inf")

    @classmethod
    def of(cls, background: Background | None, sequences: Iterable[Sequence]) -> StepRoom:
        """The room of a step over `sequences` (running and waiting): limited if any of them
        is not background, unbounded if all are."""
        if background is None or all(background.of(s) for s in sequences):
            return cls(background)
        return cls(background, background.max_seqs, background.max_tokens)

    def cap(self, seq: Sequence, n: int) -> int:
        """The tokens of `n` that `seq` may run this step (n if it is not background)."""
        if self.background is None or not self.background.of(seq):
            return n
        return 0 if self.seqs < 1 else int(min(n, self.tokens))

    def take(self, seq: Sequence, n: int) -> None:
        if self.background is not None and self.background.of(seq):
            self.seqs -= 1
            self.tokens -= n
