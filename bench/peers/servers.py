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
import tomllib
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


class Group:
    """Servers that serve as one (vLLM's prefill and decode servers behind a proxy): ready when
    all are, stopped together; `url` is the front's (the last one's)."""

    def __init__(self, name: str, members: list[Server]):
        self.name, self.members = name, members
        self.url = members[-1].url
        self.startup_s = 0.0

    async def wait_ready(self) -> None:
        try:
            await asyncio.gather(*(m.wait_ready() for m in self.members))
        except BaseException:
            self.stop()
            raise
        self.startup_s = max(m.startup_s for m in self.members)

    def stop(self) -> None:
        for m in reversed(self.members):
            m.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    # every process of a run, children included, carries its folder in the environment:
    # whoever checks that a run left nothing behind finds them by it
    env = {**(env or os.environ), "BENCH_PEERS_RUN": str(log_path.parent)}
    with open(log_path, "wb") as log:
        # a session of its own: a stop that must kill takes the server's children with it
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def vllm_env(site: str | None) -> dict:
    """This process's environment with `site` (where vLLM is installed) first on PYTHONPATH."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    return env


def start_vllm(model_dir: Path, workdir: Path, args: list[str], site: str | None,
               name: str = "vllm", env_more: dict | None = None) -> Server:
    """vLLM on random weights. `site`: a folder put in front of PYTHONPATH (bench/peers/
    install.sh installs vLLM into /tmp/peers-site on the device machines); `env_more`: more
    environment (a GPU of its own, a side-channel port)."""
    port = free_port()
    env = vllm_env(site) | (env_more or {})
    # Greedy requests never reach the top-k/top-p sampler; without this vLLM imports FlashInfer
    # to decide whether it could use FlashInfer's sampler, and we do not carry FlashInfer.
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # the model is a local folder and the device machines reach no network: never wait on it
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--load-format", "dummy", "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    log = workdir / f"{name}.log"
    base = f"http://127.0.0.1:{port}"
    return Server(name, spawn(cmd, log, env), base + "/v1", base + "/health", log)


def start_engine(model: str, workdir: Path, args: list[str], name: str = "engine") -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "launcher.cli", "engine", "--model", model, "--served-model-name",
           SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    log = workdir / f"{name.replace('@', '-')}.log"
    base = f"http://127.0.0.1:{port}"
    return Server(name, spawn(cmd, log, env), base + "/v1", base + "/health", log)


def start_up(model: str, workdir: Path, args: list[str]) -> Server:
    """`microserve up` from a deployment file written here: the router (data parallel) and
    one engine with `args`."""
    return start_deployment(workdir / "peers-up.toml", "up", up_config(model, [Engine("e0", args)]))


@dataclass
class Engine:
    """One [[engines]] entry of a deployment file."""

    name: str
    args: list[str]
    role: str | None = None  # "prefill" / "decode" under a P/D strategy


def _quote(s: str) -> str:  # a TOML basic string
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def up_config(model: str, engines: list[Engine], strategy: str = "data_parallel",
              strategy_args: dict | None = None) -> str:
    """A deployment file for `microserve up` (as deploy/*.toml), the router and every engine on
    free ports of 127.0.0.1."""
    router = ["[router]", 'host = "127.0.0.1"', f"port = {free_port()}",
              f"strategy = {_quote(strategy)}"]
    if strategy_args:
        router.append("strategy_args = { " + ", ".join(
            f"{k} = {_quote(v) if isinstance(v, str) else v}" for k, v in strategy_args.items())
            + " }")
    lines = [f"model = {_quote(model)}", f"served_model_name = {_quote(SERVED_NAME)}", "",
             *router, ""]
    for e in engines:
        lines += ["[[engines]]", f"name = {_quote(e.name)}", f"port = {free_port()}",
                  *([f"role = {_quote(e.role)}"] if e.role else []),
                  "args = [" + ", ".join(_quote(a) for a in e.args) + "]", ""]
    return "\n".join(lines)


def start_deployment(config: Path, name: str, text: str) -> Server:
    """`microserve up` on the deployment file `text`, written to `config`."""
    config.write_text(text)
    port = tomllib.loads(text)["router"]["port"]
    workdir = config.parent
    env = {k: v for k, v in os.environ.items() if k != "MICROSERVE_API_KEY"}
    env["XDG_DATA_HOME"] = str(workdir / "data")  # `up` keeps batch files there
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "launcher.cli", "up", str(config)]
    base = f"http://127.0.0.1:{port}"
    return Server(name, spawn(cmd, log, env), base + "/v1", base + "/v1/models", log,
                  ready_line="microserve up:")
