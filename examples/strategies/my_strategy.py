# The strategy of docs/router.md's "Write your own": short prompts to the least loaded engine,
# long ones split across a prefill and a decode engine. `make serve` loads strategy files from
# this directory: PUT /admin/strategy {"path": "my_strategy.py"} (README.md).
from router.strategy import Strategy

class ShortLocalLongSplit(Strategy):
    def __init__(self, threshold: int = 512):
        self.threshold = threshold

    async def generate(self, request, engines):
        n = len(request.prompt)
        if n < self.threshold:
            engine = engines.least_loaded()
            async for chunk in engine.start_generate(request, begin=0):
                yield chunk
            return
        d = engines.least_loaded("decode")
        p = engines.least_loaded("prefill", exclude=(d.name,))
        recv = await d.prep_recv(request, end=n - 1)          # D reserves what it lacks
        if recv.matched < n - 1:
            await p.remote_send(request, recv.matched, n - 1, recv.kv_addr)  # P fills it
        async for chunk in d.start_generate(request, begin=n - 1):  # D: last token, decode
            yield chunk
