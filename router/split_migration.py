"""BlockLLM's split migration of a context (issue 41, item 5): the destination computes the
head of the context itself while the source copies the tail into its reservation, and the two
meet where each is done at about the same time.

    destination.prep_recv(end=n, own=k)    reserve [matched, n); the source writes [k, n)
    ┌ destination: a one-token request on prompt[:k]  (computes and caches the head)
    └ source.remote_send(k, n, kv_addr)               (copies the tail), at once, side by side
    destination.commit()                   grafts the head's cached pages before the tail

The split `k` is a share of the context (whole pages): given, or `auto`, from the times of
earlier split migrations between the same engines. Each side's time is fit as a line, a fixed
cost plus a cost per token (least squares over its latest samples: the destination computing
heads, the pair copying tails), and `auto` takes the fastest of a pure copy, a pure recompute
and the split where both sides are predicted done together,

    head_fixed + k / prefill_rate = copy_fixed + (n - k) / copy_rate,

taking the split only where it is predicted at least SPLIT_MARGIN faster than the faster pure
move: a split costs two requests' overheads, and a small head costs more than its tokens say
(2x H200, 8,192 tokens over cuda_ipc: a split that computed 656 tokens took 28 ms against a
pure copy's 20; docs/benchmarks.md). Half-and-half until both sides have a sample.

If the head is not in the destination's cache by the commit (evicted meanwhile), the engine
caches nothing it cannot vouch for: `cached` then counts only what it held before.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from microserve.messages import SamplingParams
from router.strategy import Request as StrategyRequest

SAMPLES = 16  # each side's line is fit to its latest samples
SPLIT_MARGIN = 0.15  # a split must be predicted this much faster than the faster pure move


class _Line:
    """seconds = fixed + tokens * per_token, fit to the latest (tokens, seconds) samples; with
    one size only (or a fit with a negative part), no fixed cost: the mean rate."""

    def __init__(self):
        self.samples: deque[tuple[int, float]] = deque(maxlen=SAMPLES)

    def add(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        n = len(self.samples)
        tokens = sum(t for t, _ in self.samples)
        seconds = sum(s for _, s in self.samples)
        mean_t, mean_s = tokens / n, seconds / n
        var = sum((t - mean_t) ** 2 for t, _ in self.samples)
        if var > 0:
            slope = sum((t - mean_t) * (s - mean_s) for t, s in self.samples) / var
            fixed = mean_s - slope * mean_t
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, seconds / tokens


def _predict(line: tuple[float, float], tokens: int) -> float:
    """Seconds for `tokens` on a side fit as `line` (`_Line.fit`); no tokens: no request."""
    fixed, per_token = line
    return fixed + tokens * per_token if tokens > 0 else 0.0


class SplitRates:
    """What `auto` splits by: each destination's head times and each pair's copy times."""

    def __init__(self):
        self.prefill: dict[str, _Line] = {}  # destination -> heads it computed
        self.copy: dict[tuple[str, str], _Line] = {}  # (source, destination) -> tails copied

    def share(self, source: str, destination: str, tokens: int) -> float:
        """The share of a `tokens`-long context the destination should compute itself."""
        head, tail = self.prefill.get(destination), self.copy.get((source, destination))
        if head is None or tail is None or tokens <= 0:
            return 0.5
        head, tail = head.fit(), tail.fit()
        (h0, h), (c0, c) = head, tail
        copy_s, recompute_s = _predict(tail, tokens), _predict(head, tokens)
        own = min(max((c0 - h0 + tokens * c) / (h + c), 0.0), float(tokens))
        split_s = max(_predict(head, round(own)), _predict(tail, tokens - round(own)))
        best_pure = min(copy_s, recompute_s)
        if split_s < (1 - SPLIT_MARGIN) * best_pure:
            return own / tokens
        return 0.0 if copy_s <= recompute_s else 1.0

    def record(self, source: str, destination: str, head: int, head_s: float, tail: int,
               tail_s: float) -> None:
        if head and head_s > 0:
            self.prefill.setdefault(destination, _Line()).add(head, head_s)
        if tail and tail_s > 0:
            self.copy.setdefault((source, destination), _Line()).add(tail, tail_s)

    def describe(self) -> dict:
        def rates(lines: dict) -> dict:
            return {_name(key): 1 / line.fit()[1] for key, line in lines.items()}

        def fixed(lines: dict) -> dict:
            return {_name(key): line.fit()[0] for key, line in lines.items()}

        return {"prefill_tokens_per_s": rates(self.prefill),
                "copy_tokens_per_s": rates(self.copy),
                "prefill_fixed_s": fixed(self.prefill), "copy_fixed_s": fixed(self.copy)}


def _name(key) -> str:
    return key if isinstance(key, str) else f"{key[0]}->{key[1]}"


@dataclass
class SplitSend:
    """What a split moved: positions [0, own) computed on the destination (`head` of them
    there, the rest it held), [sent_from, end) sent by the source (`sent`: its answer)."""

    own: int
    head: int
    head_s: float
    sent: object  # RemoteSendResponse | None
    copy_s: float
    matched: int


async def split_send(pool, source, destination, request: StrategyRequest, end: int,
                     share: float, rates: SplitRates) -> SplitSend:
    """Put the KV of `request.prompt[:end]` into a reservation on `destination`, which
    computes `share` of it (rounded down to its whole pages) as a request of its own while
    `source` sends the rest, side by side. The caller then adopts it (`commit`, or
    `start_generate(begin=end)`). On any failure the head's request is released on every
    engine (the caller releases `request`)."""
    page = destination.info.page_size if destination.info else 16
    own = min(int(end * share) // page * page, max(0, end - 1) // page * page)
    head_request = StrategyRequest(f"{request.request_id}-head", request.prompt[:own],
                                   SamplingParams(max_tokens=1, lora_name=request.adapter))
    try:
        recv = await destination.prep_recv(request, end=end, own=own or None)
        head, tail = max(0, own - recv.matched), end - recv.kv_addr.begin

        async def compute_head() -> float:
            if head <= 0:
                return 0.0
            started = time.perf_counter()
            async for _ in destination.start_generate(head_request):
                pass
            return time.perf_counter() - started

        async def copy_tail():
            if tail <= 0:
                return None, 0.0
            started = time.perf_counter()
            sent = await source.remote_send(request, recv.kv_addr.begin, end, recv.kv_addr)
            return sent, time.perf_counter() - started

        head_s, (sent, copy_s) = await asyncio.gather(compute_head(), copy_tail())
    except BaseException:
        await asyncio.shield(pool.release(head_request))
        raise
    rates.record(source.name, destination.name, head, head_s, tail, copy_s)
    return SplitSend(own, head, head_s, sent, copy_s, recv.matched)


async def split_migrate(pool, source, destination, request: StrategyRequest, share: float,
                        rates: SplitRates, pin: bool = False) -> dict:
    """Move `request.prompt` from `source` to `destination` of `pool` by `split_send`, then
    commit it there. Returns what moved, what was computed where, and the times."""
    try:
        done = await split_send(pool, source, destination, request, len(request.prompt),
                                share, rates)
        committed = await destination.commit(request, pin)
    except BaseException:
        await asyncio.shield(pool.release(request))
        raise
    sent = done.sent
    return {"tokens": len(request.prompt), "already_cached": done.matched, "own": done.own,
            "computed_on_destination": done.head, "sent": sent.sent if sent else 0,
            "computed": sent.computed if sent else 0, "reused": sent.reused if sent else 0,
            "cached": committed.cached, "pinned": committed.pinned,
            "head_s": round(done.head_s, 6), "copy_s": round(done.copy_s, 6)}
