"""The OpenAI-compatible server that the router and every engine run (no torch):

    app.py            the routes and `build_openai_app`: validate, tokenize, generate, answer
    protocol.py       the request bodies it accepts
    responses.py      the JSON it answers with: bodies, stream chunks, usage, model cards
    runs.py           a choice in flight, its deltas, choices side by side, their SSE events
    middleware.py     ASGI middleware: the body bound, requests counted
    guided.py         structured outputs: a request's constraint as a grammar
    tools.py          tools and tool_choice; tool_schemas.py: a tool call's grammar;
    tool_parsers.py   tool calls read out of the generated text
"""
