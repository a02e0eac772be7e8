"""Context migration (paper §3.2, example 4; §4.2): follow the context, move it when it pays.

The router's prefix index says which engine holds how much of each prompt. A request goes to
the engine holding the longest prefix of it, so its context is reused. When that holder is
busier than the least loaded engine by more than `max_imbalance` open calls, the request goes
to the least loaded engine instead, and the context moves with it:

    target.prep_recv(end=n)                       target reserves what it lacks of the prompt
    holder.remote_send(matched, n, kv_addr, ...)  holder copies its cached pages, computes the
                                                  rest, samples the first token
    target.start_generate(begin=n, first_token)   target decodes; it now holds the context too

(`holder.send_prompt(request, target)`: as in `pd`, the last prompt token is left to the
target where the first token must be sampled there).

so a hot context spreads to where its traffic goes instead of queueing on one engine. With
`split` (a share, or "auto"), a move is BlockLLM's split migration (router/split_migration.py):
the target computes that share of the prompt itself while the holder sends the rest, side by
side, and the target samples the first token. A
draining engine gets no new requests but still sends what it holds: draining it moves its
contexts away as their traffic arrives. Contexts shorter than `min_tokens` are not worth
moving: those requests go to the least loaded engine.
"""

from router.split_migration import SplitRates, split_send
from router.strategy import Strategy


class ContextMigration(Strategy):
    def __init__(self, min_tokens: int = 256, max_imbalance: int = 2,
                 split: float | str | None = None):
        """
        Args:
            min_tokens: the shortest held prefix worth following or moving.
            max_imbalance: open calls the holder may have beyond the least loaded engine's.
            split: move contexts by split migration, the target computing this share of the
                prompt (in [0, 1)), or "auto" (by the rates measured on earlier moves);
                None: the holder sends it all.
        """
        if min_tokens < 1 or max_imbalance < 0:
            raise ValueError(f"need min_tokens >= 1 and max_imbalance >= 0, got min_tokens "
                             f"{min_tokens}, max_imbalance {max_imbalance}")
        if split is not None and split != "auto" and not (
                isinstance(split, (int, float)) and 0 <= split < 1):
            raise ValueError(f"split must be a share in [0, 1) or 'auto', got {split!r}")
        self.min_tokens, self.max_imbalance, self.split = min_tokens, max_imbalance, split
        self.rates = SplitRates()
        self.followed = self.migrated = 0  # requests that went to a holder / moved a context

    async def generate(self, request, engines):
        idle = engines.least_loaded()
        up = {e.name for e in engines if e.up}  # draining engines still send
        matched = engines.prefix_index.match(request.prompt, request.adapter)
        held = {name: n for name, n in matched.items()
                if n >= self.min_tokens and name in up}
        holder = engines[max(held, key=held.get)] if held else None
        last = len(request.prompt) - 1
        if holder is None or held.get(idle.name, 0) >= held[holder.name]:
            target, source = idle, None
        elif holder.routable and holder.open_calls <= idle.open_calls + self.max_imbalance:
            target, source = holder, None
            self.followed += 1
        else:
            target, source = idle, holder
        begin, first = 0, None
        if source is not None and last > 0 and self.split is not None:
            share = (self.rates.share(source.name, target.name, last) if self.split == "auto"
                     else self.split)
            await split_send(engines, source, target, request, last, share, self.rates)
            begin = last  # the target computes the last prompt token and samples
            self.migrated += 1
        elif source is not None and last > 0:
            begin, first = await source.send_prompt(request, target)
            self.migrated += 1
        async for chunk in target.start_generate(request, begin=begin, first_token=first):
            yield chunk

    def describe(self) -> dict:
        return {"min_tokens": self.min_tokens, "max_imbalance": self.max_imbalance,
                "split": self.split, "split_rates": self.rates.describe(),
                "followed": self.followed, "migrated": self.migrated}
