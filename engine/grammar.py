"""Constrained decoding in the engine core: one llguidance matcher per constrained request.

A request whose `SamplingParams.grammar` is set (an llguidance grammar, built and validated by
the frontend from `response_format`, `guided_*` or a forced tool call) gets a matcher when it is
added. Each step then:

    _resolve (step N's tokens on the host)           _sample (step N+1)
      accept(request, token) for each constrained      step_mask(rows): the allowed-token
      row; then fill_masks(requests): every             bitmasks of the constrained rows,
      matcher's next mask, in one parallel call         stacked [n, ceil(V / 32)], for the
      (llguidance's executor, GIL dropped)              sampler to apply before it samples

so the mask for step N+1 is computed on the host right after step N's token is accepted, while
the GPU runs step N+1's forward pass (EngineCore.step launches it first and samples once the
masks are there); the sampler only copies the mask to the device and applies it.
Bit t % 32 of word t // 32 is set when token t is allowed. The eos ids are allowed only where
the grammar accepts; once the grammar cannot go on (`is_stopped`), the request ends with "stop".

The tokenizer view (a vocabulary scan, ~150 ms for 49k tokens) is built at the first
constrained request, then kept. Building a matcher takes well under a millisecond for the
schemas requests carry (docs/benchmarks.md), bounded for any grammar by llguidance's parser
limits, so it happens on the step loop's thread when the request is added. A grammar the
frontend did not check (a direct microserving call) that fails to build is a 400 naming
`grammar`; a matcher never raises on a token, it enters an error state (the request is then
aborted rather than sampled from an empty mask).
"""

from __future__ import annotations

import logging
from pathlib import Path

import llguidance
import torch

from engine.sampler import TokenMask
from microserve.backend import RequestRejected
from microserve.bounds import MAX_GRAMMAR_CHARS
from microserve.messages import SamplingParams

log = logging.getLogger(__name__)


class GrammarMatchers:
    """The matchers of one engine core's constrained requests, keyed by request id.

    Written by the engine core only: `add` when a request is added, `accept` and `fill_masks`
    when its tokens are resolved, `remove` when it leaves (finished, aborted or failed).

    Args:
        model_dir: holds the `tokenizer.json` the matchers see tokens through.
        vocab_size: the model's vocabulary (logit columns), which may exceed the tokenizer's.
        eos_token_ids: the ids a grammar may end on.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32  # int32 words per mask row
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at first use
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._masks: dict[str, torch.Tensor] = {}  # request id -> its next step's [W] bitmask

    what = "grammar matchers"  # a RequestSideTable (engine/requests.py)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def request_ids(self) -> list[str]:
        return list(self._matchers)

    def _tokenizer_view(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            path = self.model_dir / "tokenizer.json"
            if not path.exists():
                raise RequestRejected(f"constrained decoding needs the model's tokenizer.json, "
                                      f"which {self.model_dir} lacks", "grammar")
            try:
                self._tokenizer = llguidance.LLTokenizer(
                    path.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            except (ValueError, RuntimeError) as e:  # e.g. a word-level tokenizer (random:)
                raise RequestRejected(f"constrained decoding cannot read this model's "
                                      f"tokenizer.json: {e}", "grammar") from None
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    def add(self, request_id: str, grammar: str) -> None:
        """Build the request's matcher and its first mask.

        Raises:
            RequestRejected: the grammar is too large or does not build (the message is
                llguidance's).
        """
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise RequestRejected(f"grammar of {len(grammar)} characters exceeds "
                                  f"{MAX_GRAMMAR_CHARS}", "grammar")
        matcher = llguidance.LLMatcher(self._tokenizer_view(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestRejected(f"invalid grammar: {matcher.get_error()}", "grammar")
        self._matchers[request_id] = matcher
        self._masks[request_id] = self._new_mask_row()
        self.fill_masks([request_id])

    def admit(self, request_id: str, params: SamplingParams) -> None:
        """A matcher for a request with a grammar (`add`); nothing for one without."""
        if params.grammar is not None:
            self.add(request_id, params.grammar)

    def remove(self, request_id: str) -> None:
        """Forget the request's matcher and mask (unknown ids are ignored)."""
        self._matchers.pop(request_id, None)
        self._masks.pop(request_id, None)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher by its sampled token.

        Returns:
            True when the request must end here: its grammar is complete and allows nothing
            more, or the matcher failed (logged; cannot happen for a token its mask allowed).
        """
        matcher = self._matchers[request_id]
        if not matcher.consume_token(token) or matcher.is_error():
            log.error("request %s: grammar matcher failed at token %d: %s", request_id, token,
                      matcher.get_error())
            return True
        return matcher.is_stopped()

    def fill_masks(self, request_ids: list[str]) -> None:
        """Compute the next mask of each request (after its token was accepted), together."""
        if not request_ids:
            return
        bitmask = torch.empty(len(request_ids), self._words, dtype=torch.int32)
        matchers = [(self._matchers[r], i) for i, r in enumerate(request_ids)]
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), self._words * 4,
                                               len(request_ids))
        for i, request_id in enumerate(request_ids):
            self._masks[request_id].copy_(bitmask[i])

    def step_mask(self, request_ids: list[str]) -> TokenMask | None:
        """The masks of a step's sampled rows (one request id per row), or None when no row
        is constrained: an unconstrained batch is sampled exactly as before."""
        rows = [i for i, r in enumerate(request_ids) if r in self._matchers]
        if not rows:
            return None
        bitmask = torch.stack([self._masks[request_ids[i]] for i in rows])
        if torch.cuda.is_available():
            bitmask = bitmask.pin_memory()  # so the sampler's copy to the device is async
        return TokenMask(rows, bitmask)

    def _new_mask_row(self) -> torch.Tensor:
        return torch.full((self._words,), -1, dtype=torch.int32)
