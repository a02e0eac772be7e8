"""Batched token sampling for one engine step.

Greedy rows take the argmax. Sampled rows divide by their temperature, drop tokens less likely
than min_p times the most likely one, then those outside top-k and then outside the top-p
nucleus (vLLM's order), and pick a token by an exponential race: for noise
E ~ Exponential(1) drawn per token, argmax(probs / E) is distributed exactly as probs (it is the
Gumbel-max trick in another form). The race needs no host sync and lets every row draw its noise
from its own generator:

  - a row whose request has a seed draws one [V] block of noise per step from that request's
    generator, always the same way, so its tokens do not depend on which other requests share the
    batch or where the row sits in it;
  - rows without a seed draw one [n, V] block together from the sampler's shared generator.

Logprobs are of the raw model distribution (log_softmax of the logits before temperature, top-k
and top-p), as `TokenLogprob` documents.

Constrained rows (structured outputs, forced tool calls) come with a `TokenMask`, computed on the
host by engine/grammar.py: before anything else, their disallowed tokens are set to -inf, so
greedy, temperature, top-k and top-p all choose among allowed tokens only. Rows without a mask
are not touched, and a step without one costs nothing extra.

Rows whose params adjust logits (logit_bias, min_tokens, repetition / frequency / presence
penalties) come with `StepAdjustments` (engine/penalties.py), applied right after the mask;
greedy rows take the argmax of the adjusted logits. The penalties' token counts live on the
device and the sampler adds each step's tokens to them as it samples, so the next step sees
them without a trip through the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.device import to_device
from engine.penalties import StepAdjustments, adjust_logits, record_tokens
from microserve.messages import SamplingParams, TokenLogprob

# Slack for "the nucleus's mass reaches top_p": a set whose true mass equals top_p (0.4 + 0.2 + 0.2
# for top_p=0.8) may sum a float32 ulp short, which would pull one extra token into the nucleus.
_TOP_P_SLACK = 1e-6
# Top-k / top-p first look at each row's this many most likely tokens (`_nucleus_of_candidates`)
# and sort the whole vocabulary only for rows whose nucleus reaches past them
TOP_CANDIDATES = 1024


def _nucleus_bound(top_p: torch.Tensor) -> torch.Tensor:
    """A token stays in the nucleus while the mass before it is below this: top_p less the
    slack, but above 0 so that the most likely token always stays (top_p may be tiny); no
    bound at top_p 1 (a row with only a top-k keeps all of it, its tail's last ulps too)."""
    bound = (top_p - _TOP_P_SLACK).clamp(min=1e-12)
    return torch.where(top_p < 1.0, bound, float("inf"))


@dataclass
class TokenMask:
    """The allowed tokens of a step's constrained rows (engine/grammar.py builds it)."""

    rows: list[int]  # rows of the step's logits that are constrained
    bitmask: torch.Tensor  # [len(rows), ceil(V / 32)] int32 on the host; bit t % 32 of word
    # t // 32 set: token t allowed


@dataclass
class SampleResult:
    token_ids: list[int]  # one per row of the logits
    logprobs: list[TokenLogprob | None]  # one per row; None where params.logprobs is None


class PendingSample:
    """A step's sampled tokens while they are still on their way to the host.

    `token_ids` (device) can feed the next step's input at once; `result()` waits for the
    copies started at creation and returns plain lists. On CPU there is nothing to wait for.
    """

    def __init__(self, token_ids: torch.Tensor, wanted: list[int], n_rows: int,
                 logprob_parts: tuple[torch.Tensor, ...] | None, num_top: list[int]):
        self.token_ids = token_ids  # [B] long, on the logits' device
        self._wanted, self._n_rows, self._num_top = wanted, n_rows, num_top
        cuda = token_ids.is_cuda
        parts = (token_ids,) + (logprob_parts or ())
        # Pinned destinations: a copy into pageable memory would make the host wait here.
        self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda) for p in parts]
        for host, part in zip(self._host, parts):
            host.copy_(part, non_blocking=cuda)
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        ids = self._host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * self._n_rows
        if self._wanted:
            chosen, top_values, top_ids = (h.tolist() for h in self._host[1:])
            for j, i in enumerate(self._wanted):
                n = self._num_top[j]
                top = list(zip(top_ids[j][:n], top_values[j][:n]))
                logprobs[i] = TokenLogprob(token_id=ids[i], logprob=chosen[j], top=top)
        return SampleResult(ids, logprobs)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for `SamplingParams.seed`, or None when the request has no seed.

    The caller makes it once per request, on the logits' device, and passes it to every
    `Sampler.sample` call for that request; only that request's draws advance it.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns one step's logits into one token per row.

    Args:
        vocab_size: the tokenizer's vocabulary; logit columns past it (a padded lm_head) are
            never sampled.
        device: where the logits live; the shared generator is made there.
        seed: seeds the generator shared by rows without a seed (None: nondeterministic).
        triton_argmax: greedy rows through the two-pass Triton argmax
            (`engine/kernels/argmax.py`; torch's one-block argmax over a 128k row took 29.6 us
            on an H100, on the critical path between two batch-1 decode steps). The same ids.
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int | None = None,
                 triton_argmax: bool = False):
        self.vocab_size = vocab_size
        self.triton_argmax = triton_argmax
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)  # rows whose request has no seed
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._positions = torch.arange(vocab_size, device=self.device)  # for top-k masks
        # Top-k/top-p from each row's most likely tokens first (_apply_top_k_top_p): on the
        # CPU. Not on a GPU yet: choosing the rows that still need the whole sort reads a
        # result back, and that wait would stall the host's lead of a step (async scheduling).
        self.candidates_first = self.device.type == "cpu"
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=self.device)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        mask: TokenMask | None = None,
        adjust: StepAdjustments | None = None,
    ) -> SampleResult:
        """`sample_async(...).result()`: sample and wait for the host copy."""
        return self.sample_async(logits, params, generators, mask, adjust).result()

    def sample_async(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        mask: TokenMask | None = None,
        adjust: StepAdjustments | None = None,
    ) -> PendingSample:
        """Sample one token per row, without waiting for the result to reach the host.

        Args:
            logits: [B, V'] float32, V' >= vocab_size. Not modified.
            params: one per row.
            generators: one per row: the request's generator from `make_generator` when its
                params have a seed (advanced by this call if the row is not greedy), else None.
            mask: the allowed tokens of constrained rows (None: no row is constrained). Each
                masked row must allow at least one token.
            adjust: the logit adjustments of the rows whose params have any (None: no row
                has). The counted rows' penalty counts get this call's tokens, on the device.

        Returns:
            The token ids on the device, and (on `.result()`) each row's id and its logprobs
            where the row asked for them.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
        assert logits.shape[1] >= self.vocab_size, (logits.shape, self.vocab_size)
        assert all((p.seed is None) == (g is None) for p, g in zip(params, generators))
        logits = raw_logits = logits[:, : self.vocab_size].float()
        if mask is not None:
            logits = self._apply_mask(logits, mask)
        if adjust is not None:
            logits = adjust_logits(logits, adjust)

        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            token_ids = self._argmax(logits)
        elif len(sampled_rows) == len(params):
            token_ids = self._sample_rows(logits, params, generators)
        else:
            token_ids = self._argmax(logits)
            rows = to_device(sampled_rows, torch.long, logits.device)
            sampled = self._sample_rows(
                logits.index_select(0, rows),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
            token_ids.index_copy_(0, rows, sampled)
        record_tokens(adjust, token_ids)

        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        num_top = [params[i].logprobs for i in wanted]
        parts = self._logprobs(raw_logits, token_ids, wanted, max(num_top)) if wanted else None
        return PendingSample(token_ids, wanted, len(params), parts, num_top)

    def score_async(self, logits: torch.Tensor, token_ids: list[int],
                    num_top: list[int]) -> PendingSample:
        """The logprob of a given token per row under the row's raw distribution, with the
        row's top `num_top` alternatives: prompt tokens scored by the logits before them.
        `.result()` has them as a sample's logprobs (every row's)."""
        assert logits.shape[0] == len(token_ids) == len(num_top)
        logits = logits[:, : self.vocab_size].float()
        ids = to_device(token_ids, torch.long, logits.device)
        rows = list(range(len(token_ids)))
        parts = self._logprobs(logits, ids, rows, max(num_top))
        return PendingSample(ids, rows, len(rows), parts, num_top)

    def _apply_mask(self, logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
        """A copy of `logits` whose masked rows have -inf at every token the mask disallows.

            bitmask word w of row r:  bit b set  <=>  token 32 * w + b allowed
        """
        assert mask.bitmask.shape == (len(mask.rows), (self.vocab_size + 31) // 32), (
            mask.bitmask.shape, self.vocab_size)
        words = mask.bitmask.to(self.device, non_blocking=True)
        allowed = ((words[:, :, None] >> self._bit_shifts) & 1).flatten(1)[:, : self.vocab_size]
        rows = to_device(mask.rows, torch.long, logits.device)
        masked = logits.index_select(0, rows).masked_fill_(allowed == 0, float("-inf"))
        return logits.index_copy(0, rows, masked)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.triton_argmax:
            from engine.kernels.argmax import argmax_rows  # imports triton

            return argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Token ids [n] for rows that are all non-greedy (temperature > 0, top_k != 1)."""
        temperature = to_device([p.temperature for p in params], torch.float32, logits.device)
        logits = logits / temperature[:, None]
        logits = self._apply_min_p(logits, params)
        logits = self._apply_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)  # dropped tokens are exactly 0
        noise = self._exponential_noise(probs.shape, generators)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Set to -inf every logit whose probability is below the row's min_p times its most
        likely token's: p_i < min_p * p_max, compared as logit_i - logit_max < log(min_p) (the
        softmax's normalisation cancels). A row with min_p 0 (log: -inf) keeps every logit."""
        if not any(p.min_p > 0 for p in params):
            return logits
        floor = to_device([p.min_p for p in params], torch.float32, logits.device).log()
        below = logits - logits.max(dim=-1, keepdim=True).values < floor[:, None]
        return logits.masked_fill(below, float("-inf"))

    def _apply_top_k_top_p(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> torch.Tensor:
        """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus
        (the probabilities renormalised over the top-k):

            probs (descending)  0.50  0.30  0.15  0.05     top_p = 0.8
            mass before         0.00  0.50  0.80  0.95
            kept                yes   yes   no    no       (mass before < top_p)

        Order is (logit descending, id ascending), as a stable sort gives it, so equal logits
        keep the lower id first and the choice is reproducible. Rows without top-k or top-p
        come out untouched, which keeps a seeded row's tokens independent of its batch.

        On the CPU (`candidates_first`), the rows' TOP_CANDIDATES most likely tokens come first
        (a top-k, ~18x cheaper than sorting 128k logits there); only rows whose nucleus they
        do not settle — it reaches their last one, or a top-k past them — sort the whole
        vocabulary. A GPU sorts every row.
        """
        rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if not rows:
            return logits
        if len(rows) == len(params):
            return self._top_k_top_p_rows(logits, params)
        index = to_device(rows, torch.long, logits.device)
        some = self._top_k_top_p_rows(logits.index_select(0, index), [params[i] for i in rows])
        return logits.index_copy(0, index, some)

    def _top_k_top_p_rows(self, logits: torch.Tensor, params: list[SamplingParams]
                          ) -> torch.Tensor:
        vocab = logits.shape[-1]
        k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long,
                      logits.device)
        top_p = to_device([p.top_p for p in params], torch.float32, logits.device)
        if TOP_CANDIDATES >= vocab or not self.candidates_first:
            return self._sorted_top_k_top_p(logits, k, top_p,
                                            use_top_k=any(0 < p.top_k < vocab for p in params),
                                            use_top_p=any(p.top_p < 1.0 for p in params))
        out, settled = self._nucleus_of_candidates(logits, k, top_p, TOP_CANDIDATES)
        unsettled = (~settled).nonzero().flatten()
        if unsettled.numel():  # (one host sync: which rows need the whole sort)
            out.index_copy_(0, unsettled, self._sorted_top_k_top_p(
                logits.index_select(0, unsettled), k[unsettled], top_p[unsettled]))
        return out

    @staticmethod
    def _nucleus_of_candidates(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                               size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k / top-p filtered logits computed from each row's `size` most likely
        tokens, and whether that settled the row: its nucleus ends before the last candidate
        with a strictly higher logit than the last one's (so no token left out ties with a
        kept one), and its top-k (if any) is within the candidates."""
        values, ids = logits.topk(size, dim=-1)  # descending; ties in no particular order
        ids, by_id = ids.sort(dim=-1)
        candidates, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, order)  # now (logit descending, id ascending), as a stable sort
        vocab = logits.shape[-1]
        in_top_k = torch.arange(size, device=logits.device) < k[:, None]
        kept_logits = candidates.masked_fill(~in_top_k, float("-inf"))
        # top-p's probabilities: over the top-k when a row has one, else over the whole row
        has_k = k < vocab
        norm = torch.where(has_k, kept_logits.logsumexp(-1), logits.logsumexp(-1))
        probs = (kept_logits - norm[:, None]).exp()
        mass_before = probs.cumsum(-1) - probs
        keep = in_top_k & (mass_before < _nucleus_bound(top_p)[:, None])
        count = keep.sum(-1)
        last_kept = candidates.gather(-1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
        settled = (count < size) & (last_kept > candidates[:, -1]) & (~has_k | (k <= size))
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(-1, ids, candidates.masked_fill(~keep, float("-inf")))
        return out, settled

    def _sorted_top_k_top_p(self, logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                            use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
        """The same filter by sorting each whole row (stable: equal logits keep the lower id
        first). `use_top_k` / `use_top_p` False: no row has one, so its passes are skipped."""
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        if use_top_k:
            sorted_logits.masked_fill_(self._positions[: logits.shape[-1]] >= k[:, None],
                                       float("-inf"))
        if use_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # 0 for the top
            sorted_logits.masked_fill_(mass_before >= _nucleus_bound(top_p)[:, None],
                                       float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _exponential_noise(
        self, shape: torch.Size, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """Exponential(1) noise [n, V]: seeded rows from their own generator, the rest shared."""
        n, vocab = shape
        noise = torch.empty(shape, device=self.device)
        shared_rows = [j for j, g in enumerate(generators) if g is None]
        if len(shared_rows) == n:
            noise.exponential_(generator=self.generator)
        elif shared_rows:
            shared = torch.empty(len(shared_rows), vocab, device=self.device)
            shared.exponential_(generator=self.generator)
            noise[to_device(shared_rows, torch.long, self.device)] = shared
        for j, generator in enumerate(generators):
            if generator is not None:
                # A standalone [V] draw: the same stream whatever the batch's shape.
                noise[j] = torch.empty(vocab, device=self.device).exponential_(generator=generator)
        # An exact 0 would make probs / noise inf (or nan for dropped tokens).
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _logprobs(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        wanted: list[int],
        num_top: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw-distribution logprobs, on the device, for the `wanted` rows: the chosen token's
        [n], and the top-k values and ids [n, k] (k = `num_top`, the most any row asked,
        best first)."""
        rows = to_device(wanted, torch.long, logits.device)
        logprobs = logits.index_select(0, rows).log_softmax(dim=-1)
        chosen = logprobs.gather(1, token_ids.index_select(0, rows)[:, None]).squeeze(1)
        top_values, top_ids = logprobs.topk(min(num_top, self.vocab_size), dim=-1)
        return chosen, top_values, top_ids

