"""Prefill/decode disaggregation, context-cache aware (paper §3.2, examples 2 and 3).

    D.prep_recv(end=-1)                    D matches its cache, reserves prompt[matched:-1]
                                           (waiting its turn if D's pages are taken)
    P.remote_send(matched, -1, kv_addr)    P computes (or copies from its cache) and writes it
    D.start_generate(begin=-1)             D prefills the last token, samples, decodes

P is skipped when D already holds all of prompt[:-1]. With several engines of a role (1PnD,
nPnD) the least loaded one is picked; engines with role "any" can serve either side. With no
prefill engine up, D serves the whole request; with no decode engine up, any engine does
(`engines.prefill_decode()`; counted in microserve_router_pd_fallbacks_total).
"""

from router.strategy import Strategy


class PrefillDecode(Strategy):
    async def generate(self, request, engines):
        prefill, decode = engines.prefill_decode()
        last = len(request.prompt) - 1
        begin = 0
        if prefill is not None and last > 0:
            recv = await decode.prep_recv(request, end=last)
            if recv.matched < last:
                await prefill.remote_send(request, recv.matched, last, recv.kv_addr)
            begin = last
        async for chunk in decode.start_generate(request, begin=begin):
            yield chunk
