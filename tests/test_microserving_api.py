"""The microserving HTTP layer (engine/frontend/microserving_api.py) and its client (EngineClient).

Over a scripted fake of the engine-core client's contract: these tests are about bodies,
formats, statuses, auth and disconnects; the real engine behind them is tested elsewhere.
In-process through httpx's ASGI transport, which buffers whole responses; the disconnect and
early-close tests run a real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time

import httpx
import msgpack
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI
from test_tokenizer import make_tokenizer_dir

from engine.frontend.core_client import _chunk
from engine.frontend.microserving_api import add_microserving_routes
from microserve import wire
from microserve.backend import BackendUnavailable, GenerateBackend, MicroservingError
from microserve.errors import install_error_handlers
from microserve.http_server import listen_socket
from engine.frames import Generate, ToCore
from microserve.messages import (
    AbortRequest,
    CommitRequest,
    EngineInfo,
    EngineStats,
    GenerateChunk,
    KVAddr,
    Liveness,
    PinRequest,
    PrepRecvRequest,
    PrepRecvResponse,
    RemoteSendRequest,
    RemoteSendResponse,
    StatsResponse,
    UnpinRequest,
    call_of,
    SamplingParams,
    TokenLogprob,
    TokenOutput,
    validator,
)
from microserve.microserving_client import EngineClient, _coalesced
from microserve.openai.app import build_openai_app
from microserve.tokenizer import Tokenizer

MSGPACK = "application/msgpack"
KEY = "sk-engine-test"
PROMPT = list(range(100, 111))
KV_ADDR = {"begin": 4, "end": 10, "ranges": [[40, 4], [9, 2]],
           "layout": {"model": "tiny", "dtype": "bfloat16", "page_size": 4, "num_layers": 2,
                      "num_kv_heads": 1, "head_dim": 8},
           "transfer": {"kind": "test", "rank": 1}, "window": [0, 2], "digest": "ab" * 32,
           "mac": "cd" * 32}
# What the core receives for KV_ADDR: the request as a dict, tuples included, the layout's
# defaults filled in (one rank).
KV_ADDR_ARGS = {**KV_ADDR, "ranges": [(40, 4), (9, 2)], "window": (0, 2),
                "layout": {**KV_ADDR["layout"], "tensor_parallel_size": 1, "total_kv_heads": 0}}

# route: (body, core result, the core's args, the core call's timeout)
CALLS = {
    "prep_recv": ({"request_id": "r1", "prompt": PROMPT, "end": 10},
                  {"matched": 4, "kv_addr": KV_ADDR},
                  {"request_id": "r1", "prompt": PROMPT, "end": 10, "lease_s": None,
                   "wait_s": None, "lora_name": None, "own": None}, None),
    "remote_send": ({"request_id": "r1", "prompt": PROMPT, "begin": 4, "end": 10,
                     "kv_addr": KV_ADDR},
                    {"sent": 6, "computed": 10, "reused": 0, "first_token": None},
                    {"request_id": "r1", "prompt": PROMPT, "begin": 4, "end": 10,
                     "kv_addr": KV_ADDR_ARGS, "sampling": None, "queue_s": None,
                     "priority": 0, "lora_name": None}, None),
    "commit": ({"request_id": "r1", "pin": True}, {"cached": 8, "pinned": True},
               {"request_id": "r1", "pin": True}, 30.0),
    "abort": ({"request_id": "r1", "early_send": True}, {"aborted": True},
              {"request_id": "r1", "early_send": True}, 30.0),
    "pin": ({"prompt": PROMPT}, {"tokens": 8}, {"prompt": PROMPT}, 30.0),
    "unpin": ({"prompt": PROMPT}, {"tokens": 8}, {"prompt": PROMPT}, 30.0),
}
STATS = {**{f.name: 0 for f in dataclasses.fields(EngineStats) if f.type in ("int", "float")},
         "running": 1, "waiting": 0, "kv_pages_free": 12,
         "preemptions_by_reason": {"pages": 2, "priority": 1}, "mlfq_queue_requests": [3, 0, 1]}
INFO = {"model_name": "tiny", "model_dir": "/m", "device": "cpu", "dtype": "float32",
        "vocab_size": 64, "max_model_len": 64, "eos_token_ids": [2], "page_size": 4,
        "num_pages": 16, "kv_capacity_tokens": 64, "max_num_batched_tokens": 64,
        "max_num_seqs": 4, "kv_transfer": "none", "quantization": None,
        "kv_cache_dtype": None, "deployment": None}


class FakeCore(GenerateBackend):
    """engine.frontend.core_client.CoreClient's contract, scripted.

    `call(request)` returns `results[name]` (the name of the request's call), or raises it if
    it is an exception. `start_generate` raises `error` before any output if set; else yields
    the chunk the core client makes of one TokenOutput per entry of `steps` (the last one
    finished, unless `hang` or `fail`), then waits until closed (`hang`) or raises `fail`;
    closed before it finished, or failed by anything but the engine's own error, it aborts
    the request (the core client's contract).
    """

    model_name = "tiny"
    max_model_len = 64

    def __init__(self, steps=((11,), (12, 13), (14,)), *, logprobs: bool = False,
                 hang: bool = False, fail: Exception | None = None,
                 error: Exception | None = None):
        self.steps, self.logprobs, self.hang, self.fail, self.error = (
            steps, logprobs, hang, fail, error)
        self.info = INFO
        self.results = {name: result for name, (_, result, _, _) in CALLS.items()}
        self.results |= {"stats": STATS, "check_integrity": True}
        self.calls: list[tuple] = []  # (method, args, timeout_s)
        self.generate_calls: list[tuple] = []  # (request_id, prompt, begin, params)
        self.queue_times: list[tuple] = []  # (queue_s, received_at) of each start_generate
        self.priorities: list[int] = []  # of each start_generate
        self.aborted: list[str] = []

    async def call(self, request, timeout_s=30.0, received_at=0.0):
        method = call_of(request).name
        self.calls.append((method, dataclasses.asdict(request) or None, timeout_s))
        result = self.results[method]
        if isinstance(result, Exception):
            raise result
        if result == "hang":
            await asyncio.Event().wait()
        return result

    async def start_generate(self, request_id, prompt, begin, params, first_token=None,
                             queue_s=None, received_at=0.0, priority=0,
                             first_token_delivered=False):
        self.generate_calls.append((request_id, prompt, begin, params))
        self.queue_times.append((queue_s, received_at))
        self.priorities.append(priority)
        if self.error:
            raise self.error
        num_generated, settled = 0, False
        try:
            for i, ids in enumerate(self.steps):
                last = i == len(self.steps) - 1 and not (self.hang or self.fail)
                logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), (7, -1.5)]) for t in ids]
                out = TokenOutput(request_id, list(ids), "stop" if last else None,
                                  logprobs if self.logprobs else None, len(prompt), 2)
                num_generated += len(ids)
                settled = last
                yield _chunk(out, num_generated, first=i == 0)
                await asyncio.sleep(0)
            if self.fail:
                settled = isinstance(self.fail, (MicroservingError, BackendUnavailable))
                raise self.fail
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not settled:
                await self.abort(request_id)

    def generate(self, request_id, prompt_token_ids, params, priority=0, choices_of=None):
        return self.start_generate(request_id, prompt_token_ids, 0, params)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def liveness(self):
        return Liveness(core_silent_s=0.125, steps=7, in_step_s=2.5)


def engine_app(core: FakeCore, api_key: str | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    add_microserving_routes(app, core, api_key=api_key)
    return app


@contextlib.asynccontextmanager
async def http_for(app: FastAPI):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
        yield http


@contextlib.asynccontextmanager
async def live_server(app):
    """Serve `app` on a free 127.0.0.1 port in this event loop; yields its base URL."""
    config = uvicorn.Config(app, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    sock = listen_socket("127.0.0.1", 0)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: server.started or task.done())
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def post(http: httpx.AsyncClient, route: str, body, fmt: str = "json") -> httpx.Response:
    if fmt == "json":
        return await http.post(f"/microserving/{route}", json=body)
    return await http.post(f"/microserving/{route}", content=msgpack.packb(body),
                           headers={"Content-Type": MSGPACK})


def decoded(response: httpx.Response):
    if response.headers["content-type"] == MSGPACK:
        return msgpack.unpackb(response.content)
    assert response.headers["content-type"] == "application/json"
    return response.json()


def error(message: str, param: str | None = None, type: str = "invalid_request_error",
          code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def chunk(token_ids, finish_reason=None, completion_tokens=0, logprobs=None,
          first=False) -> dict:
    usage = None if finish_reason is None else {
        "prompt_tokens": len(PROMPT), "completion_tokens": completion_tokens, "cached_tokens": 2}
    return {"token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish_reason,
            "usage": usage, "cached_tokens": 2 if first else None, "prompt_logprobs": None}


def plain(message) -> dict:
    """A message as plain data, as it goes over the wire (tuples become lists)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(message))


def logprobs(*ids) -> list[dict]:
    return [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5], [7, -1.5]]} for t in ids]


CHUNKS = [chunk([11], first=True), chunk([12, 13]), chunk([14], "stop", 4)]
GENERATE = {"request_id": "g1", "prompt": PROMPT, "begin": 3,
            "sampling": {"max_tokens": 4, "temperature": 0, "stop_token_ids": [2]}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


# -- request/response calls ----------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("route", list(CALLS))
async def test_call_round_trip(route, fmt):
    body, result, args, timeout_s = CALLS[route]
    core = FakeCore()
    async with http_for(engine_app(core)) as http:
        response = await post(http, route, body, fmt)
    assert response.status_code == 200
    assert response.headers["content-type"] == (MSGPACK if fmt == "msgpack" else
                                                "application/json")
    assert decoded(response) == result
    assert core.calls == [(route, args, timeout_s)]


async def test_accept_msgpack_answers_a_json_body_in_msgpack():
    async with http_for(engine_app(FakeCore())) as http:
        response = await http.post("/microserving/commit", json={"request_id": "r1"},
                                   headers={"Accept": MSGPACK})
    assert response.headers["content-type"] == MSGPACK
    assert msgpack.unpackb(response.content) == {"cached": 8, "pinned": True}


@pytest.mark.parametrize("accept", ["application/json", MSGPACK])
async def test_stats(accept):
    core = FakeCore()
    async with http_for(engine_app(core)) as http:
        plain = await http.get("/microserving/stats", headers={"Accept": accept})
        checked = await http.get("/microserving/stats?check=1", headers={"Accept": accept})
        core.results["check_integrity"] = RuntimeError("page 3 is both free and cached")
        broken = await http.get("/microserving/stats?check=1", headers={"Accept": accept})
    assert decoded(plain) == {"stats": STATS, "info": INFO}
    assert decoded(checked) == {"stats": STATS, "info": INFO, "integrity": "ok"}
    assert decoded(broken)["integrity"] == "page 3 is both free and cached"
    assert [c[0] for c in core.calls] == ["stats", "stats", "check_integrity", "stats",
                                          "check_integrity"]


@pytest.mark.parametrize(("exc", "status", "type", "code"), [
    (MicroservingError(404, "unknown request_id 'r1'", "request_id"), 404,
     "invalid_request_error", None),
    (MicroservingError(409, "request_id 'r1' is in use", "request_id"), 409,
     "invalid_request_error", None),
    (MicroservingError(502, "KV transfer to 10.0.0.2 failed", "kv_addr"), 502, "server_error",
     None),
    (MicroservingError(503, "no free KV pages: 6 needed, 2 free", "prompt"), 503, "server_error",
     None),
])
async def test_call_errors_keep_status_and_param(exc, status, type, code):
    core = FakeCore()
    core.results["remote_send"] = exc
    body = CALLS["remote_send"][0]
    async with http_for(engine_app(core)) as http:
        response = await post(http, "remote_send", body, "msgpack")
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json() == error(str(exc), exc.param, type, code)


async def test_engine_core_gone_is_503():
    core = FakeCore()
    core.results["prep_recv"] = BackendUnavailable("engine core process exited")
    async with http_for(engine_app(core)) as http:
        response = await post(http, "prep_recv", CALLS["prep_recv"][0])
    assert response.status_code == 503
    assert response.json() == error("Service unavailable: engine core process exited",
                                    type="server_error", code="service_unavailable")


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize(("route", "body", "param", "message"), [
    ("prep_recv", {"request_id": "r1", "prompt": []}, "prompt",
     ("Invalid value for 'prompt': List should have at least 1 item after validation, "
      "not 0 (got [])")),
    ("remote_send", {**CALLS["remote_send"][0], "kv_addr": {**KV_ADDR, "ranges": [["a", 4]]}},
     "kv_addr.ranges[0][0]",
     ("Invalid value for 'kv_addr.ranges[0][0]': Input should be a valid integer, unable to "
      "parse string as an integer (got \"a\")")),
    ("start_generate", {**GENERATE, "sampling": {"top_p": 0}}, "sampling.top_p",
     "Invalid value for 'sampling.top_p': Input should be greater than 0 (got 0)"),
    ("start_generate", {**GENERATE, "sampling": {"logit_bias": [[5, 101]]}},
     "sampling.logit_bias[0][1]",
     "Invalid value for 'sampling.logit_bias[0][1]': Input should be less than or equal to 100 "
     "(got 101)"),
    ("start_generate", {**GENERATE, "sampling": {"repetition_penalty": 2.5}},
     "sampling.repetition_penalty",
     "Invalid value for 'sampling.repetition_penalty': Input should be less than or equal to 2 "
     "(got 2.5)"),
    ("start_generate", {**GENERATE, "queue_s": 0}, "queue_s",
     "Invalid value for 'queue_s': Input should be greater than 0 (got 0)"),
    ("start_generate", {**GENERATE, "priority": 2**31}, "priority",
     "Invalid value for 'priority': Input should be less than or equal to 2147483647 "
     "(got 2147483648)"),
    ("remote_send", {**CALLS["remote_send"][0], "priority": 1.5}, "priority",
     "Invalid value for 'priority': Input should be a valid integer, got a number with a "
     "fractional part (got 1.5)"),
    ("commit", {}, "request_id", "Missing required field 'request_id'"),
])
async def test_validation_error_names_the_field(route, body, param, message, fmt):
    core = FakeCore()
    async with http_for(engine_app(core)) as http:
        response = await post(http, route, body, fmt)
    assert response.status_code == 400
    assert response.json() == error(message, param)
    assert core.calls == core.generate_calls == []


@pytest.mark.parametrize(("content", "message"), [
    (b"\x92\x01", "Malformed msgpack body: Unpack failed: incomplete input"),
    (b"\xc1", "Malformed msgpack body: FormatError"),  # a byte msgpack never uses
    (msgpack.packb({"request_id": "r1"}) + b"\x01",
     "Malformed msgpack body: unpack(b) received extra data."),
])
async def test_malformed_msgpack_is_400(content, message):
    async with http_for(engine_app(FakeCore())) as http:
        response = await http.post("/microserving/abort", content=content,
                                   headers={"Content-Type": MSGPACK})
    assert response.status_code == 400
    assert response.json() == error(message)


async def test_malformed_json_is_400():
    async with http_for(engine_app(FakeCore())) as http:
        response = await http.post("/microserving/abort", content=b'{"request_id": ')
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Malformed JSON body")


# -- start_generate --------------------------------------------------------------------------

async def test_start_generate_streams_ndjson():
    core = FakeCore()
    async with http_for(engine_app(core)) as http:
        response = await post(http, "start_generate", GENERATE)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    lines = [json.dumps(c, separators=(",", ":")) for c in CHUNKS]
    assert response.text == "\n".join(lines) + "\n"
    params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(2,))
    assert core.generate_calls == [("g1", PROMPT, 3, params)]
    assert core.aborted == []


async def test_start_generate_streams_msgpack_frames():
    core = FakeCore(logprobs=True)
    body = {**GENERATE, "sampling": {"logprobs": 1}}
    async with http_for(engine_app(core)) as http:
        response = await post(http, "start_generate", body, "msgpack")
    expected = [chunk([11], logprobs=logprobs(11), first=True), chunk([12, 13], logprobs=logprobs(12, 13)),
                chunk([14], "stop", 4, logprobs(14))]
    assert response.headers["content-type"] == MSGPACK
    assert response.content == b"".join(wire.encode(c) for c in expected)
    assert wire.FrameDecoder().feed(response.content) == expected


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("with_logprobs", [False, True])
async def test_start_generate_without_streaming(fmt, with_logprobs):
    core = FakeCore(logprobs=with_logprobs)
    sampling = {"logprobs": 0} if with_logprobs else {}
    async with http_for(engine_app(core)) as http:
        response = await post(http, "start_generate",
                              {**GENERATE, "sampling": sampling, "stream": False}, fmt)
    assert response.status_code == 200
    assert decoded(response) == chunk([11, 12, 13, 14], "stop", 4,
                                      logprobs(11, 12, 13, 14) if with_logprobs else None)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("exc", "status", "expected"), [
    (MicroservingError(409, "request_id 'g1' is in use", "request_id"), 409,
     error("request_id 'g1' is in use", "request_id")),
    (MicroservingError(404, "no KV received under request_id 'g1'", "begin"), 404,
     error("no KV received under request_id 'g1'", "begin")),
    (BackendUnavailable("engine core process exited"), 503,
     error("Service unavailable: engine core process exited", None, "server_error",
           "service_unavailable")),
])
async def test_start_generate_refused_gets_its_status(exc, status, expected, stream):
    core = FakeCore(error=exc)
    async with http_for(engine_app(core)) as http:
        response = await post(http, "start_generate", {**GENERATE, "stream": stream}, "msgpack")
    assert response.status_code == status
    assert response.json() == expected
    assert core.aborted == []  # a 409's request_id belongs to another call: left alone


@pytest.mark.parametrize(("fail", "last", "aborted"), [
    (BackendUnavailable("engine core process exited"),
     {"status": 503, **error("Service unavailable: engine core process exited", None,
                             "server_error", "service_unavailable")}, []),
    # Not the engine's failure: whatever the engine holds for the request is released.
    (ValueError("a bug"),
     {"status": 500, **error("Internal server error (ValueError)", type="server_error")},
     ["g1"]),
])
async def test_failure_mid_stream_ends_it_with_an_error_item(fail, last, aborted):
    core = FakeCore(steps=[[11]], fail=fail)
    async with http_for(engine_app(core)) as http:
        response = await post(http, "start_generate", GENERATE)
    assert response.status_code == 200
    assert [json.loads(line) for line in response.text.splitlines()] == [chunk([11], first=True), last]
    assert core.aborted == aborted


# -- bearer token ----------------------------------------------------------------------------

@pytest.mark.parametrize(("authorization", "message"), [
    (None, "Missing API key: send 'Authorization: Bearer <key>'"),
    (f"Basic {KEY}", "Missing API key: send 'Authorization: Bearer <key>'"),
    ("Bearer sk-wrong", "Incorrect API key provided"),
    (f"Bearer {KEY}x", "Incorrect API key provided"),
])
async def test_api_key_required(tok, authorization, message):
    core = FakeCore()
    app = build_openai_app(core, tok)
    add_microserving_routes(app, core, api_key=KEY)
    headers = {"Authorization": authorization} if authorization else {}
    async with http_for(app) as http:
        refused = [await http.get("/v1/models", headers=headers),
                   await http.get("/microserving/stats", headers=headers),
                   await http.post("/microserving/abort", json={"request_id": "r1"},
                                   headers=headers),
                   await http.post("/microserving/start_generate", json=GENERATE,
                                   headers=headers),
                   await http.post("/tokenize", json={"prompt": "hi"}, headers=headers),
                   await http.post("/detokenize", json={"tokens": [1]}, headers=headers),
                   await http.get("/version", headers=headers)]
        health = await http.get("/health", headers=headers)
        metrics = await http.get("/metrics", headers=headers)
    for response in refused:
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == error(message, code="invalid_api_key")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert metrics.status_code == 200
    assert core.calls == core.generate_calls == []


async def test_liveness_needs_no_key_and_proves_the_engine_holds_it(tok):
    """/microserving/live is open (the router asks it before it sends the key anywhere) and
    answers a challenge with the proof that this engine holds the key, without the core."""
    from microserve.auth import engine_proof, proves_key

    core = FakeCore()
    async with http_for(engine_app(core, api_key=KEY)) as http:
        plain = await http.get("/microserving/live")
        proved = await http.get("/microserving/live", params={"challenge": "0a1b2c"})
        bad = [await http.get("/microserving/live", params={"challenge": c})
               for c in ("", "xyz", "a" * 129)]
    assert plain.json() == {"core_silent_s": 0.125, "steps": 7, "in_step_s": 2.5, "proof": None}
    assert proved.json()["proof"] == engine_proof(KEY, "0a1b2c")
    assert proves_key(KEY, "0a1b2c", proved.json()["proof"])
    assert not proves_key(KEY, "0a1b2d", proved.json()["proof"])
    assert not proves_key("another-key", "0a1b2c", proved.json()["proof"])
    for response in bad:
        assert (response.status_code, response.json()) == (400, error(
            "challenge must be 1 to 128 hex digits", "challenge"))
    assert core.calls == []  # the core was not asked
    async with http_for(engine_app(core)) as http:  # no key: nothing to prove
        unkeyed = await http.get("/microserving/live", params={"challenge": "0a1b2c"})
    assert unkeyed.json()["proof"] is None


async def test_api_key_accepted(tok):
    core = FakeCore()
    app = build_openai_app(core, tok)
    add_microserving_routes(app, core, api_key=KEY)
    async with http_for(app) as http:
        http.headers["Authorization"] = f"Bearer {KEY}"
        models = await http.get("/v1/models")
        aborted = await http.post("/microserving/abort", json={"request_id": "r1"})
    assert models.json()["data"][0]["id"] == "tiny"
    assert aborted.json() == {"aborted": True}


def test_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="api_key must not be empty"):
        add_microserving_routes(FastAPI(), FakeCore(), api_key="")


# -- client disconnects (a live server) ------------------------------------------------------

async def test_client_disconnect_mid_stream_aborts():
    core = FakeCore(steps=[[11]], hang=True)
    async with live_server(engine_app(core)) as url, httpx.AsyncClient() as http:
        async with http.stream("POST", f"{url}/microserving/start_generate",
                               json=GENERATE) as response:
            async for line in response.aiter_lines():
                # Received while the generation still runs: each chunk is sent as it comes.
                assert json.loads(line) == chunk([11], first=True)
                break  # leaving the block closes the connection mid-stream
        await eventually(lambda: core.aborted == ["g1"])


@pytest.mark.parametrize(("route", "body"), [
    ("start_generate", GENERATE), ("start_generate", {**GENERATE, "stream": False}),
    ("remote_send", CALLS["remote_send"][0]),
])
async def test_client_disconnect_before_the_answer_aborts(route, body):
    core = FakeCore(steps=[], hang=True)  # a long queue or prefill
    core.results["remote_send"] = "hang"  # a long prefill and transfer
    async with live_server(engine_app(core)) as url, httpx.AsyncClient() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{url}/microserving/{route}", json=body, timeout=0.3)
        await eventually(lambda: core.aborted == [body["request_id"]])


# -- EngineClient ----------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def engine_client(core: FakeCore, **kwargs):
    async with live_server(engine_app(core, kwargs.pop("server_key", None))) as url:
        engine = EngineClient(url, **kwargs)
        try:
            yield engine
        finally:
            await engine.aclose()


@pytest.mark.parametrize("use_msgpack", [True, False])
async def test_engine_client_calls(use_msgpack):
    core = FakeCore()
    async with engine_client(core, use_msgpack=use_msgpack) as engine:
        kv_addr = validator(KVAddr).validate_python(KV_ADDR)
        assert await engine.call(PrepRecvRequest("r1", PROMPT, end=10)) == PrepRecvResponse(
            matched=4, kv_addr=kv_addr)
        assert await engine.call(RemoteSendRequest("r1", PROMPT, 4, 10, kv_addr)) == RemoteSendResponse(
            sent=6, computed=10, reused=0)
        assert dataclasses.asdict(await engine.call(CommitRequest("r1", pin=True))) == {"cached": 8,
                                                                             "pinned": True}
        assert (await engine.call(AbortRequest("r1", early_send=True))).aborted is True
        assert (await engine.call(PinRequest(PROMPT))).tokens == (await engine.call(UnpinRequest(PROMPT))).tokens == 8
        assert await engine.stats(check=True) == StatsResponse(
            EngineStats(**STATS), EngineInfo(**INFO), "ok")
    assert core.calls == [(route, args, timeout_s) for route, (_, _, args, timeout_s)
                          in CALLS.items()] + [("stats", None, 30.0),
                                               ("check_integrity", None, 30.0)]


@pytest.mark.parametrize("use_msgpack", [True, False])
async def test_engine_client_start_generate(use_msgpack):
    """The router's client to the engine: every sampling option arrives as sent."""
    core = FakeCore(logprobs=True)
    sampling = SamplingParams(max_tokens=4, temperature=0, logprobs=1, presence_penalty=0.5,
                              frequency_penalty=-1.25, repetition_penalty=1.3,
                              logit_bias=((5, -100.0), (9, 2.5)), min_tokens=2)
    async with engine_client(core, use_msgpack=use_msgpack) as engine:
        chunks = [c async for c in engine.start_generate("g1", PROMPT, 3, sampling,
                                                         queue_s=2.5, priority=-7)]
        sent = time.perf_counter()
    # the first chunk is the call's answer; the channel carries the rest in one read or two
    assert plain(chunks[0]) == chunk([11], logprobs=logprobs(11), first=True)
    assert [plain(c) for c in _coalesced(chunks[1:])] == [
        chunk([12, 13, 14], "stop", 4, logprobs(12, 13, 14))]
    assert core.generate_calls == [("g1", PROMPT, 3, sampling)]
    # the queue time, counted from when the engine's frontend took the call
    (queue_s, received_at), = core.queue_times
    assert queue_s == 2.5 and 0 < received_at < sent
    assert core.priorities == [-7]  # the scheduling priority, as sent


def test_generate_frames_carry_every_sampling_option_to_the_core():
    """The engine frontend -> core hop (msgspec frames)."""
    params = SamplingParams(max_tokens=4, seed=-3, stop_token_ids=(2,), presence_penalty=-2.0,
                            frequency_penalty=2.0, repetition_penalty=0.5,
                            logit_bias=((0, 1.5),), min_tokens=4)
    frame = Generate(request_id="g1", prompt=PROMPT, params=params, begin=3, priority=-4)
    [decoded] = wire.FrameDecoder(ToCore).feed(wire.encode(frame))
    assert decoded == frame and decoded.params.logit_bias == ((0, 1.5),)


async def test_engine_client_errors():
    core = FakeCore(error=MicroservingError(409, "request_id 'g1' is in use", "request_id"))
    core.results["prep_recv"] = MicroservingError(503, "no free KV pages", "prompt")
    async with engine_client(core) as engine:
        with pytest.raises(MicroservingError) as refused:
            await anext(engine.start_generate("g1", PROMPT))
        with pytest.raises(MicroservingError) as full:
            await engine.call(PrepRecvRequest("r1", PROMPT))
    assert (refused.value.status, str(refused.value), refused.value.param) == (
        409, "request_id 'g1' is in use", "request_id")
    assert (full.value.status, str(full.value), full.value.param) == (
        503, "no free KV pages", "prompt")


@pytest.mark.parametrize("use_msgpack", [True, False])
async def test_engine_client_failure_mid_stream(use_msgpack):
    core = FakeCore(steps=[[11]], fail=BackendUnavailable("engine core process exited"))
    received = []
    async with engine_client(core, use_msgpack=use_msgpack) as engine:
        with pytest.raises(MicroservingError) as failed:
            async for c in engine.start_generate("g1", PROMPT):
                received.append(plain(c))
    assert received == [chunk([11], first=True)]
    assert (failed.value.status, str(failed.value)) == (
        503, "Service unavailable: engine core process exited")


async def test_engine_client_auth():
    async with engine_client(FakeCore(), server_key=KEY, api_key=KEY) as engine:
        assert (await engine.call(AbortRequest("r1"))).aborted is True
    async with engine_client(FakeCore(), server_key=KEY, api_key="sk-wrong") as engine:
        with pytest.raises(MicroservingError) as refused:
            await engine.call(AbortRequest("r1"))
    assert (refused.value.status, str(refused.value)) == (401, "Incorrect API key provided")


async def test_engine_client_unreachable_engine():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = EngineClient(url)
    with pytest.raises(BackendUnavailable, match=f"engine {url}: ConnectionRefusedError"):
        await engine.call(AbortRequest("r1"))
    with pytest.raises(BackendUnavailable, match=f"engine {url}: ConnectionRefusedError"):
        await anext(engine.start_generate("g1", PROMPT))
    await engine.aclose()


@pytest.mark.parametrize(("status", "content", "channel", "exc", "message"), [
    (200, b'{"token_ids":[11]}\n', False, BackendUnavailable,
     "engine http://engine: the stream of g1 ended before it finished"),
    (200, b'{"token_ids":[11]}\n', True, BackendUnavailable,
     "engine http://engine: its channel sent an item that does not decode: Object missing "
     "required field `request_id`"),
    (502, b"<html>Bad Gateway</html>", True, MicroservingError,
     "HTTP 502: <html>Bad Gateway</html>"),
])
async def test_engine_client_bad_answers(status, content, channel, exc, message):
    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        await send({"type": "http.response.body", "body": content})

    async with live_server(answer) as url:
        engine = EngineClient(url, use_msgpack=False, channel=channel)
        with pytest.raises(exc) as raised:
            _ = [c async for c in engine.start_generate("g1", PROMPT)]
        await engine.aclose()
    assert str(raised.value) == message.replace("http://engine", url)


@pytest.mark.parametrize("channel", [True, False])
async def test_engine_client_early_close_aborts_in_the_engine(channel):
    """Closed early, a request is aborted: on a channel by an abort call, a stream by its
    connection closing (the core client aborts it)."""
    core = FakeCore(steps=[[11], [12]], hang=True)
    async with live_server(engine_app(core)) as url:
        engine = EngineClient(url, channel=channel)
        chunks = engine.start_generate("g1", PROMPT)
        assert (await anext(chunks)).token_ids == [11]
        await chunks.aclose()
        if channel:
            await eventually(lambda: [(m, a) for m, a, _ in core.calls] == [
                ("abort", {"request_id": "g1", "early_send": False})])
        else:
            await eventually(lambda: core.aborted == ["g1"])
        await engine.aclose()
    assert core.aborted == ["g1"]  # (on a channel: its pump, cancelled as the channel closed)


@pytest.mark.parametrize("channel", [True, False])
async def test_engine_client_keeps_its_connection(channel):
    """Calls one after the other reuse one connection; a channel holds one more, opened once."""
    app, client_ports = engine_app(FakeCore()), []

    async def noting_client_ports(scope, receive, send):
        client_ports.append(scope["client"][1])
        await app(scope, receive, send)

    async with live_server(noting_client_ports) as url:
        engine = EngineClient(url, channel=channel)
        for _ in range(3):
            chunks = [c.token_ids async for c in engine.start_generate("g1", PROMPT)]
            if channel:  # the first is the call's answer; the rest in one read or two
                assert chunks[0] == [11] and sum(chunks, []) == [11, 12, 13, 14]
            else:
                assert chunks == [[11], [12, 13], [14]]
        await engine.call(AbortRequest("g1"))
        await engine.aclose()
    if channel:  # the channel's GET, then 3 start_generate and an abort on another
        assert len(client_ports) == 5 and len(set(client_ports)) == 2
        assert client_ports.count(client_ports[0]) == 1
    else:
        assert len(client_ports) == 4 and len(set(client_ports)) == 1


async def test_a_merged_answer_keeps_the_prompt_logprobs_of_the_first_chunk():
    from engine.frontend.microserving_api import _merged

    scored = [None, TokenLogprob(token_id=4, logprob=-1.5)]

    async def chunks():
        yield GenerateChunk([11], cached_tokens=0, prompt_logprobs=scored)
        yield GenerateChunk([12], finish_reason="length")

    merged = await _merged(chunks(), logprobs=False)
    assert (merged.token_ids, merged.prompt_logprobs) == ([11, 12], scored)
