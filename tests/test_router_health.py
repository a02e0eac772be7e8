"""How the router tells a dead engine from a busy one, and whom it sends the engine key: its
pool against listeners on 127.0.0.1 that play an engine's liveness and stats routes
(router/engines.py), in-process and to the exact request. tests/test_hung_engines.py stops
real engines.

A busy engine answers its liveness probe at once (the frontend answers it, whatever the core
does) while its stats come late: it stays up. An engine whose liveness does not answer within
the liveness timeout, or whose core has stopped beating, is down within that timeout. A
listener at a URL given to POST /admin/engines gets the probe's challenge first, without the
key, and nothing with the key unless it answers the challenge with the proof; an engine that
went down gets nothing with the key (no stats poll, no call) until it proves it again.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import msgspec
import pytest
from fastapi import FastAPI
from test_router_units import engine_info, engine_load

from microserve.auth import engine_proof
from microserve.backend import BackendUnavailable
from microserve.errors import install_error_handlers
from router.admin import AdminAPI, add_admin_routes
from router.engines import EnginePool, EngineSpec
from router.host import StrategyHost

KEY = "sk-deployment-key"
STATS = json.dumps({"stats": msgspec.to_builtins(engine_load()),
                    "info": msgspec.to_builtins(engine_info())}).encode()


class FakeEngine:
    """An HTTP/1.1 listener answering /microserving/live and /microserving/stats as an engine
    holding `key` would (None: one that holds none, so its liveness has no proof), recording
    each request's target and headers: what the router sent it."""

    def __init__(self, key: str | None = KEY, proof: str | None = None):
        self.key = key
        self.proof = proof  # answered to every challenge instead of the real proof (a replay)
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.live_hangs = self.stats_hang = False  # no answer (a stopped engine; a busy core)
        self.core_silent_s = 0.05
        self.url = ""
        self._handlers: set[asyncio.Task] = set()

    async def __aenter__(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                target = head[0].split(" ")[1]
                headers = {name.strip().lower(): value.strip()
                           for name, _, value in (line.partition(":") for line in head[1:] if line)}
                await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append((target, headers))
                body = await self._answer(target)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._handlers.discard(asyncio.current_task())
            writer.close()

    async def _answer(self, target: str) -> bytes:
        path, _, query = target.partition("?")
        if path == "/microserving/stats":
            if self.stats_hang:
                await asyncio.sleep(3600)
            return STATS
        assert path == "/microserving/live", target
        if self.live_hangs:
            await asyncio.sleep(3600)
        challenge = query.removeprefix("challenge=")
        proof = self.proof or (engine_proof(self.key, challenge) if self.key else None)
        return json.dumps({"core_silent_s": self.core_silent_s, "steps": 7, "in_step_s": 0.0,
                           "proof": proof}).encode()

    def keyed(self) -> list[str]:
        """The paths of the requests that carried the key."""
        return [t.partition("?")[0] for t, h in self.requests
                if h.get("authorization") == f"Bearer {KEY}"]


async def until(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_a_busy_engine_stays_up_and_a_silent_one_is_down_within_the_timeout():
    pool = EnginePool(api_key=KEY, poll_interval_s=0.05, health_timeout_s=0.2,
                      liveness_timeout_s=0.5)
    async with FakeEngine() as engine:
        await pool.add(EngineSpec("e", engine.url))
        handle = pool["e"]
        await pool.start()
        try:
            # A core in a long step: its stats wait for the step; its liveness does not.
            engine.stats_hang = True
            await asyncio.sleep(1.5)  # 3 liveness timeouts, 7 health timeouts
            assert (handle.up, pool.marked_down) == (True, 0)
            assert pool.stats_missed >= 3
            # The whole engine stops (SIGSTOP): no liveness answer.
            engine.live_hangs = True
            assert await until(lambda: not handle.up, 2.0) < 0.5 + 0.05 + 0.5
            assert handle.down_reason == f"engine {engine.url}: no liveness answer within 0.5 s"
            keyed_while_down = len(engine.keyed())
            engine.live_hangs = engine.stats_hang = False  # SIGCONT
            await until(lambda: handle.up, 2.0)
            assert len(engine.keyed()) > keyed_while_down  # its stats brought it back
            # Its frontend answers, but its core has stopped beating.
            engine.core_silent_s = 2.0
            assert await until(lambda: not handle.up, 2.0) < 0.05 + 0.5
            assert handle.down_reason == (f"engine {engine.url}: its engine core has sent no "
                                          "heartbeat for 2.0 s (stopped or hung; steps begun: 7)")
            await asyncio.sleep(0.1)  # a stats read sent before it went down has arrived
            keyed = len(engine.keyed())
            await asyncio.sleep(0.3)  # probed 6 times meanwhile, without the key
            assert len(engine.keyed()) == keyed  # a down engine gets no stats poll
            engine.core_silent_s = 0.05
            await until(lambda: handle.up, 2.0)
            # Something else now answers at its URL, without the key: down, and sent nothing.
            engine.key = None
            await until(lambda: not handle.up, 2.0)
            assert handle.down_reason.startswith(f"engine {engine.url} did not prove it holds "
                                                 "the engine key (its liveness answer has no ")
            await asyncio.sleep(0.1)
            keyed = len(engine.keyed())
            with pytest.raises(BackendUnavailable, match=r"^engine e is down \(engine http"):
                await handle.pin([1, 2, 3])  # an admin call (or a strategy's): not sent
            await asyncio.sleep(0.3)
            assert len(engine.keyed()) == keyed
            assert pool.marked_down == 3
        finally:
            await pool.close()


def admin_app(pool: EnginePool) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    add_admin_routes(app, AdminAPI(pool, StrategyHost(pool), tokenizer=None))
    return app


async def add_engine(pool: EnginePool, url: str, name: str = "new") -> httpx.Response:
    transport = httpx.ASGITransport(app=admin_app(pool))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
        return await http.post("/admin/engines", json={"name": name, "url": url})


@pytest.mark.parametrize("listener, answer", [
    (dict(key=None), "no proof"),  # holds no key: answers without a proof
    (dict(key="sk-another-key"), "a wrong proof"),  # another deployment's engine
    (dict(proof=engine_proof(KEY, "00" * 16)), "a wrong proof"),  # replays an old proof
])
async def test_a_url_gets_the_engine_key_only_after_proving_it_holds_it(listener, answer):
    pool = EnginePool(api_key=KEY, liveness_timeout_s=2.0)
    async with FakeEngine(**listener) as impostor:
        refused = await add_engine(pool, impostor.url)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        f"engine {impostor.url} did not prove it holds the engine key (its liveness answer has "
        f"{answer}): it is not an engine of this deployment, or its --api-key is not the "
        "router's --engine-api-key; nothing was sent to it with the key")
    [(target, headers)] = impostor.requests  # the probe alone, without the key
    assert re.fullmatch(r"/microserving/live\?challenge=[0-9a-f]{32}", target)
    assert "authorization" not in headers
    assert len(pool) == 0
    async with FakeEngine() as engine:  # one holding the key, added under two names
        added = [await add_engine(pool, engine.url, name) for name in ("new", "again")]
    assert [(r.status_code, r.json()["state"]) for r in added] == [(201, "up")] * 2
    assert [t.partition("?")[0] for t, _ in engine.requests] == [
        "/microserving/live", "/microserving/stats"] * 2
    assert engine.keyed() == ["/microserving/stats"] * 2  # each after its proof, never before
    challenges = {t for t, _ in engine.requests if t.startswith("/microserving/live")}
    assert len(challenges) == 2  # a fresh challenge each time: a recorded proof is no use
    await pool.close()


async def test_a_router_without_an_engine_key_asks_for_no_proof():
    pool = EnginePool(liveness_timeout_s=2.0)
    async with FakeEngine(key=None) as engine:
        assert (await add_engine(pool, engine.url)).status_code == 201
    assert [h.get("authorization") for _, h in engine.requests] == [None, None]
    await pool.close()

