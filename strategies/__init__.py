"""Built-in strategies: one short module each, loaded by the router's strategy host.

    data_parallel       each request whole on one engine (round robin or least loaded)
    pd                  prefill on a prefill engine, decode on a decode engine (1PnD, cache aware)
    balanced_pd         P/D with the prompt's tail prefilled on D (fixed or adaptive ratio)
    context_migration   follow the context: route to its holder, move it when the holder is busy
    auto                per request, whole, P/D or balanced P/D: whichever the live
                        measurements price lowest (router/choice_model.py)
    lora_affinity       each request whole on the engine best by LoRA adapter residency, prefix
                        held and load (router/affinity.py)

Each is also a worked example of the strategy API (router/strategy.py); docs/router.md shows
how to write your own. No torch.
"""
