"""The front of vLLM's 1P1D layout: one OpenAI completions endpoint over a prefill server and a
decode server that move KV with vLLM's NixlConnector (bench.peers --gpus 2 --layouts pd).

    python -m bench.peers.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

vLLM ships such a proxy only in its source tree (examples/.../disagg_proxy_server.py, not in
the wheel), so this is ours, written to the protocol the connector reads in vLLM 0.24.0:

1. The prefill request is the client's with `max_tokens` 1, no streaming, and
   `kv_transfer_params = {"do_remote_decode": True, ...}`. vllm/distributed/kv_transfer/
   kv_connector/v1/nixl/pull_scheduler.py, `request_finished` (line ~203): a request whose
   params say `do_remote_decode` is P's; when it finishes, P holds its blocks (for
   `kv_lease_duration` s) and returns `do_remote_prefill=True` with its engine id, block ids,
   side-channel host and port, and request id (lines ~266-276).
2. The completions response carries those params back (vllm/entrypoints/openai/completion/
   serving.py, line ~595: `kv_transfer_params = final_res_batch[0].kv_transfer_params`).
3. The decode request is the client's own, streamed as asked, with those params: D's scheduler
   (nixl/base_scheduler.py, line ~180, `params.get("do_remote_prefill")`) allocates blocks,
   reads P's over NIXL, and computes from there.

The P2P NCCL connector, whose protocol instead encodes the two servers' ZeroMQ addresses in
the request id, is not in vLLM 0.24.0 (its connector factory registers no P2pNcclConnector).
"""

from __future__ import annotations

import argparse
import contextlib

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# what P reads to know that the request's KV goes to a decode server (nixl/pull_scheduler.py)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> dict:
    """The client's request as P must see it: one token, not streamed (vLLM refuses
    stream_options without stream), marked for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS)}


def decode_body(body: dict, prefill_answer: dict) -> dict:
    """The client's request as D must see it: P's answer's kv_transfer_params say where the KV
    is. No params (P did not hold the blocks) leaves D to compute the prompt itself."""
    return body | {"kv_transfer_params": prefill_answer.get("kv_transfer_params")}


def app(prefill: str, decode: str) -> Starlette:
    # one client for both: no timeout, a 3,000-token prompt may queue long under load
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

    async def completions(request: Request) -> Response:
        body = await request.json()
        answer = await client.post(prefill + "/v1/completions", json=prefill_body(body))
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type"))
        second = client.build_request("POST", decode + "/v1/completions",
                                      json=decode_body(body, answer.json()))
        resp = await client.send(second, stream=True)
        if not body.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, resp.status_code,
                            media_type=resp.headers.get("content-type"))
        return StreamingResponse(resp.aiter_raw(), resp.status_code,
                                 media_type=resp.headers.get("content-type"),
                                 background=BackgroundTask(resp.aclose))

    async def models(request: Request) -> Response:
        answer = await client.get(decode + "/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def health(request: Request) -> Response:
        codes = []
        for base in (prefill, decode):
            try:
                codes.append((await client.get(base + "/health")).status_code)
            except httpx.TransportError:
                codes.append(503)
        ok = all(c == 200 for c in codes)
        return JSONResponse({"prefill": codes[0], "decode": codes[1]}, 200 if ok else 503)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)],
                     lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prefill", required=True, help="the prefill server's base URL (no /v1)")
    ap.add_argument("--decode", required=True, help="the decode server's base URL (no /v1)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    uvicorn.run(app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
