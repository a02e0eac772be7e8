"""The router when things go wrong, on real processes serving the tiny model: two `microserve
engine` daemons and a `microserve router` in front of them.

An engine's refusal reaches the client as the same OpenAI error; a strategy that raises is a
500 naming it; a client that goes away and a strategy that fails leave nothing on any engine;
killing one engine of two under load leaves the router serving from the other; `microserve up`
stops the whole deployment when one engine dies.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from conftest import DAEMON_LOGS, hf_greedy
from daemons import ENGINE_AUTH, ENGINE_KEY, Daemon, gone_within, serve, serve_together
from deployments import (RouterProcess, Up, assert_quiet, children, engine_stats,
                         write_config)

from launcher.up import BACKOFF_ENV, MAX_RESTARTS

pytestmark = pytest.mark.slow

ADMIN = "faults-admin"
ENGINE_ARGS = ("--num-pages", "16", "--max-model-len", "512",  # 256 tokens of KV
               "--api-key", ENGINE_KEY)
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def engine(model_dir, tmp_path_factory, name, args=ENGINE_ARGS):
    log = tmp_path_factory.mktemp(name) / "daemon.log"
    return Daemon(model_dir, log, name, *args)


@pytest.fixture(scope="module")
def engines(tiny_served_dir, tmp_path_factory):
    yield from serve_together(engine(tiny_served_dir, tmp_path_factory, "e1"),
                              engine(tiny_served_dir, tmp_path_factory, "e2"))


@pytest.fixture(scope="module")
def e1(engines):
    return engines[0]


@pytest.fixture(scope="module")
def e2(engines):
    return engines[1]


@pytest.fixture(scope="module")
def router(e1, e2, tiny_served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    process = RouterProcess(tiny_served_dir, {"e1": e1.url, "e2": e2.url}, log,
                            "--admin-token", ADMIN)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def engines_quiet(request):
    names = [n for n in ("e1", "e2") if n in request.fixturenames]
    engines = [request.getfixturevalue(n) for n in names]
    logs = [e.log_path for e in engines]
    if "router" in request.fixturenames:
        logs.append(request.getfixturevalue("router").log_path)
    request.node.stash[DAEMON_LOGS] = logs
    yield
    for e in engines:
        assert_quiet(e.name, e.url)


def use(router, **body) -> dict:
    r = httpx.put(router.url + "/admin/strategy", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def completion(url: str, prompt: list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    # The engines' key too: engines answer only to it (the router ignores it).
    return httpx.post(url + "/v1/completions", timeout=60, headers=ENGINE_AUTH, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        **extra})


def test_tiny_model_through_the_router_gives_hf_greedy_tokens(router, e1, tiny_served_dir):
    use(router, builtin="pd")
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    want = hf_greedy(tiny_served_dir, [prompt], 8)[0]
    r = completion(router.url, prompt, logprobs=0)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"<{t}>" for t in want]


def test_an_engine_refusal_reaches_the_client_unchanged(router, e1, e2):
    prompt = [5] * 300  # within max_model_len (512), beyond the engines' 256 tokens of KV
    direct = completion(e1.url, prompt)
    assert direct.status_code == 400
    assert "exceeds the KV cache capacity of 256 tokens" in direct.json()["error"]["message"]
    use(router, builtin="data_parallel")
    routed = completion(router.url, prompt)
    assert (routed.status_code, routed.json()) == (400, direct.json())
    # Under P/D the decode engine's prep_recv (of the whole prompt: P samples the first
    # token of a greedy request) refuses first, with its own 400.
    use(router, builtin="pd")
    direct = httpx.post(e2.url + "/microserving/prep_recv", headers=ENGINE_AUTH,
                        json={"request_id": "refused", "prompt": prompt, "end": len(prompt)})
    assert direct.status_code == 400, direct.text
    routed = completion(router.url, prompt)
    assert (routed.status_code, routed.json()) == (400, direct.json())
    assert "needs 19 KV pages, but this engine's pool has 16 pages" in routed.text


RAISING = """
from router.strategy import Strategy

class Raising(Strategy):
    def __init__(self, after_first_chunk=False):
        self.after_first_chunk = after_first_chunk

    async def generate(self, request, engines):
        d, p = engines["e1"], engines["e2"]
        recv = await d.prep_recv(request, end=-1)
        await p.remote_send(request, recv.matched, len(request.prompt) - 1, recv.kv_addr)
        async for chunk in d.start_generate(request, begin=len(request.prompt) - 1):
            yield chunk
            if self.after_first_chunk:
                raise ZeroDivisionError("a bug after the first chunk")
        raise ZeroDivisionError("a bug at the end")
"""


def test_a_strategy_that_raises_is_a_500_and_nothing_leaks(router, e1, e2):
    loaded = use(router, source=RAISING, args={"after_first_chunk": True}, filename="raising.py")
    prompt = [(3 * i + 1) % 256 for i in range(40)]
    r = completion(router.url, prompt)
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["message"] == (f"Internal server error: strategy 'Raising' v{loaded['version']} "
                                "raised ZeroDivisionError")
    assert error["type"] == "server_error"
    # Streaming: the status line went out with the first chunk; the error is the last event.
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "raised ZeroDivisionError" in events[-2]
    state = httpx.get(router.url + "/admin/strategy", headers=AUTH).json()
    assert state["active"]["failed"] == 2 and state["active"]["finished"] == 0


def test_a_client_that_goes_away_is_aborted_on_every_engine(router, e1, e2):
    use(router, builtin="pd")  # e2 prefills and sends, e1 decodes
    prompt = [(5 * i + 2) % 256 for i in range(60)]
    before = engine_stats(e1.url, check=False)["stats"]["generation_tokens"]
    failed_before = failed_requests(router)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 180, "temperature": 0, "ignore_eos": True,
            "stream": True}) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i == 8:
                break  # leaves the block: the connection closes mid-stream
    deadline = time.monotonic() + 20
    while failed_requests(router) != failed_before + 1:
        assert time.monotonic() < deadline, "the router did not end the request"
        time.sleep(0.05)
    assert_quiet("e1", e1.url)
    assert engine_stats(e1.url, check=False)["stats"]["generation_tokens"] - before < 180


def failed_requests(router) -> float:
    prefix = 'microserve_router_requests_total{strategy="PrefillDecode",outcome="failed"} '
    lines = httpx.get(router.url + "/metrics").text.splitlines()
    return next((float(line[len(prefix):]) for line in lines if line.startswith(prefix)), 0.0)


def test_killing_one_engine_under_load_leaves_the_router_serving(tiny_served_dir,
                                                                   tmp_path_factory):
    args = ("--num-pages", "256", "--max-model-len", "512", "--api-key", ENGINE_KEY)
    victim = engine(tiny_served_dir, tmp_path_factory, "victim", args)
    survivor_gen = serve(engine(tiny_served_dir, tmp_path_factory, "survivor", args))
    survivor = next(survivor_gen)
    victim.wait_ready()
    log = tmp_path_factory.mktemp("router-kill") / "router.log"
    router = RouterProcess(tiny_served_dir, {"victim": victim.url, "survivor": survivor.url},
                           log, "--strategy", "data_parallel", "--admin-token", ADMIN)
    prompts = [[(11 * i + k) % 256 for k in range(24)] for i in range(4)]
    want = hf_greedy(tiny_served_dir, prompts, 200)
    try:
        router.wait_ready()

        async def one(http, i: int):
            r = await http.post("/v1/completions", json={
                "prompt": prompts[i % 4], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "logprobs": 0})
            if r.status_code != 200:
                return r.status_code
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            return "ok" if tokens == [f"<{t}>" for t in want[i % 4]] else "wrong"

        async def load_and_kill():
            async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
                during = [asyncio.create_task(one(http, i)) for i in range(24)]
                while not engine_stats(victim.url, check=False)["stats"]["running"]:
                    await asyncio.sleep(0.01)
                core = victim.core_pid()
                os.kill(victim.proc.pid, signal.SIGKILL)  # the whole engine: daemon first
                os.kill(core, signal.SIGKILL)
                first = await asyncio.gather(*during)
                after = await asyncio.gather(*(one(http, i) for i in range(12)))
                return first, after

        first, after = asyncio.run(load_and_kill())
        assert after == ["ok"] * 12  # every later request went to the survivor
        assert set(first) <= {"ok", 503}, first  # cut off mid-generation: a clear 503
        assert first.count("ok") >= 12, first  # the survivor's share, and retried ones
        engines = {e["name"]: e["state"] for e in httpx.get(
            router.url + "/admin/engines", headers=AUTH).json()["engines"]}
        assert engines == {"victim": "down", "survivor": "up"}
        assert httpx.get(router.url + "/health").status_code == 200
        assert_quiet("survivor", survivor.url)
    finally:
        router.stop()
        victim.stop()
        next(survivor_gen, None)


def _engine_pid(up: Up, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    return next(pid for pid in children(up.proc.pid) if f"--port {port} " in
                open(f"/proc/{pid}/cmdline").read().replace("\0", " "))


def _wait_for(predicate, timeout_s: float, what: str, up: Up) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s:\n{up.log()}"
        time.sleep(0.2)


def _states(up: Up) -> dict:
    r = httpx.get(up.url + "/admin/engines", headers=AUTH)
    return {e["name"]: e["state"] for e in r.json()["engines"]}


def test_up_restarts_a_dead_engine_and_serves_meanwhile(tiny_served_dir, tmp_path):
    """An engine killed: up logs why, the router serves on the other, up restarts it with a
    backoff and the router takes it back. A port it cannot bind keeps it failing: after
    MAX_RESTARTS failures in a row up stops everything, with status 1."""
    config, port, urls = write_config(tmp_path / "deploy.toml", tiny_served_dir,
                                      "data_parallel", [("a", "any", list(ENGINE_ARGS)),
                                                        ("b", "any", list(ENGINE_ARGS))])
    # The first restart after the usual 1 s (what lets the blocker below take a's port before a
    # comes back), the next ones after 0.1 s rather than 2, 4 and 8: the same restarts in the
    # same order, 13.7 s sooner.
    up = Up(config, port, urls, tmp_path / "up.log", env={
        **os.environ, "MICROSERVE_ADMIN_TOKEN": ADMIN, BACKOFF_ENV: "1,0.1"})
    blocker = None
    try:
        up.wait_ready()
        prompt = [3, 4, 5, 6, 7, 8, 9, 10] * 5
        first_a = _engine_pid(up, urls["a"])
        os.kill(first_a, signal.SIGKILL)
        _wait_for(lambda: "restarting engine a in 1 s" in up.log(), 30, "restart notice", up)
        assert "engine a exited with status -9" in up.log()
        for _ in range(4):  # served meanwhile: by b, or by a once it is back
            r = completion(up.url, prompt)
            assert r.status_code == 200, r.text
        _wait_for(lambda: _states(up) == {"a": "up", "b": "up"}, 120, "a back in the pool", up)
        # up's own health check logs it; the router's poller may have seen a first.
        _wait_for(lambda: "engine a is back (restart 1)" in up.log(), 30, "up's notice", up)
        second_a = _engine_pid(up, urls["a"])
        assert second_a != first_a
        assert_quiet("a", urls["a"])
        # Now a cannot come back: something else holds its port.
        os.kill(second_a, signal.SIGKILL)
        assert gone_within(second_a, 15)
        _wait_for(lambda: _states(up)["a"] == "down", 30, "a marked down", up)
        blocker = socket.create_server(("127.0.0.1", int(urls["a"].rsplit(":", 1)[1])))
        r = completion(up.url, prompt)  # b still serves while a fails
        assert r.status_code == 200, r.text
        assert up.proc.wait(240) == 1, up.log()
        log = up.log()
        assert f"engine a failed {MAX_RESTARTS} times in a row; giving up" in log
        assert "engine a keeps failing; stopping the deployment" in log
        # The first kill, the blocked restarts: MAX_RESTARTS exits in a row, each but the last
        # followed by a restart.
        assert log.count("restarting engine a in") == MAX_RESTARTS - 1
    finally:
        if blocker is not None:
            blocker.close()
        if up.proc.poll() is None:
            up.proc.kill()


def test_the_deployment_file_is_checked(tiny_served_dir, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(textwrap.dedent("""
        model = "x"
        [router]
        strategy = "pd"
        colour = "blue"
        [[engines]]
        name = "a"
    """))
    up = Up(bad, 1, {}, tmp_path / "up.log")
    assert up.proc.wait(60) == 2
    assert "[router]: unknown key(s) colour" in up.log()


def test_a_busy_port_is_named_before_anything_starts(tiny_served_dir, tmp_path):
    """A second deployment on ports in use: `up` says which port and for what, and exits before
    it starts an engine (so it never takes the first deployment's engines for its own);
    `microserve engine` and `microserve router` say the same before they load anything."""
    config, port, urls = write_config(tmp_path / "deploy.toml", tiny_served_dir,
                                      "data_parallel", [("a", "any", list(ENGINE_ARGS))])
    engine_port = int(urls["a"].rsplit(":", 1)[1])
    for busy, what in ((port, "the router"), (engine_port, "engine a")):
        with socket.socket() as blocker:
            blocker.bind(("127.0.0.1", busy))
            blocker.listen()
            up = Up(config, port, urls, tmp_path / f"up-{busy}.log")
            assert up.proc.wait(60) == 2
            assert "engine ready" not in up.log()  # no engine was started
            assert (f"microserve: error: port {busy} on 127.0.0.1 (for {what}) is already in "
                    "use, by another microserve deployment or another program") in up.log()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        busy = blocker.getsockname()[1]
        for cmd, what in ((["engine", "--model", tiny_served_dir], "this server"),
                          (["router", "--model", tiny_served_dir, "--engine",
                            "a=http://127.0.0.1:1"], "the router")):
            done = subprocess.run([sys.executable, "-m", "launcher.cli", *cmd, "--port",
                                   str(busy)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2, done.stderr
            assert f"port {busy} on 127.0.0.1 (for {what}) is already in use" in done.stderr


def test_usage_counts_prefix_cache_hits_not_kv_received(router, e1, e2):
    """cached_tokens is what a prefix cache served, on whichever engine: 0 for a new prompt
    under P/D (D received the rest from P; that is not a cache hit), the whole cached pages
    when the prompt comes again, and the same when a stop string ends the request early."""
    use(router, builtin="pd")
    prompt = [(13 * i + 5) % 256 for i in range(70)]
    whole = (len(prompt) - 1) // 16 * 16  # D caches prompt[:-1] in whole pages

    def cached(r: httpx.Response) -> int:
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(completion(router.url, prompt, max_tokens=4)) == 0
    assert cached(completion(router.url, prompt, max_tokens=4)) == whole
    use(router, builtin="data_parallel")
    for _ in range(2):  # round robin: each engine serves it once, from its prefix cache
        r = completion(router.url, prompt, max_tokens=40, stop="<")  # ends at the 1st token
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert cached(r) == whole
