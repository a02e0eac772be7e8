"""The engine's frontend process: HTTP (the OpenAI API and the microserving API), tokens in and
text out, and the client of its engine-core process. No torch: the core (engine/core/ and
what it runs, in its own process, engine/core_proc.py) holds the model.

    server.py            `microserve engine`: the app, served by uvicorn
    microserving_api.py  /microserving/* over the core client
    core_client.py       starts the core process and speaks to it over a socket
"""
