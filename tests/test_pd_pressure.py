"""P/D under pressure and partial failure, on real processes: a prefill and a decode `microserve
engine` serving the tiny model, a `microserve router` in front running the `pd` strategy.

D's pool holds about two of the prompts at a time, so most requests wait their turn for pages
on D: every one must still be answered with Hugging Face's greedy tokens, with no 503. Clients
that go away while they wait leave nothing behind. Killing P leaves D serving every request
whole; killing D ends P's work for it at once and P serves the requests whole. After each test
both engines hold no page, reservation, waiting call or send job.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from conftest import DAEMON_LOGS, hf_greedy
from daemons import serve_together
from deployments import RouterProcess, assert_quiet, engine_stats
from pd_faults import (MAX_TOKENS, SLOW_P, SMALL_D, check_killing_decode, check_killing_prefill,
                       complete, engine, prompts, router_metric, start_router)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_served_dir, tmp_path_factory):
    yield from serve_together(engine(tiny_served_dir, tmp_path_factory, "p", SLOW_P),
                              engine(tiny_served_dir, tmp_path_factory, "d", SMALL_D))


@pytest.fixture(scope="module")
def p(engines):
    return engines[0]


@pytest.fixture(scope="module")
def d(engines):
    return engines[1]


@pytest.fixture(scope="module")
def router(p, d, tiny_served_dir, tmp_path_factory):
    router = start_router(tiny_served_dir, tmp_path_factory, p, d)
    yield router
    router.stop()


@pytest.fixture(autouse=True)
def logs_on_failure(request):
    daemons = [request.getfixturevalue(n) for n in ("p", "d", "router")
               if n in request.fixturenames]
    request.node.stash[DAEMON_LOGS] = [x.log_path for x in daemons]
    yield


def test_requests_beyond_the_decode_pool_wait_their_turn(router, p, d, tiny_served_dir):
    batch = prompts(16, seed=1)
    want = hf_greedy(tiny_served_dir, batch, MAX_TOKENS)
    waited = engine_stats(d.url)["stats"]["kv_recv_waited"]

    async def run():
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
            return await asyncio.gather(*(complete(http, x) for x in batch))

    assert asyncio.run(run()) == want  # all 200, each with the single-engine greedy tokens
    stats = assert_quiet("d", d.url)
    assert stats["kv_recv_waited"] - waited >= 8  # most of them had to wait for pages
    assert stats["kv_recv_wait_timeouts"] == 0 and stats["kv_leases_expired"] == 0
    assert_quiet("p", p.url)
    assert router_metric(router, "microserve_router_retries_total") == 0


def test_clients_that_go_away_while_waiting_leave_nothing(router, p, d, tiny_served_dir):
    batch = prompts(20, seed=2)
    want = hf_greedy(tiny_served_dir, batch[::2], MAX_TOKENS)

    async def impatient(prompt, after_s: float):
        async with httpx.AsyncClient(base_url=router.url, timeout=after_s) as http:
            try:
                return await complete(http, prompt)
            except httpx.TimeoutException:
                return "gone"

    async def run():
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as http:
            rng = random.Random(3)
            return await asyncio.gather(*(
                complete(http, x) if i % 2 == 0 else impatient(x, rng.uniform(0.05, 1.0))
                for i, x in enumerate(batch)))

    outcomes = asyncio.run(run())
    assert outcomes[::2] == want
    assert "gone" in outcomes[1::2]
    assert_quiet("d", d.url)
    assert_quiet("p", p.url)
    assert engine_stats(d.url)["stats"]["kv_recv_waiting"] == 0


# The module's idle engine of the other role survives each kill (a fresh victim, a router of
# its own): one engine start fewer per test. It must be idle and whole afterwards, which the
# checks assert, so the tests after these see it as they would a fresh one.
def test_killing_the_prefill_engine_leaves_the_decode_engine_serving(tiny_served_dir,
                                                                       tmp_path_factory, d):
    check_killing_prefill(tiny_served_dir, tmp_path_factory, survivor=d)


def test_killing_the_decode_engine_stops_the_prefill_engine_at_once(tiny_served_dir,
                                                                     tmp_path_factory, p):
    check_killing_decode(tiny_served_dir, tmp_path_factory, survivor=p)


def test_a_request_that_waits_its_queue_time_gets_a_503_with_retry_after(
        p, d, tiny_served_dir, tmp_path_factory):
    """D's pool is held by a reservation nobody fills; a router whose queue time is 0.5 s
    answers the client 503 with Retry-After once the request has waited that long on D."""
    holder = httpx.post(d.url + "/microserving/prep_recv", headers=d.http.headers, json={
        "request_id": "holder", "prompt": [1] * 380, "end": -1, "lease_s": 60}, timeout=30)
    assert holder.status_code == 200, holder.text
    log = tmp_path_factory.mktemp("router-queue") / "router.log"
    router = RouterProcess(tiny_served_dir, {"p": p.url + ",prefill", "d": d.url + ",decode"},
                           log, "--strategy", "pd", "--admin-token", "pressure-admin",
                           "--queue-timeout-s", "0.5")
    try:
        router.wait_ready()
        started = time.monotonic()
        r = httpx.post(router.url + "/v1/completions", timeout=30, json={
            "prompt": prompts(1, seed=6)[0], "max_tokens": 4, "temperature": 0})
        assert time.monotonic() - started >= 0.5
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        error = r.json()["error"]
        assert error["code"] == "kv_wait_timeout" and error["type"] == "server_error"
        assert error["message"].startswith("waited 0.5 s for KV pages to receive ")
        assert router_metric(router, "microserve_router_retries_total") == 0  # not retried
    finally:
        router.stop()
        d.http.post("/microserving/abort", json={"request_id": "holder"})
    assert_quiet("d", d.url)
    assert_quiet("p", p.url)
