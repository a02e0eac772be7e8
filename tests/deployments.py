"""Live `microserve up` and `microserve router` processes for the router suites: write a
deployment file, start it, wait until the router routes to every engine, and at the end stop it
the way an operator does (Ctrl-C) and check that no process of it is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from daemons import ENGINE_AUTH, ENGINE_KEY, cpu_threads, free_port, gone_within

QUIET_KEYS = ("running", "waiting", "kv_pages_used", "kv_reservations", "kv_send_jobs")


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def toml_value(value) -> str:
    return json.dumps(value)  # strings, numbers, booleans and lists of them read the same in TOML


def write_config(path: Path, model_dir: str, strategy: str,
                 engines: list[tuple[str, str, list[str]]], router: dict | None = None
                 ) -> tuple[Path, int, dict[str, str]]:
    """A deployment file (`router`: more keys of its [router] table); returns it, the
    router's port and each engine's URL. A CPU engine gets one thread unless its args say
    (tests/daemons.py, cpu_threads; `up` alone would give a lone engine every core)."""
    port = free_port()
    lines = [f"model = {toml_value(model_dir)}", 'served_model_name = "test-model"', "",
             "[router]", f"port = {port}", f"strategy = {toml_value(strategy)}",
             *(f"{key} = {toml_value(value)}" for key, value in (router or {}).items()), ""]
    urls = {}
    for name, role, args in engines:
        engine_port = free_port()
        urls[name] = f"http://127.0.0.1:{engine_port}"
        lines += ["[[engines]]", f"name = {toml_value(name)}", f"role = {toml_value(role)}",
                  f"port = {engine_port}", f"args = {toml_value([*cpu_threads(args), *args])}",
                  ""]
    path.write_text("\n".join(lines))
    return path, port, urls


class Up:
    """`microserve up CONFIG` in a child process; output to `log_path`."""

    def __init__(self, config: Path, port: int, engine_urls: dict[str, str], log_path: Path,
                 *args: str, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.engine_urls = engine_urls
        self.log_path = log_path
        # `up` keeps batch data under XDG_DATA_HOME: the test's own directory, not $HOME.
        env = {"XDG_DATA_HOME": str(config.parent / "data"), **(env or os.environ)}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", "up", str(config), *args],
                stdout=log, stderr=subprocess.STDOUT, env=with_engine_key(env))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"microserve up exited with {self.proc.returncode}:\n{self.log()}")
            if "microserve up:" in self.log():
                return
            time.sleep(0.2)
        pytest.fail(f"microserve up not serving after {timeout_s} s:\n{self.log()}")

    def engine_pid(self, name: str) -> int:
        """The `microserve engine` process of engine `name` (its core is its child, in its
        process group)."""
        port = self.engine_urls[name].rsplit(":", 1)[1]
        return next(pid for pid in children(self.proc.pid) if f"--port {port} " in
                    Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))

    def tree(self) -> list[int]:
        """Engine daemons and their engine cores."""
        engines = children(self.proc.pid)
        return engines + [c for e in engines for c in children(e)]

    def interrupt(self, timeout_s: float = 60) -> int:
        """Ctrl-C; returns the exit code."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def up_prefill_decode(tmp: Path, model_dir: str, engine_args: list[str], admin: str,
                      strategy: str = "data_parallel", router: dict | None = None):
    """A fixture body: `microserve up` with a prefill and a decode engine (shm) running
    `strategy` (`router`: more keys of the [router] table); yields the running Up, stops it
    (checking nothing outlives it) after."""
    config, port, urls = write_config(tmp / "deploy.toml", model_dir, strategy, [
        ("p", "prefill", engine_args), ("d", "decode", [*engine_args, "--kv-transfer", "shm"])],
        router=router)
    deployment = Up(config, port, urls, tmp / "up.log",
                    env={**os.environ, "MICROSERVE_ADMIN_TOKEN": admin})
    try:
        deployment.wait_ready()
        yield deployment
    finally:
        if deployment.proc.poll() is None:
            stop_and_check(deployment)


def admin_session(up, request, token: str, reset: dict | None = None):
    """A fixture body: a client of `up`'s router with the admin token, its log attached to
    the test's report; after the test, `reset` (a body for PUT /admin/strategy) if given,
    then every engine checked quiet (nothing running, reserved or leaked)."""
    from conftest import DAEMON_LOGS
    request.node.stash[DAEMON_LOGS] = [up.log_path]
    with httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {token}"},
                      timeout=60) as http:
        yield http
        if reset is not None:
            http.put("/admin/strategy", json=reset)
    for name, url in up.engine_urls.items():
        assert_quiet(name, url)


def with_engine_key(env: dict | None) -> dict:
    """The environment for `up` or `router`: the suites' engine key unless `env` names one."""
    return {"MICROSERVE_ENGINE_API_KEY": ENGINE_KEY, **(env or os.environ)}


def engine_stats(url: str, check: bool = True) -> dict:
    r = httpx.get(url + "/microserving/stats", params={"check": 1} if check else None, timeout=30,
                  headers=ENGINE_AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def assert_quiet(name: str, url: str, timeout_s: float = 30) -> dict:
    """The engine has nothing running, waiting, reserved or sent, and its KV cache is intact."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = engine_stats(url)
        quiet = {k: body["stats"][k] for k in QUIET_KEYS}
        if not any(quiet.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert body["integrity"] == "ok", f"engine {name}: {body['integrity']}"
    assert quiet == dict.fromkeys(QUIET_KEYS, 0), (name, body["stats"])
    return body["stats"]


def stop_and_check(up: Up) -> None:
    """Ctrl-C the deployment: exit 0, and every engine process and core gone."""
    tree = up.tree()
    assert len(tree) == 2 * len(up.engine_urls), f"expected engines and cores, got {tree}"
    code = up.interrupt()
    assert code == 0, f"microserve up exited with {code}:\n{up.log()}"
    left = [pid for pid in tree if not gone_within(pid, 15)]
    assert not left, f"processes outlived microserve up: {left}"


class RouterProcess:
    """`microserve router` over engines already running; output to `log_path`."""

    def __init__(self, model_dir: str, engines: dict[str, str], log_path: Path, *args: str,
                 env: dict | None = None, host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()):
        """`host`: the address it binds; `prefix`: argv in front of the command (`ip netns
        exec NS`: another network, where it is alone and takes port 8000)."""
        self.port = free_port() if not prefix else 8000
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        cmd = [*prefix, sys.executable, "-m", "launcher.cli", "router", "--model", model_dir,
               "--served-model-name", "test-model", "--host", host, "--port", str(self.port),
               *[f"--engine={name}={url}" for name, url in engines.items()], *args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=with_engine_key(env))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"router not healthy after {timeout_s} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        assert code == 0, f"router exited with {code}:\n{self.log()}"
