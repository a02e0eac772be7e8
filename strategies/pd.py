"""Prefill/decode disaggregation, context-cache aware (paper §3.2, examples 2 and 3).

    D.prep_recv(end=n)                     D matches its cache, reserves prompt[matched:n]
                                           (waiting its turn if D's pages are taken)
    P.remote_send(matched, n, kv_addr,     P computes (or copies from its cache) and writes it,
                  sampling)                and samples the first token
    D.start_generate(begin=n, first_token) D emits that token at once and decodes

(`prefill.send_prompt(request, decode)`). Where the first token must be sampled on D (logprobs,
a grammar, logit_bias, min_tokens or penalties, a seeded random sample) P sends prompt[:-1]
and D computes the last token.

P is skipped when D already holds all of prompt[:-1]. With several engines of a role (1PnD,
nPnD) the least loaded one is picked; engines with role "any" can serve either side. With no
prefill engine up, D serves the whole request; with no decode engine up, any engine does
(`engines.prefill_decode()`; counted in microserve_router_pd_fallbacks_total).
"""

from router.strategy import Strategy


class PrefillDecode(Strategy):
    async def generate(self, request, engines):
        prefill, decode = engines.prefill_decode()
        begin, first = 0, None
        if prefill is not None and len(request.prompt) > 1:
            begin, first = await prefill.send_prompt(request, decode)
        async for chunk in decode.start_generate(request, begin=begin, first_token=first):
            yield chunk
