"""Logit adjustments in the engine core: allowed_token_ids, logit_bias, min_tokens and the
penalties.

Every request whose `SamplingParams.adjusts_logits` has an entry in the core's `PenaltyPool`,
keyed by request id (like engine/grammar.py's matchers), from when it is added until it
leaves. The penalties (repetition, frequency, presence) need the tokens seen so far, and with
async scheduling step N+1 is sampled before step N's token reaches the host. So those counts
live on the device, one pool row per request that needs them, and the sampler adds each
step's token to its row right after choosing it, on the same stream as everything else:

    counts     [rows, V] int32   occurrences of each token in the output so far
    in_prompt  [rows, V] bool    the token occurs in the prompt

    add(request)          keep its options (no device memory: it may wait in line long)
    its first sample      take a free row (grow the pool if none), zero it, mark the prompt
    step N sample         logits[r] adjusted from counts[row(r)]; token t sampled;
                          counts[row(r), t] += 1 (one index_add_ for the whole step)
    step N+1 sample       sees step N's token, whether or not the host has read it
    remove(request)       the row goes back to the free list

logit_bias and min_tokens need no row: the bias is fixed, and the host knows how many tokens
a request has out, the pending one included (`len(seq.output_token_ids)` counts PENDING).

Adjustments, in vLLM's order (after the grammar mask, before temperature, top-k, top-p and
greedy's argmax):

    0. allowed_token_ids   every other token: logit = -inf (what follows keeps -inf at -inf)
    1. logit_bias          logit[t] += bias[t]
    2. min_tokens          while len(output) < min_tokens: logit[stop ids] = -inf
                           (stop_token_ids, and the eos ids unless ignore_eos)
    3. repetition_penalty  t in prompt or output: logit / p if logit > 0 else logit * p
                           (Hugging Face's RepetitionPenaltyLogitsProcessor)
    4. frequency/presence  logit -= frequency * count[t];  logit -= presence * (count[t] > 0)
                           (count over the output only, as vLLM)

Only the rows that adjust are gathered, changed and written back (as the grammar mask is), so
the other rows come out bit-identical and a step without any costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.device import to_device
from kvcache.integrity import IntegrityError
from microserve.messages import SamplingParams

if TYPE_CHECKING:
    from engine.sequence import Sequence

_MIN_ROWS = 4  # the pool's first allocation


@dataclass(slots=True)
class _Entry:
    """What the pool keeps for one request (fixed when it is added, but for its row)."""

    counted: bool  # a penalty needs the token counts
    row: int | None  # its row of counts and in_prompt, taken when it is first sampled
    bias_ids: list[int]  # distinct
    bias_values: list[float]
    stop_ids: list[int]  # made impossible while fewer than min_tokens tokens are out
    min_tokens: int
    penalties: tuple[float, float, float]  # repetition, frequency, presence
    allowed_ids: list[int]  # distinct; empty: no restriction


@dataclass
class StepAdjustments:
    """One step's logit adjustments, built on the host by `PenaltyPool.step` for the sampled
    rows whose params adjust logits; the sampler applies them (`adjust_logits`) and records
    the step's tokens (`record_tokens`).

    Positions are flat in the adjusted rows gathered [len(rows), V]: j * V + token id for
    the j-th adjusted row (V: the pool's vocab_size, the logits' sampled columns).
    """

    vocab_size: int
    rows: list[int] = field(default_factory=list)  # rows of the step's logits, ascending
    bias_at: list[int] = field(default_factory=list)  # logit_bias: flat positions, distinct
    bias_values: list[float] = field(default_factory=list)  # ... and what they get added
    banned_at: list[int] = field(default_factory=list)  # min_tokens: flat positions -> -inf
    # allowed_token_ids: j of the rows restricted, and the flat positions they keep
    allowed_rows: list[int] = field(default_factory=list)
    allowed_at: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)  # j of the rows with penalties
    pool_rows: list[int] = field(default_factory=list)  # ... their rows of `pool`
    penalties: list[tuple[float, float, float]] = field(default_factory=list)  # ... and values
    # Read when sampling, not when built: the pool grows (reallocates) only when a request is
    # added, never between a step's launch and its sampling.
    pool: PenaltyPool | None = None
    # set by adjust_logits: the lists above on the device, for record_tokens
    _on_device: _OnDevice | None = field(default=None, init=False, repr=False)


@dataclass
class _OnDevice:
    """A step's index and value lists on the device: two copies (one of longs, one of
    floats), sliced into views, so a step pays two transfers however many lists it has."""

    rows: torch.Tensor
    bias_at: torch.Tensor
    banned_at: torch.Tensor
    allowed_rows: torch.Tensor
    allowed_at: torch.Tensor
    counted: torch.Tensor
    pool_rows: torch.Tensor
    counted_rows: torch.Tensor  # rows of the step's logits of the counted rows
    bias_values: torch.Tensor
    penalties: torch.Tensor  # [n, 3]: repetition, frequency, presence per counted row

    @classmethod
    def of(cls, adjust: StepAdjustments, device: torch.device) -> _OnDevice:
        counted_rows = [adjust.rows[j] for j in adjust.counted]
        longs = [adjust.rows, adjust.bias_at, adjust.banned_at, adjust.allowed_rows,
                 adjust.allowed_at, adjust.counted, adjust.pool_rows, counted_rows]
        packed = to_device([x for part in longs for x in part], torch.long, device)
        views = packed.split([len(part) for part in longs])
        floats = to_device(adjust.bias_values + [x for p in adjust.penalties for x in p],
                           torch.float32, device)
        n_bias = len(adjust.bias_values)
        return cls(*views, floats[:n_bias], floats[n_bias:].view(-1, 3))


class PenaltyPool:
    """The logit adjustments of one engine core's requests, keyed by request id.

    Written by the engine core only: `add` when a request is added, `remove` when it leaves
    (finished, aborted or failed; not when preempted: its output stays), `step` when a step
    is launched. The sampler writes the counts on the device.

    Args:
        vocab_size: the model's vocabulary (logit columns sampled).
        device: where the logits are (the counts live there).
        eos_token_ids: masked by min_tokens unless a request has ignore_eos.
    """

    def __init__(self, vocab_size: int, device: torch.device | str, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = sorted(eos_token_ids)
        self._entries: dict[str, _Entry] = {}
        self._free_rows: list[int] = []
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self._ones = torch.ones(0, dtype=torch.int32, device=self.device)  # one per row

    what = "penalty pool entries"  # a RequestSideTable (engine/requests.py): admit = add

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def request_ids(self) -> list[str]:
        return list(self._entries)

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Keep the request's adjustments if its params have any (else do nothing). Its output
        must be empty (a handed-over first token is refused with these params). A request
        that needs counts gets its row when it is first sampled (`step`), not here: requests
        waiting in line, however many, hold no device memory."""
        if not params.adjusts_logits:
            return
        assert request_id not in self._entries, request_id
        stops = {t for t in (*params.stop_token_ids, *self.eos_token_ids)
                 if params.stops_on(t, self.eos_token_ids)}
        bias: dict[int, float] = {}
        for token, value in params.logit_bias:  # distinct ids: a repeated one adds up
            bias[token] = bias.get(token, 0.0) + value
        penalties = (params.repetition_penalty, params.frequency_penalty,
                     params.presence_penalty)
        self._entries[request_id] = _Entry(params.needs_token_counts, None, list(bias),
                                           list(bias.values()), sorted(stops),
                                           params.min_tokens, penalties,
                                           list(dict.fromkeys(params.allowed_token_ids)))

    admit = add

    def remove(self, request_id: str) -> None:
        """Forget the request (unknown ids are ignored); its row is free for the next one."""
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.row is not None:
            self._free_rows.append(entry.row)

    def step(self, sampled: list[Sequence]) -> StepAdjustments | None:
        """The adjustments of a step that samples one row per sequence of `sampled`, taken
        before the step's own token is appended: None when no row adjusts."""
        if not self._entries:
            return None
        adjust, vocab = StepAdjustments(self.vocab_size), self.vocab_size
        for i, seq in enumerate(sampled):
            entry = self._entries.get(seq.request_id)
            if entry is None:
                continue
            ban = len(seq.output_token_ids) < entry.min_tokens and entry.stop_ids
            if not (ban or entry.bias_ids or entry.counted or entry.allowed_ids):
                continue  # min_tokens reached, and nothing else
            if entry.counted and entry.row is None:  # its first sample: nothing out yet
                entry.row = self._start_row(seq.prompt_token_ids)
            j = len(adjust.rows)
            adjust.rows.append(i)
            if entry.bias_ids:
                adjust.bias_at.extend([j * vocab + t for t in entry.bias_ids])
                adjust.bias_values.extend(entry.bias_values)
            if ban:
                adjust.banned_at.extend([j * vocab + t for t in entry.stop_ids])
            if entry.allowed_ids:
                adjust.allowed_rows.append(j)
                adjust.allowed_at.extend([j * vocab + t for t in entry.allowed_ids])
            if entry.counted:
                adjust.counted.append(j)
                adjust.pool_rows.append(entry.row)
                adjust.penalties.append(entry.penalties)
        if not adjust.rows:
            return None
        if adjust.counted:
            adjust.pool = self
        return adjust

    def _start_row(self, prompt: list[int]) -> int:
        """A free row, its counts zero and its prompt's tokens marked (queued on the stream
        after every earlier step's counts, so a row given back and taken again starts clean)."""
        row = self._take_row()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self.in_prompt[row].index_fill_(0, to_device(prompt, torch.long, self.device), True)
        return row

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.counts.shape[0]
            new = max(_MIN_ROWS, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old].copy_(self.counts)  # stream-ordered after every step's counts
            in_prompt[:old].copy_(self.in_prompt)
            self.counts, self.in_prompt = counts, in_prompt
            self._ones = torch.ones(new, dtype=torch.int32, device=self.device)
            self._free_rows.extend(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    def ones(self, n: int) -> torch.Tensor:
        """n int32 ones on the device (n at most the pool's rows), made once, not per step."""
        return self._ones[:n]

    def check_integrity(self) -> None:
        """Every pool row is either free or held by exactly one request. Raises IntegrityError."""
        held = [e.row for e in self._entries.values() if e.row is not None]
        everything = held + self._free_rows
        if len(set(everything)) != len(everything) or set(everything) != set(
                range(self.counts.shape[0])):
            raise IntegrityError(f"penalty pool rows: held {sorted(held)}, free "
                                 f"{sorted(self._free_rows)} of {self.counts.shape[0]}")


def adjust_logits(logits: torch.Tensor, adjust: StepAdjustments) -> torch.Tensor:
    """A copy of `logits` [B, V] (float32, V = adjust.vocab_size) with the adjusted rows
    changed and the others untouched.

    A handful of kernels whatever the batch: the rows are gathered once, the bias and the
    bans are one flat index_add_ / index_fill_ each, the penalties elementwise on the counted
    rows, and a penalty every counted row leaves at its default is skipped (x / 1 and
    x - 0 * c would give x again).
    """
    assert logits.shape[1] == adjust.vocab_size, (logits.shape, adjust.vocab_size)
    on = adjust._on_device = _OnDevice.of(adjust, logits.device)
    x = logits.index_select(0, on.rows)  # contiguous [n, V]: flat positions index its view
    if adjust.allowed_rows:  # keep the allowed logits, the rest of those rows -inf
        kept = x.view(-1).index_select(0, on.allowed_at)
        x.index_fill_(0, on.allowed_rows, float("-inf"))
        x.view(-1).index_copy_(0, on.allowed_at, kept)
    if adjust.bias_at:
        x.view(-1).index_add_(0, on.bias_at, on.bias_values)
    if adjust.banned_at:
        x.view(-1).index_fill_(0, on.banned_at, float("-inf"))
    if adjust.counted:
        every_row = len(adjust.counted) == len(adjust.rows)
        counted = x if every_row else x.index_select(0, on.counted)
        penalized = _penalize(counted, adjust, on)
        if every_row:
            x = penalized
        else:
            x.index_copy_(0, on.counted, penalized)
    return logits.index_copy(0, on.rows, x)


def _penalize(x: torch.Tensor, adjust: StepAdjustments, on: _OnDevice) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on the counted rows `x` [n, V]."""
    use_repetition, use_frequency, use_presence = (
        any(value != default for value in values)
        for values, default in zip(zip(*adjust.penalties), (1.0, 0.0, 0.0)))
    counts = adjust.pool.counts.index_select(0, on.pool_rows)
    in_output = counts > 0 if use_repetition or use_presence else None
    repetition, frequency, presence = on.penalties.split(1, dim=1)  # each [n, 1]
    if use_repetition:
        seen = adjust.pool.in_prompt.index_select(0, on.pool_rows).logical_or_(in_output)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if use_frequency:
        x = x - frequency * counts
    if use_presence:
        x = x - presence * in_output
    return x


def record_tokens(adjust: StepAdjustments | None, token_ids: torch.Tensor) -> None:
    """Add each counted row's sampled token (`token_ids` [B], on the device) to its counts:
    one index_add_ into the flat counts, queued behind the sampling, no host sync. (A step
    holds each request once, so its positions are distinct.)"""
    if adjust is None or not adjust.counted:
        return
    on, vocab = adjust._on_device, adjust.vocab_size
    counts = adjust.pool.counts
    at = on.pool_rows * vocab + token_ids.index_select(0, on.counted_rows)
    counts.view(-1).index_add_(0, at, adjust.pool.ones(len(adjust.counted)))
