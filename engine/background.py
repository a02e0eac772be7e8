"""Background work: requests that fill the steps live requests leave (a batch job's lines).

A sequence whose `priority` is at or past `Background.priority` (the router sends batch lines at
microserve.bounds.BACKGROUND_PRIORITY) is background. While any other sequence runs or waits, a
step gives background sequences at most `max_seqs` rows (decodes, prefill chunks and admissions
together) and `max_tokens` tokens, so live requests keep their time per token; with no other
work they run as any sequence does. The scheduler (engine/scheduler.py) also lets a live
sequence that finds no seat or no pages take those of background ones, under any policy, and
never promotes a background sequence for starvation: it would then outrank the live requests
it fills in for.

`prompt_every` > 1 gathers background prompt work: each step that live work limits saves
`max_tokens` of room for background prompt chunks, and they run only once `prompt_every`
steps' worth is saved, all in that one step. A step that carries prompt tokens runs without the
whole decode CUDA graph (piecewise graphs, attention eager), and that, not the tokens, is most
of what background prompts cost live decodes: on an H100 (docs/benchmarks.md, 2026-11-27) 4
background tokens a step instead of 32 put a prompt chunk in eight times as many steps and
raised live TPOT p99 beside a batch from 1.12x to 1.36x. Decode rows (one token) are not
gathered: they ride the decode graph. Plain Python, no torch.
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
    max_tokens: int  # tokens of those rows (on average, with prompt_every > 1)
    prompt_every: int = 1  # background prompt chunks run in one step of this many (see above)

    def __post_init__(self):
        if self.max_seqs < 0 or self.max_tokens < 0:
            raise ValueError(f"background limits must be >= 0, got {self.max_seqs} sequences "
                             f"and {self.max_tokens} tokens a step")
        if self.prompt_every < 1:
            raise ValueError(f"background prompt_every must be >= 1, got {self.prompt_every}")

    def of(self, seq: Sequence) -> bool:
        return seq.priority >= self.priority

    @property
    def gathered(self) -> int:
        """The prompt tokens a gathered step may give background work."""
        return self.max_tokens * self.prompt_every


@dataclass
class StepRoom:
    """One step's room for background sequences, used up as the scheduler packs the step."""

    background: Background | None
    seqs: float = float("inf")
    tokens: float = float("inf")
    prompt: float = float("inf")  # of `tokens`, those background prompt chunks may take
    prompt_taken: int = 0
    saved: float = 0.0  # gathered: the prompt room saved up, this step's included

    @classmethod
    def of(cls, background: Background | None, sequences: Iterable[Sequence],
           credit: float = float("inf")) -> StepRoom:
        """The room of a step over `sequences` (running and waiting): limited if any of them
        is not background, unbounded if all are. `credit`: the prompt room saved up by the
        steps before (PromptCredit), read only when background prompts are gathered."""
        if background is None or all(background.of(s) for s in sequences):
            return cls(background)
        if background.prompt_every == 1:
            return cls(background, background.max_seqs, background.max_tokens)
        saved = min(credit + background.max_tokens, background.gathered)
        prompt = saved if saved >= background.gathered else 0
        return cls(background, background.max_seqs, background.max_tokens + prompt, prompt,
                   saved=saved)

    @property
    def limited(self) -> bool:
        return self.seqs != float("inf")

    def cap(self, seq: Sequence, n: int) -> int:
        """The tokens of `n` that `seq` may run this step (n if it is not background). A
        background prompt chunk (more than one token) gets at most the prompt room, and none
        when less than two tokens of it are left (not a prompt a token at a time)."""
        if self.background is None or not self.background.of(seq):
            return n
        if self.seqs < 1:
            return 0
        if n > 1 and self.prompt < 2:
            return 0
        return int(min(n, self.tokens, self.prompt if n > 1 else n))

    def take(self, seq: Sequence, n: int) -> None:
        if self.background is not None and self.background.of(seq):
            self.seqs -= 1
            self.tokens -= n
            if n > 1:
                self.prompt -= n
                self.prompt_taken += n


@dataclass
class PromptCredit:
    """The background prompt room saved up across steps (Background.prompt_every > 1)."""

    background: Background | None
    credit: float = 0.0

    def settle(self, room: StepRoom) -> None:
        """After a step is packed: a limited step saved max_tokens (up to one gathered step's
        worth, StepRoom.of), less what background prompts took; an unlimited one leaves the
        room full, so the first step that live work limits can run a gathered chunk."""
        b = self.background
        if b is None or b.prompt_every == 1:
            return
        self.credit = room.saved - room.prompt_taken if room.limited else b.gathered
