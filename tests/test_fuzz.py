"""No body, however large or strange, gets a 5xx, takes a process down or leaks a page.

Hypothesis builds request bodies from the project's own models (every field of the OpenAI,
microserving and admin request models, plus unknown ones), filled with values chosen to break
things: integers past 32, 53, 63 and 64 bits, `Infinity` and `NaN` (Python's json writes them),
huge floats, wrong types, nested junk, and sometimes well-formed values so that deeper checks
are reached too. Microserving bodies go as JSON and as msgpack. They are sent over real HTTP to
a real P/D deployment (two `microserve engine` daemons of the tiny Llama, shm KV transfer, and
`microserve router` with the P/D strategy): every answer must be a 2xx or a 4xx with OpenAI's
error JSON, and afterwards every process is alive, and each engine idle with its KV cache
intact and nothing reserved.

The examples are derandomized: CI runs the same bodies every time (a failure reproduces).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import httpx
import msgpack
import pytest
from daemons import ENGINE_AUTH, ENGINE_KEY, Daemon, serve_together
from deployments import RouterProcess, assert_quiet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from microserve.messages import (
    AbortRequest,
    CommitRequest,
    KVAddr,
    PinRequest,
    PrepRecvRequest,
    RemoteSendRequest,
    SamplingParams,
    SendToRequest,
    StartGenerateRequest,
)
from microserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from router.admin import (ArmBody, EngineBody, MigrateBody, PinBody, RoleBody, StrategyBody,
                          WeightBody)

pytestmark = pytest.mark.slow

ADMIN = "fuzz-admin"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
ENGINE_ARGS = ("--num-pages", "64", "--max-model-len", "256", "--api-key", ENGINE_KEY)
EXAMPLES = 200  # per endpoint
REQUEST_IDS = ("fz-1", "fz-2", "fz-3", "fz-4")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# -- values --------------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 255, 256, 49152, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**64 + 1, 10**30, -(10**30)]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, -1.0, 1e308, -1e308, math.inf, -math.inf,
               math.nan]
INTS = st.sampled_from(EDGE_INTS) | st.integers()
FLOATS = st.sampled_from(EDGE_FLOATS) | st.floats()
SCALARS = (st.none() | st.booleans() | INTS | FLOATS | st.text(max_size=12)
           | st.just("x" * 5000))
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
TOKEN_LISTS = st.lists(st.integers(0, 255) | INTS, max_size=40)
SMALL_TOKENS = st.lists(st.integers(0, 255), min_size=1, max_size=40)

# Well-formed-ish values by field name, so that some bodies get past the first check.
PLAUSIBLE = {
    "request_id": st.sampled_from(REQUEST_IDS),
    "prompt": SMALL_TOKENS | TOKEN_LISTS | st.text(max_size=40),
    "end": INTS, "begin": INTS,
    "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
    "lease_s": FLOATS, "wait_s": FLOATS,
    "stream": st.booleans(),
    "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "seed": INTS,
    "stop_token_ids": TOKEN_LISTS, "logprobs": INTS | st.booleans(), "top_logprobs": INTS,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=30) | JUNK}),
                         max_size=3),
    "builtin": st.sampled_from(["pd", "data_parallel", "balanced_pd", "nope"]),
    "path": st.sampled_from(["/etc/passwd", "strategies/pd.py", "../x.py", "/dev/zero"]),
    "args": st.dictionaries(st.sampled_from(["ratio", "x"]), SCALARS, max_size=2),
    "source": st.sampled_from(["p", "d", "nope"]),  # an engine (migrate)
    "name": st.sampled_from(["p", "d", "nope"]),
    "destination": st.sampled_from(["p", "d", "nope"]),
    "engines": st.lists(st.sampled_from(["p", "d", "nope"]), max_size=2),
    "text": st.text(max_size=30),
    "url": st.sampled_from(["http://127.0.0.1:1", "ftp://x", "http://[::1"]),
    "weight": st.sampled_from([0, 1, 0.5, -1, 1e6, 1e7]),
    "role": st.sampled_from(["prefill", "decode", "any", "both"]),
    "wait_s": st.sampled_from([0, 0.1, -1, 601]),
    "sticky_by": st.sampled_from(["user", "request_id", "header:X-User", "header:", "x"]),
    "slo": st.fixed_dictionaries({}, optional={"ttft_s": FLOATS, "tpot_s": FLOATS}),
}


def body_fields(model) -> list[str]:
    """The keys of `model`'s body: a pydantic model's fields (by alias), a message's
    (microserve/messages/, a dataclass)."""
    if dataclasses.is_dataclass(model):
        return [f.name for f in dataclasses.fields(model)]
    return [info.alias or name for name, info in model.model_fields.items()]


def sampling_bodies() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={f: PLAUSIBLE.get(f, JUNK) | JUNK
                                               for f in body_fields(SamplingParams)})


def kv_addr_bodies() -> st.SearchStrategy[dict]:
    fields = {f: JUNK for f in body_fields(KVAddr)}
    fields["ranges"] = st.lists(st.tuples(INTS, INTS), max_size=3) | JUNK
    fields["window"] = st.tuples(INTS, INTS) | JUNK
    fields["transfer"] = st.fixed_dictionaries(
        {"kind": st.sampled_from(["shm", "tcp", "none", "x"])},
        optional={"host": st.sampled_from(["127.0.0.1", "10.0.0.1"]), "port": INTS,
                  "pid": INTS, "fd": INTS, "inode": INTS, "nbytes": INTS,
                  "num_pages": INTS, "mac": st.text(max_size=64)}) | JUNK
    return st.fixed_dictionaries({}, optional=fields)


NASTY = INTS | FLOATS | JUNK | st.lists(INTS, min_size=1, max_size=3)
SMALL_PROMPT = [5, 17, 42, 9, 77, 3, 120, 64, 11, 200, 31, 8, 99, 150, 6, 2, 250, 14]
REAL = "<a real kv_addr, from a prep_recv on d>"  # replaced when the body is sent


def _fields(model, special: dict) -> dict:
    fields = {}
    for key in body_fields(model):
        fields[key] = special[key] if key in special else (PLAUSIBLE.get(key, JUNK) | JUNK)
    return fields


def _mutated(base: dict, fields: dict, special: dict) -> st.SearchStrategy[dict]:
    """`base` (a body that works) with one or two of its model's fields replaced by a value
    chosen to break things (only `special`'s values for its fields): reaches the checks behind
    the first one."""
    keys = sorted(fields)
    picks = st.lists(st.sampled_from(keys), min_size=1, max_size=2, unique=True)
    return picks.flatmap(lambda ks: st.fixed_dictionaries(
        {k: special[k] if k in special else NASTY | fields[k] for k in ks})).map(
        lambda extra: {**base, **extra})


def bodies(model, base: dict, **special) -> st.SearchStrategy:
    """Bodies for `model`: a working `base` with one or two fields broken (most examples), any
    subset of the fields (by alias) each plausible or junk plus an unknown one, or, rarely, not
    a dict at all."""
    fields = _fields(model, special)
    loose = st.fixed_dictionaries({}, optional={**fields, "unknown_field": JUNK})
    mutated = _mutated(base, fields, special)
    return st.one_of(mutated, mutated, loose, JUNK)


def nested(model, base: dict) -> st.SearchStrategy[dict]:
    """A nested body (sampling, kv_addr): `base` with one or two of `model`'s fields broken."""
    return _mutated(base, _fields(model, {}), {})


# One client for the module's calls: a connection per call would cost more than most calls.
CLIENT = httpx.Client(timeout=60)

SENT_IDS: set[str] = set(REQUEST_IDS)  # request ids bodies carried: aborted after each test


def noted(body):
    """The body, its request_id noted so that whatever it reserved is aborted afterwards."""
    if isinstance(body, dict) and isinstance(body.get("request_id"), str):
        SENT_IDS.add(body["request_id"])
    return body


def encode(body, use_msgpack: bool) -> tuple[bytes, dict]:
    if use_msgpack:
        try:
            return msgpack.packb(body), {"Content-Type": "application/msgpack"}
        except (OverflowError, TypeError, ValueError):
            pass  # ints past 64 bits have no msgpack form: send JSON
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def check_answer(r: httpx.Response, body, allowed: tuple[int, ...] = ()) -> None:
    assert r.status_code < 500 or r.status_code in allowed, (body, r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]  # OpenAI's error JSON, always
        assert error["message"], (body, r.text)
        return
    kind = r.headers.get("content-type", "")
    if "ndjson" in kind or "event-stream" in kind:  # errors after the status line come inline
        assert '"status":5' not in r.text.replace(" ", ""), (body, r.text[:500])


# -- the deployment ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_served_dir, tmp_path_factory):
    def log(name: str):
        return tmp_path_factory.mktemp(name) / "daemon.log"

    yield from serve_together(
        Daemon(tiny_served_dir, log("fuzz-p"), "p", *ENGINE_ARGS),
        Daemon(tiny_served_dir, log("fuzz-d"), "d", *ENGINE_ARGS, "--kv-transfer", "shm"))


@pytest.fixture(scope="module")
def p(engines):
    return engines[0]


@pytest.fixture(scope="module")
def d(engines):
    return engines[1]


@pytest.fixture(scope="module")
def router(p, d, tiny_served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz-router") / "router.log"
    process = RouterProcess(tiny_served_dir, {"p": p.url + ",prefill", "d": d.url + ",decode"},
                            log, "--strategy", "pd", "--admin-token", ADMIN)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def everything_survives(p, d, router):
    yield
    for engine in (p, d):
        for rid in SENT_IDS:  # whatever a fuzzed call left reserved or running
            engine.http.post("/microserving/abort", json={"request_id": rid})
        assert engine.proc.poll() is None, f"engine {engine.name} died:\n{engine.log()}"
        assert_quiet(engine.name, engine.url)
    assert router.proc.poll() is None, f"the router died:\n{router.log()}"
    assert httpx.get(router.url + "/health").status_code == 200


# -- the endpoints -------------------------------------------------------------------------------

GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
MICROSERVING = {
    "prep_recv": bodies(PrepRecvRequest, {"request_id": "fz-1", "prompt": SMALL_PROMPT}),
    "remote_send": bodies(
        RemoteSendRequest, {"request_id": "fz-2", "prompt": SMALL_PROMPT, "kv_addr": REAL},
        kv_addr=kv_addr_bodies() | nested(KVAddr, {"real": True}) | st.just(REAL)),
    "start_generate": bodies(
        StartGenerateRequest, {"request_id": "fz-3", "prompt": SMALL_PROMPT, "sampling": GREEDY},
        sampling=sampling_bodies() | nested(SamplingParams, GREEDY)),
    "send_to": bodies(SendToRequest, {"request_id": "fz-4", "begin": 0, "kv_addr": REAL},
                      kv_addr=kv_addr_bodies() | nested(KVAddr, {"real": True}) | st.just(REAL)),
    "commit": bodies(CommitRequest, {"request_id": "fz-1"}),
    "abort": bodies(AbortRequest, {"request_id": "fz-1"}),
    "pin": bodies(PinRequest, {"prompt": SMALL_PROMPT}),
    "unpin": bodies(PinRequest, {"prompt": SMALL_PROMPT}),
}


def with_real_kv_addr(body, d: Daemon):
    """Put a kv_addr from a real prep_recv on d where the body asks for one (or for one with
    some fields broken); the reservation is aborted after the test."""
    if not isinstance(body, dict) or not (body.get("kv_addr") == REAL or (
            isinstance(body.get("kv_addr"), dict) and body["kv_addr"].get("real"))):
        return body
    d.http.post("/microserving/abort", json={"request_id": "fz-2"})
    r = d.http.post("/microserving/prep_recv",
                    json={"request_id": "fz-2", "prompt": SMALL_PROMPT, "end": -1})
    assert r.status_code == 200, r.text
    broken = body["kv_addr"] if isinstance(body["kv_addr"], dict) else {"real": True}
    changes = {k: v for k, v in broken.items() if k != "real"}
    return {**body, "kv_addr": {**r.json()["kv_addr"], **changes}}


def abort_soon_if_waiting(call: str, body, engine: Daemon) -> None:
    """A valid remote_send without kv_addr computes and waits for its send_to (up to the
    engine's lease): abort it shortly, so that its call answers (a 409) within the test."""
    if ("remote_send" in call and isinstance(body, dict) and body.get("kv_addr") is None
            and isinstance(body.get("request_id"), str)):
        rid = body["request_id"]
        threading.Timer(0.3, lambda: httpx.post(
            engine.url + "/microserving/abort", json={"request_id": rid}, headers=ENGINE_AUTH,
            timeout=30)).start()


@pytest.mark.parametrize("call", list(MICROSERVING))
def test_microserving_calls_never_answer_5xx(call, d, p):
    @FUZZ
    @given(body=MICROSERVING[call], use_msgpack=st.booleans(), engine=st.sampled_from([p, d]))
    def run(body, use_msgpack, engine):
        body = noted(with_real_kv_addr(body, d))
        abort_soon_if_waiting(call, body, engine)
        data, headers = encode(body, use_msgpack)
        r = engine.http.post(f"/microserving/{call}", content=data,
                             headers={**headers, **ENGINE_AUTH})
        if r.headers.get("content-type", "").startswith("application/msgpack"):
            return  # answered in kind: a 2xx (errors are always JSON)
        check_answer(r, body)

    run()


# -- every field at every edge, deterministically --------------------------------------------------

EDGES = [2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -1, math.inf, -math.inf,
         math.nan, 1e308, "x", None, [2**64], {"a": 1}]


def edge_cases(model, base: dict, nested_bases: dict | None = None) -> list:
    """`base` with each field of `model` (and of the nested models in `nested_bases`, by the
    field that holds them) set to each value of EDGES in turn."""
    cases = []
    for key in body_fields(model):
        cases += [{**base, key: value} for value in EDGES]
    for key, (inner, inner_base) in (nested_bases or {}).items():
        cases += [{**base, key: body} for body in edge_cases(inner, inner_base)]
    return cases


EDGE_ENDPOINTS = {
    "/microserving/prep_recv": edge_cases(PrepRecvRequest, {"request_id": "fz-1",
                                                            "prompt": SMALL_PROMPT}),
    "/microserving/start_generate": edge_cases(
        StartGenerateRequest, {"request_id": "fz-3", "prompt": SMALL_PROMPT,
                               "sampling": GREEDY}, {"sampling": (SamplingParams, GREEDY)}),
    "/microserving/remote_send": edge_cases(
        RemoteSendRequest, {"request_id": "fz-2", "prompt": SMALL_PROMPT, "kv_addr": REAL},
        {"kv_addr": (KVAddr, {"real": True})}),
    "/microserving/send_to": edge_cases(
        SendToRequest, {"request_id": "fz-4", "begin": 0, "kv_addr": REAL},
        {"kv_addr": (KVAddr, {"real": True})}),
    "/microserving/pin": edge_cases(PinRequest, {"prompt": SMALL_PROMPT}),
    "/v1/completions": edge_cases(CompletionRequest, {"prompt": "Hello there", **GREEDY}),
    "/v1/chat/completions": edge_cases(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], **GREEDY}),
}


@pytest.mark.parametrize("path", list(EDGE_ENDPOINTS))
def test_every_field_at_every_edge(path, p, d, router):
    """What the probe found by hand and by schemathesis, for every field, not just a sample:
    each field of the body (nested ones included) at 2^63, 2^64, Infinity, NaN, a string..."""
    for body in EDGE_ENDPOINTS[path]:
        body = noted(with_real_kv_addr(body, d))
        if path.startswith("/v1/"):
            targets = [(router.url, {}), (d.url, ENGINE_AUTH)]
        else:
            targets = [(p.url if "remote_send" in path else d.url, ENGINE_AUTH)]
        for url, headers in targets:
            abort_soon_if_waiting(path, body, p)
            r = CLIENT.post(url + path, content=json.dumps(body),
                            headers={**headers, "Content-Type": "application/json"})
            check_answer(r, body)
        own = body.get("request_id")
        # what it may hold: a microserving body, one of the ids the bases use; any body, its own
        held = set(REQUEST_IDS) if path.startswith("/microserving/") else set()
        for rid in held | ({own} if isinstance(own, str) else set()):
            d.http.post("/microserving/abort", json={"request_id": rid})


OPENAI = {
    "/v1/completions": bodies(CompletionRequest, {"prompt": "Hello there", **GREEDY}),
    "/v1/chat/completions": bodies(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], **GREEDY}),
}


@pytest.mark.parametrize("path", list(OPENAI))
def test_openai_bodies_never_answer_5xx_through_the_router_or_an_engine(path, router, d):
    @FUZZ
    @given(body=OPENAI[path], direct=st.booleans())
    def run(body, direct):
        url, headers = (d.url, ENGINE_AUTH) if direct else (router.url, {})
        r = CLIENT.post(url + path, content=json.dumps(body),
                        headers={**headers, "Content-Type": "application/json"})
        check_answer(r, body)

    run()


# A/B arms: each arm a strategy body of its own (never `source`, as below)
ARM = {"name": "a", "builtin": "data_parallel"}
ARM_LISTS = st.lists(bodies(ArmBody, ARM, source=st.none()), max_size=3)
ARMS_BASE = {"arms": [ARM, {"name": "b", "builtin": "pd", "weight": 2}],
             "sticky_by": "header:X-User"}

ADMIN_CALLS = {
    # `source` is code the router runs: never fuzzed (the router refuses no admin's code).
    ("PUT", "/admin/strategy"): (bodies(StrategyBody, {"builtin": "pd"}, source=st.none())
                                 | bodies(StrategyBody, ARMS_BASE, source=st.none(),
                                          arms=ARM_LISTS)),
    ("PATCH", "/admin/strategy/arms/a"): bodies(WeightBody, {"weight": 1}),
    ("POST", "/admin/engines/p/role"): bodies(RoleBody, {"role": "any", "wait_s": 0.1}),
    ("POST", "/admin/engines"): bodies(EngineBody, {"name": "fuzzed",
                                                              "url": "http://127.0.0.1:1"}),
    ("POST", "/admin/migrate"): bodies(MigrateBody, {"prompt": SMALL_PROMPT, "source": "p",
                                                     "destination": "d"}),
    ("POST", "/admin/pin"): bodies(PinBody, {"prompt": SMALL_PROMPT}),
    ("POST", "/admin/unpin"): bodies(PinBody, {"prompt": SMALL_PROMPT}),
}


@pytest.mark.parametrize("call", list(ADMIN_CALLS), ids=lambda c: " ".join(c))
def test_admin_bodies_never_answer_5xx(call, router):
    method, path = call

    @FUZZ
    @given(body=ADMIN_CALLS[call])
    def run(body):
        if isinstance(body, dict) and body.get("url"):  # never add a real engine by accident
            body["name"] = "fuzzed"
        r = CLIENT.request(method, router.url + path, content=json.dumps(body),
                           headers={**ADMIN_AUTH, "Content-Type": "application/json"})
        # 503, as documented: an engine the body names cannot be reached (a URL nobody serves)
        check_answer(r, body, allowed=(503,))
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "service_unavailable", r.text

    run()
    httpx.put(router.url + "/admin/strategy", json={"builtin": "pd"}, headers=ADMIN_AUTH)
    httpx.post(router.url + "/admin/engines/p/role", json={"role": "prefill"},
               headers=ADMIN_AUTH)
