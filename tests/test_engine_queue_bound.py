"""The queue bound of an engine's own /v1 (--queue-timeout-s), end to end: a real `microserve
engine` daemon of the tiny model with one seat (--max-num-seqs 1) and a 0.25-s queue time.

While a long request holds the seat, a chat request and a streamed completion sent to the
engine's /v1 (not through a router) each get, once their queue time has passed, a 503 OpenAI
error JSON with `code: queue_timeout` and Retry-After; the streamed one gets it as its status,
before any event. The long request finishes untouched, and the engine then holds nothing: no
page, no request running or waiting, the KV integrity check passes.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import DAEMON_LOGS
from daemons import IDLE_KEYS, Daemon, serve

pytestmark = pytest.mark.slow

QUEUE_TIMEOUT_S = 0.25
LONG_TOKENS = 480  # the seat holder's output: ~0.8 s on this model, past the queue time
PROMPT = [(7 * i + 5) % 256 for i in range(24)]
MESSAGE = (r"waited 0.25 s for this engine to start computing request '(chatcmpl|cmpl)-\w+' "
           r"\(its queue_s\): it is busy; retry later")


@pytest.fixture(scope="module")
def engine(tiny_served_dir, tmp_path_factory) -> Iterator[Daemon]:
    log = tmp_path_factory.mktemp("queue-bound") / "daemon.log"
    yield from serve(Daemon(tiny_served_dir, log, "tiny", "--num-pages", "64",
                            "--max-num-seqs", "1", "--queue-timeout-s", str(QUEUE_TIMEOUT_S),
                            "--cpu-threads", "1"))


async def hold_the_seat(http: httpx.AsyncClient, started: asyncio.Event) -> dict:
    """The long streamed request: its status, finish reason and when it ended."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    held = {}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        held["status"] = response.status_code
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                started.set()
                held["finish_reason"] = json.loads(line[6:])["choices"][0]["finish_reason"]
    held["ended"] = time.monotonic()
    return held


async def refused(http: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    async with http.stream("POST", path, json=body) as response:
        await response.aread()
    return response


async def queue_behind_a_long_request(url: str) -> tuple[dict, list[httpx.Response], float]:
    """While the long request holds the seat, a chat request and a streamed completion."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        started = asyncio.Event()
        holder = asyncio.create_task(hold_the_seat(http, started))
        await asyncio.wait_for(started.wait(), 30)
        sent = time.monotonic()
        answers = await asyncio.gather(
            refused(http, "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "<9> <10>"}],
                "max_tokens": 4}),
            refused(http, "/v1/completions", {"model": "tiny", "prompt": PROMPT[:8],
                                              "max_tokens": 4, "stream": True}))
        refused_by = time.monotonic()
        held = await holder
    assert QUEUE_TIMEOUT_S <= refused_by - sent < QUEUE_TIMEOUT_S + 3, refused_by - sent
    held["ended"] -= refused_by  # > 0: it still ran when both were refused
    return held, answers


def test_requests_queued_past_the_engines_queue_time_get_a_503_and_leave_nothing(engine,
                                                                                 request):
    request.node.stash[DAEMON_LOGS] = [engine.log_path]
    before = engine.stats()["stats"]
    held, answers = asyncio.run(queue_behind_a_long_request(engine.url))
    for r in answers:
        assert (r.status_code, r.headers["retry-after"]) == (503, "5"), r.text
        assert r.headers["content-type"] == "application/json"  # an answer, not an event stream
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "server_error", "queue_timeout", None)
        assert re.fullmatch(MESSAGE, error["message"]), error
    # the seat holder still ran when both were refused, and ran to its end
    assert (held["status"], held["finish_reason"]) == (200, "length"), held
    assert held["ended"] > 0, held
    after = engine.wait_idle(timeout_s=10)
    assert after["integrity"] == "ok", after["integrity"]
    stats = after["stats"]
    assert {k: stats[k] for k in IDLE_KEYS} == dict.fromkeys(IDLE_KEYS, 0)
    assert (stats["kv_reservations"], stats["kv_send_jobs"]) == (0, 0)
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["generate_queue_timeouts"] == before["generate_queue_timeouts"] + 2
    # only the seat holder's tokens were generated
    assert stats["generation_tokens"] - before["generation_tokens"] == LONG_TOKENS
