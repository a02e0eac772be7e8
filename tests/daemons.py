"""Live `microserve engine` daemons for the end-to-end suites: start one on a free port, wait
until it is healthy, share it across a module, stop it with SIGTERM and check that its engine
core went with it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 180
IDLE_KEYS = ("running", "waiting", "kv_pages_used")
# The engine key the suites' deployments share: KV transfer between engines needs one.
ENGINE_KEY = "test-engine-key"
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}


_GIVEN: set[int] = set()  # ports free_port handed out in this process


def free_port() -> int:
    """A port nothing listens on now, and one this process has not handed out before: the
    kernel may give the same free port to two binds in a row, and daemons started together
    bind theirs seconds later (and with SO_REUSEADDR two binds of one port both succeed
    until the second listens)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def cpu_threads(args: tuple[str, ...]) -> tuple[str, ...]:
    """`--cpu-threads 1` for an engine on the CPU, unless `args` choose (they come after it:
    argparse keeps the last). The suite runs two workers on the 2-core machine, each beside its
    daemons: an engine spinning a thread on every core waits for the others' threads. Measured
    there while a test file ran beside: 12 tiny-model requests of 100 tokens took 2.5-8.2 s
    with a thread per core and 0.4-1.0 s with one; two 1,000-token SmolLM2-135M prefills
    30-36 s against 14 s, and start-up 9.5-12.5 s against 8 s."""
    devices = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--device"]
    return ("--cpu-threads", "1") if devices[-1:] in ([], ["cpu"]) else ()  # the last counts


class Daemon:
    """One `microserve engine` process on a free port; its stdout and stderr go to `log_path`."""

    def __init__(self, model_dir: str, log_path: Path, name: str, *args: str,
                 host: str = "127.0.0.1", url_host: str | None = None,
                 prefix: tuple[str, ...] = ()):
        """`host`: the address it binds; `url_host`: the one to reach it at (default `host`);
        `prefix`: argv in front of the command (`ip netns exec NS`: another network)."""
        self.name, self.log_path = name, log_path
        self.port = free_port() if not prefix else 8000  # alone in its network namespace
        self.url = f"http://{url_host or host}:{self.port}"
        cmd = [*prefix, sys.executable, "-m", "launcher.cli", "engine", "--model", model_dir,
               "--served-model-name", name, "--host", host, "--port", str(self.port),
               *cpu_threads(args), *args]  # fmt: skip
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        keys = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--api-key"]
        self.key = keys[-1] if keys else None  # the last one given is the one argparse keeps
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        self.http = httpx.Client(base_url=self.url, timeout=30, headers=headers)
        self.terminated = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"daemon {self.name!r} exited with {self.proc.returncode} while "
                            f"starting:\n{self.log()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"daemon {self.name!r} not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def core_pid(self) -> int:
        """The engine-core child process (no psutil here: /proc lists each thread's children)."""
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            children += (task / "children").read_text().split()
        assert len(children) == 1, f"expected one engine-core child, found {children}"
        return int(children[0])

    def stats(self, check: bool = True) -> dict:
        r = self.http.get("/microserving/stats", params={"check": 1} if check else None)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout_s: float) -> dict:
        """Poll the stats until nothing runs, waits or holds a page (or the time is up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.stats()
            if all(body["stats"][k] == 0 for k in IDLE_KEYS) or time.monotonic() > deadline:
                return body
            time.sleep(0.05)

    def metrics(self) -> str:
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        return r.text

    def terminate(self) -> None:
        """SIGTERM (what a supervisor sends), once, without waiting. (A second one while the
        daemon stops its engine core, after uvicorn gave the signal back, ends it at once:
        exit -15.)"""
        self.http.close()
        if self.proc.poll() is None and not self.terminated:
            self.proc.send_signal(signal.SIGTERM)
            self.terminated = True

    def stop(self) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` exits (or is a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


LIVE: list[Daemon] = []  # daemons the idle check runs on after every test


def serve(daemon: Daemon) -> Iterator[Daemon]:
    """Fixture body: wait until `daemon` is ready, share it, then stop it and check it stopped
    cleanly and took its engine core with it."""
    together = serve_together(daemon)
    try:
        yield next(together)[0]
    finally:
        next(together, None)


def serve_together(*daemons: Daemon) -> Iterator[tuple[Daemon, ...]]:
    """`serve` for daemons a module uses from its first test on, made just before: their
    start-ups (~8 s each of imports and loading on the 2-core machine) overlap, and so do
    their shutdowns (~2 s each)."""
    cores = {}
    try:
        for daemon in daemons:
            daemon.wait_ready()
            cores[daemon.name] = daemon.core_pid()
            LIVE.append(daemon)
        yield daemons
    finally:
        for daemon in daemons:
            if daemon in LIVE:
                LIVE.remove(daemon)
            daemon.terminate()
        codes = [daemon.stop() for daemon in daemons]
    for daemon, code in zip(daemons, codes):
        # SIGTERM: graceful shutdown, the core is stopped by serve()'s cleanup, exit code 0.
        assert code == 0, f"{daemon.name!r} exited with {code}:\n{daemon.log()}"
        assert gone_within(cores[daemon.name], 10), f"{daemon.name!r}: the engine core " \
            "outlived its daemon"
