"""Data parallel (paper §3.2, example 1): each request goes whole to one engine."""

from router.strategy import Strategy

POLICIES = ("round_robin", "least_loaded")


class DataParallel(Strategy):
    def __init__(self, policy: str = "round_robin"):
        """
        Args:
            policy: "round_robin" (the paper's) or "least_loaded" (fewest calls open).
        """
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.policy = policy

    async def generate(self, request, engines):
        pick = engines.round_robin if self.policy == "round_robin" else engines.least_loaded
        async for chunk in pick().start_generate(request, begin=0):
            yield chunk

    def describe(self) -> dict:
        return {"policy": self.policy}
