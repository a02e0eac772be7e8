"""The launcher: the `microserve` command (cli.py) and `microserve up` (up.py), above the router
and the engine, which it starts and wires together. Nothing below imports it.

    microserve up CONFIG       a deployment from one file: engines, transfer keys, the router
    microserve engine ...      one engine (engine/frontend/server.py)
    microserve router ...      one router (router/server.py)
    microserve drain ...       drain an engine through a router's admin API
    microserve admin-token     the admin token a running router made for itself
    microserve model-path      the directory a --model resolves to (the tokenizer path)
    microserve quantize ...    an fp8 copy of a checkpoint
"""
