"""LoRA affinity: each request whole on the engine that scores best for it (router/affinity.py).

    score = adapter_weight * (1.0 resident, 0.8 a slot free, 0.6 evicts another adapter,
                              0.3 waits: every slot's adapter has requests open there)
          + prefix_weight  * (share of the prompt the engine holds, for this adapter)
          + load_weight    * (1 - its load / the highest load among the candidates)

So requests for an adapter go where it is resident already (no slot copy, no eviction of an
adapter another request is about to need), and to where their prefix is cached under it,
unless that engine is much busier than the rest. Requests for the base model are placed by
prefix and load alone. As with every strategy, an adapter's requests are only ever routed to
engines that have it registered (router/backend.py); llm-d's router scores the same way.
"""

from router.affinity import Weights
from router.strategy import Strategy


class LoraAffinity(Strategy):
    def __init__(self, adapter_weight: float = 1.0, prefix_weight: float = 1.0,
                 load_weight: float = 0.5):
        """
        Args:
            adapter_weight, prefix_weight, load_weight: the score's weights, each in [0, 100].
        """
        self.weights = Weights(adapter_weight, prefix_weight, load_weight)

    async def generate(self, request, engines):
        engine = engines.by_affinity(request, weights=self.weights)
        async for chunk in engine.start_generate(request, begin=0):
            yield chunk

    def describe(self) -> dict:
        w = self.weights
        return {"adapter_weight": w.adapter, "prefix_weight": w.prefix, "load_weight": w.load}
