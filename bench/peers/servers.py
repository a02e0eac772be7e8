"""The servers bench.peers compares, each started alone on this host and stopped after its round:

  vllm    vLLM's OpenAI server (`python3 -m vllm.entrypoints.openai.api_server`) with random
          weights (`--load-format dummy`) from the same config.json our `random:` models write
  engine  one `microserve engine`
  up      `microserve up` with the router in front of one engine

All serve the OpenAI completions API on 127.0.0.1; `Server.url` is its `/v1` base.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


SERVED_NAME = "peers"
START_TIMEOUT_S = 900  # vLLM compiles and captures graphs on its first start


@dataclass
class Server:
    """A started server: its process, its OpenAI base URL and how long it took to be healthy."""

    name: str
    proc: subprocess.Popen
    url: str  # the OpenAI base, .../v1
    ready_url: str  # answers 200 once the server takes requests...
    log_path: Path
    ready_line: str = ""  # ...and, if set, this line is in its log (`up` prints it last)
    started_at: float = field(default_factory=time.perf_counter)
    startup_s: float = 0.0  # set by `wait_ready`

    async def wait_ready(self) -> None:
        deadline = self.started_at + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=10) as http:
            while not await self._ready(http):
                if self.proc.poll() is not None or time.perf_counter() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{self.name} did not start (exit code "
                                       f"{self.proc.poll()}); its log ends:\n{tail}")
                await asyncio.sleep(0.2)
        self.startup_s = time.perf_counter() - self.started_at

    async def _ready(self, http: httpx.AsyncClient) -> bool:
        if self.ready_line and self.ready_line not in self.log_path.read_text(errors="replace"):
            return False
        try:
            return (await http.get(self.ready_url)).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, timeout_s: float = 60) -> None:
        """SIGINT (what Ctrl-C sends: `up` stops its engines, vLLM its engine core), wait, then
        SIGKILL whatever of its process group is left: the next server needs the GPU's memory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: nothing was left
            pass
        self.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    # every process of a run, children included, carries its folder in the environment:
    # whoever checks that a run left nothing behind finds them by it
    env = {**(env or os.environ), "BENCH_PEERS_RUN": str(log_path.parent)}
    with open(log_path, "wb") as log:
        # a session of its own: a stop that must kill takes the server's children with it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def start_vllm(model_dir: Path, workdir: Path, args: list[str], site: str | None) -> Server:
    """vLLM on random weights. `site`: a folder put in front of PYTHONPATH (bench/peers/
    install.sh installs vLLM into /tmp/peers-site on the device machines)."""
    port = _free_port()
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    # Greedy requests never reach the top-k/top-p sampler; without this vLLM imports FlashInfer
    # to decide whether it could use FlashInfer's sampler, and we do not carry FlashInfer.
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # the model is a local folder and the device machines reach no network: never wait on it
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--load-format", "dummy", "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    log = workdir / "vllm.log"
    base = f"http://127.0.0.1:{port}"
    return Server("vllm", _spawn(cmd, log, env), base + "/v1", base + "/health", log)


def start_engine(model: str, workdir: Path, args: list[str]) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "launcher.cli", "engine", "--model", model, "--served-model-name",
           SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    log = workdir / "engine.log"
    base = f"http://127.0.0.1:{port}"
    return Server("engine", _spawn(cmd, log, env), base + "/v1", base + "/health", log)


def start_up(model: str, workdir: Path, args: list[str]) -> Server:
    """`microserve up` from a deployment file written here: the router (data parallel) and
    one engine with `args`."""
    port, engine_port = _free_port(), _free_port()
    config = workdir / "peers-up.toml"
    quote = lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'  # noqa: E731
    config.write_text("\n".join([
        f"model = {quote(model)}", f"served_model_name = {quote(SERVED_NAME)}", "",
        "[router]", 'host = "127.0.0.1"', f"port = {port}", 'strategy = "data_parallel"', "",
        "[[engines]]", 'name = "e0"', f"port = {engine_port}",
        "args = [" + ", ".join(quote(a) for a in args) + "]", ""]))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    env["XDG_DATA_HOME"] = str(workdir / "data")  # `up` keeps batch files there
    log = workdir / "up.log"
    cmd = [sys.executable, "-m", "launcher.cli", "up", str(config)]
    base = f"http://127.0.0.1:{port}"
    return Server("up", _spawn(cmd, log, env), base + "/v1", base + "/v1/models", log,
                  ready_line="microserve up:")
