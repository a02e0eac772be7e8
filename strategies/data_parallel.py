"""Data parallel (paper §3.2, example 1): each request goes whole to one engine."""

from router.strategy import Strategy

POLICIES = ("round_robin", "least_loaded", "prefix")


class DataParallel(Strategy):
    def __init__(self, policy: str = "round_robin", imbalance: int = 8):
        """
        Args:
            policy: "round_robin" (the paper's), "least_loaded" (fewest calls open), or
                "prefix": the engine the router's prefix index says holds the longest prefix
                of the prompt, among those with at most `imbalance` calls open more than the
                least loaded one (so that requests sharing a prefix, such as a batch's subtree,
                go to the engine that has it cached, without piling onto it).
        """
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        if imbalance < 0:
            raise ValueError(f"imbalance {imbalance} must be at least 0")
        self.policy, self.imbalance = policy, imbalance

    async def generate(self, request, engines):
        if self.policy == "prefix":
            engine = self._holder(request, engines)
        elif self.policy == "least_loaded":
            engine = engines.least_loaded()
        else:
            engine = engines.round_robin()
        async for chunk in engine.start_generate(request, begin=0):
            yield chunk

    def _holder(self, request, engines):
        least = engines.least_loaded()
        held = engines.prefix_index.match(request.prompt, request.adapter)
        near = [e for e in engines.routable()
                if e.open_calls <= least.open_calls + self.imbalance]
        # Longest cached prefix first; then the less loaded (least_loaded's own order).
        return max(near, key=lambda e: (held.get(e.name, 0), e is least, -e.open_calls))

    def describe(self) -> dict:
        if self.policy == "prefix":
            return {"policy": self.policy, "imbalance": self.imbalance}
        return {"policy": self.policy}
