"""BlockLLM's split migration of a context (issue 41, item 5): the destination computes the
head of the context itself while the source copies the tail into its reservation, and the two
meet where each is done at about the same time.

    destination.prep_recv(end=n, own=k)    reserve [matched, n); the source writes [k, n)
    ┌ destination: a one-token request on prompt[:k]  (computes and caches the head)
    └ source.remote_send(k, n, kv_addr)               (copies the tail), at once, side by side
    destination.commit()                   grafts the head's cached pages before the tail

The split `k` is a share of the context (whole pages): given, or `auto`: the share that makes
both sides take equally long at the rates measured on earlier split migrations between the
same engines (the destination's prefill tokens/s on the head, the pair's copy tokens/s on the
tail; half-and-half until both are known):

    k / prefill_rate = (n - k) / copy_rate   =>   k = n * prefill_rate / (prefill_rate + copy_rate)

If the head is not in the destination's cache by the commit (evicted meanwhile), the engine
caches nothing it cannot vouch for: `cached` then counts only what it held before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from microserve.messages import SamplingParams
from router.strategy import Request as StrategyRequest

EWMA = 0.5  # weight of the newest measurement


class SplitRates:
    """The rates `auto` splits by, measured on each split migration."""

    def __init__(self):
        self.prefill: dict[str, float] = {}  # destination -> tokens/s computing the head
        self.copy: dict[tuple[str, str], float] = {}  # (source, destination) -> tokens/s

    def share(self, source: str, destination: str) -> float:
        """The share of a context the destination should compute itself."""
        prefill, copy = self.prefill.get(destination), self.copy.get((source, destination))
        if prefill is None or copy is None:
            return 0.5
        return prefill / (prefill + copy)

    def record(self, source: str, destination: str, head: int, head_s: float, tail: int,
               tail_s: float) -> None:
        if head and head_s > 0:
            self.prefill[destination] = _ewma(self.prefill.get(destination), head / head_s)
        if tail and tail_s > 0:
            key = (source, destination)
            self.copy[key] = _ewma(self.copy.get(key), tail / tail_s)

    def describe(self) -> dict:
        return {"prefill_tokens_per_s": dict(self.prefill),
                "copy_tokens_per_s": {f"{s}->{d}": r for (s, d), r in self.copy.items()}}


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else EWMA * new + (1 - EWMA) * old


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
