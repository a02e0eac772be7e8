"""Engines that hang, on real processes: a `microserve up` CPU deployment of the tiny model, P/D
(`pd`), whose deployment file sets the router's liveness timeout (2.5 s) and queue timeout
(0.4 s).

A stopped engine (SIGSTOP of the whole engine, or of its core alone) loses its requests within
the liveness timeout, not the 30-s health timeout of before: a stream from it ends with an
error, new requests are served without it, and SIGCONT brings it back. A prefill engine that
does not start on a request within the queue timeout gets it a 503 with Retry-After, aborted
everywhere, nothing left held; so does an engine a data-parallel request went to. After each
test both engines hold nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import DAEMON_LOGS
from deployments import Up, assert_quiet, children, engine_stats, up_prefill_decode

pytestmark = pytest.mark.slow

ADMIN = "hung-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
LIVENESS_TIMEOUT_S = 2.5
QUEUE_TIMEOUT_S = 0.4
PROBE_INTERVAL_S = 0.5  # the router's poll_interval_s
ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "512"]
PROMPT = [(5 * i + 3) % 256 for i in range(40)]


@pytest.fixture(scope="module")
def up(tiny_served_dir, tmp_path_factory):
    yield from up_prefill_decode(
        tmp_path_factory.mktemp("hung"), tiny_served_dir, ENGINE_ARGS, ADMIN, strategy="pd",
        router={"liveness_timeout_s": LIVENESS_TIMEOUT_S, "queue_timeout_s": QUEUE_TIMEOUT_S})


@pytest.fixture(autouse=True)
def quiet_after(request, up):
    request.node.stash[DAEMON_LOGS] = [up.log_path]
    yield
    for name, url in up.engine_urls.items():
        assert_quiet(name, url)


def engines(up: Up) -> dict[str, dict]:
    r = httpx.get(up.url + "/admin/engines", headers=AUTH)
    assert r.status_code == 200, r.text
    return {e["name"]: e for e in r.json()["engines"]}


def use_strategy(up: Up, builtin: str) -> None:
    r = httpx.put(up.url + "/admin/strategy", json={"builtin": builtin}, headers=AUTH)
    assert r.status_code == 200, r.text


def wait_state(up: Up, name: str, state: str, timeout_s: float) -> float:
    """Seconds until the router shows engine `name` in `state`."""
    started = time.monotonic()
    while engines(up)[name]["state"] != state:
        assert time.monotonic() - started < timeout_s, (name, engines(up)[name])
        time.sleep(0.05)
    return time.monotonic() - started


def metric(up: Up, name: str) -> float:
    lines = httpx.get(up.url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def stream(http: httpx.Client, max_tokens: int) -> Iterator[list[int] | dict]:
    """A streamed greedy completion through the router: each event's token ids, or the error
    object an event carries."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                yield event["error"]
            elif event["choices"][0]["logprobs"]:
                yield [int(t[1:-1]) for t in event["choices"][0]["logprobs"]["tokens"]]


def complete(url: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def pids(up: Up, name: str, what: str) -> list[int]:
    engine = up.engine_pid(name)
    return {"engine": [engine, *children(engine)], "core": children(engine)}[what]


def signal_all(targets: list[int], sig: int) -> None:
    for pid in targets:
        os.kill(pid, sig)


@pytest.mark.parametrize("what", ["engine", "core"])
def test_a_stopped_engine_loses_its_requests_within_the_liveness_timeout(up, what):
    """SIGSTOP of D (the engine and its core, or its core alone) while a request streams from
    it: the stream ends with an error within the liveness timeout and a probe interval (plus
    a margin), the router serves new requests on P meanwhile, and SIGCONT brings D back."""
    d_url = up.engine_urls["d"]
    down_before = metric(up, "microserve_router_engine_down_total")
    stopped = pids(up, "d", what)
    with httpx.Client(base_url=up.url, timeout=30) as http:
        events = stream(http, 512 - len(PROMPT))
        assert isinstance(next(events), list)  # streaming from D
        signal_all(stopped, signal.SIGSTOP)
        try:
            since = time.monotonic()
            rest = list(events)
            failed_s = time.monotonic() - since
            error = rest[-1]
            assert isinstance(error, dict) and re.fullmatch(
                r"Service unavailable: engine d went down while generating cmpl-\w+",
                error["message"]), rest[-1:]
            assert failed_s < LIVENESS_TIMEOUT_S + PROBE_INTERVAL_S + 1.5, failed_s
            state = engines(up)["d"]
            assert state["state"] == "down"
            if what == "engine":  # the frontend does not answer
                assert state["down_reason"] == (f"engine {d_url}: no liveness answer within "
                                                f"{LIVENESS_TIMEOUT_S:g} s")
            else:  # the frontend answers: its core has stopped beating
                assert re.fullmatch(
                    rf"engine {d_url}: its engine core has sent no heartbeat for \d+\.\d s "
                    r"\(stopped or hung; steps begun: \d+\)", state["down_reason"]), state
            served = complete(up.url)  # by P alone meanwhile
            assert served.status_code == 200, served.text
        finally:
            signal_all(stopped, signal.SIGCONT)
    print(f"{what} stopped: the client had its error after {failed_s:.2f} s")
    wait_state(up, "d", "up", timeout_s=10)
    received = engine_stats(d_url)["stats"]["kv_tokens_received"]
    assert complete(up.url).status_code == 200  # through P and D again
    assert engine_stats(d_url)["stats"]["kv_tokens_received"] > received
    assert metric(up, "microserve_router_engine_down_total") == down_before + 1


def sent_while_stopped(up: Up, cores: list[int]) -> httpx.Response:
    """A completion sent to the router while `cores` are held (SIGSTOP, 1.2 s: less than the
    liveness timeout, so their engines are up but start nothing), past the 0.4-s queue time:
    its answer, which came once the cores went on, not before."""
    signal_all(cores, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with httpx.Client(timeout=30) as http:
            pending = http.build_request("POST", up.url + "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            answer: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: answer.append(http.send(pending)))
            thread.start()
            time.sleep(1.2)
            signal_all(cores, signal.SIGCONT)
            thread.join(30)
    finally:
        signal_all(cores, signal.SIGCONT)
    elapsed = time.monotonic() - started
    assert 1.2 <= elapsed < 1.2 + 3.0, elapsed
    [r] = answer
    return r


def assert_queue_timeout(r: httpx.Response) -> None:
    """The router's 503 for a request its engine did not start within the queue time."""
    assert (r.status_code, r.headers.get("retry-after")) == (503, "5"), r.text
    error = r.json()["error"]
    assert error["code"] == "queue_timeout"
    assert re.fullmatch(r"waited 0.4 s for this engine to start computing request 'cmpl-\w+' "
                        r"\(its queue_s\): it is busy; retry later", error["message"]), error


def test_a_prefill_engine_that_does_not_start_in_the_queue_time_gets_a_503(up):
    """P's core is held: the request waits its 0.4-s queue time there and the client gets a
    503 with Retry-After, not retried; the request is aborted on D and P, which hold
    nothing."""
    p_url = up.engine_urls["p"]
    before = engine_stats(p_url)["stats"]["kv_send_queue_timeouts"]
    retries = metric(up, "microserve_router_retries_total")
    assert_queue_timeout(sent_while_stopped(up, pids(up, "p", "core")))
    assert engine_stats(p_url)["stats"]["kv_send_queue_timeouts"] == before + 1
    assert metric(up, "microserve_router_retries_total") == retries  # not tried again
    assert engines(up)["p"]["state"] == "up"  # busy, not down
    assert complete(up.url).status_code == 200


def test_a_data_parallel_request_no_engine_starts_in_the_queue_time_gets_a_503(up):
    """Under data_parallel the router sends its queue time with each start_generate: both
    cores held, the request waits its 0.4 s on the engine it went to and the client gets a 503
    with Retry-After, not retried (another engine's queue would only be waited in again); that
    engine counts it, both stay up, and neither holds anything (the autouse check)."""
    timeouts = {name: engine_stats(url)["stats"]["generate_queue_timeouts"]
                for name, url in up.engine_urls.items()}
    retries = metric(up, "microserve_router_retries_total")
    use_strategy(up, "data_parallel")
    try:
        assert_queue_timeout(sent_while_stopped(up, pids(up, "p", "core") +
                                                pids(up, "d", "core")))
    finally:
        use_strategy(up, "pd")
    counted = {name: engine_stats(url)["stats"]["generate_queue_timeouts"] - timeouts[name]
               for name, url in up.engine_urls.items()}
    assert sorted(counted.values()) == [0, 1], counted  # one engine, tried once
    assert metric(up, "microserve_router_retries_total") == retries
    assert {e["state"] for e in engines(up).values()} == {"up"}
    assert complete(up.url).status_code == 200

