"""OpenAI's Files and Batches API on the router (docs/batches.md): `store` keeps files,
batches and lines in a data directory, `order` orders a batch (BlendServe), `runner` runs its
lines through the router's own app, `admission` keeps them behind live traffic, `api` serves
the routes."""
