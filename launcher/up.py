"""`microserve up CONFIG`: a whole deployment from one file (docs/router.md, "Start a deployment").

Starts every engine of the config as a `microserve engine` process, waits until each answers
/health, starts the router (in this process) over them with the config's strategy, prints the
endpoint, and then watches. Ctrl-C (or SIGTERM) stops the router and then the engines (exit
status 0). An engine that exits is logged with its exit status and last lines of output and
restarted after a backoff (1, 2, 4, 8, 16 s, then every 30 s) while the router routes around
it and takes it back once it answers again; the deployment stops (exit status 1) only when one
engine fails MAX_RESTARTS times in a row, each time exiting before it had served healthily for
STABLE_S. Engines run in their own process group (a terminal's Ctrl-C reaches only this
process, which stops things in order) and get SIGTERM if this process dies. Their output is
shown with `[name]` in front. A member of the deployment's NVSHMEM group is not restarted
(a PE cannot join a running group): the deployment stops instead.

The deployment file and what it may say: launcher/deployment.py. Every port is checked before
anything is written or started (a second deployment on a busy port fails without touching the
running one's files); the admin token's file lives as long as the router (credentials.py).

Secrets stay out of the file: --api-key / MICROSERVE_API_KEY guards the router's /v1,
--admin-token / MICROSERVE_ADMIN_TOKEN its /admin (generated when not given), --engine-api-key /
MICROSERVE_ENGINE_API_KEY the engines' APIs and the KV transfer between them (generated when not
given; the router sends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from launcher import credentials
from launcher.deployment import (
    Deployment,
    EngineLaunch,
    nvshmem_members,
    with_cpu_threads,
    with_nvshmem_group,
)
from launcher.transfer_paths import transfer_lines
from microserve.http_server import PortInUse, check_port_free, listen_socket
from kvcache.transfer.nvshmem_group import GROUP_ENV
from router.engines import EngineSpec
from router.server import Router, RouterConfig

log = logging.getLogger("microserve.up")

ENGINE_START_TIMEOUT_S = 900  # a large model loads for minutes
STOP_TIMEOUT_S = 30
MAX_RESTARTS = 5  # an engine failing this many times in a row stops the deployment
STABLE_S = 60.0  # an engine healthy this long before it exits starts a fresh count
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # then 30 s each time
# Replaces RESTART_BACKOFF_S (comma-separated seconds, the last repeated): the test suite, which
# lets an engine fail MAX_RESTARTS times, waits "1,0.1" (1.3 s) instead of 15 s.
BACKOFF_ENV = "MICROSERVE_RESTART_BACKOFF_S"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def restart_backoff() -> tuple[float, ...]:
    """The waits before each restart in a row: $MICROSERVE_RESTART_BACKOFF_S, or
    RESTART_BACKOFF_S."""
    raw = os.environ.get(BACKOFF_ENV)
    if raw is None:
        return RESTART_BACKOFF_S
    try:
        waits = tuple(float(x) for x in raw.split(","))
    except ValueError:
        waits = ()
    if not waits or not all(w >= 0 for w in waits):  # also refuses nan
        raise ValueError(f"{BACKOFF_ENV}={raw!r}: expected seconds >= 0, comma-separated")
    return waits


class EngineProcess:
    """One `microserve engine` child (started again after it exits, by `supervise`) and the
    task that relays its output."""

    def __init__(self, launch: EngineLaunch, model_dir: str, served_name: str, log_level: str,
                 api_key: str | None, deployment_id: str):
        self.launch = launch
        self._start_args = (model_dir, served_name, log_level, api_key, deployment_id)
        self.proc: asyncio.subprocess.Process | None = None
        self._relay: asyncio.Task | None = None
        self.tail: list[str] = []  # its last lines of output, for error messages
        self.restarts = 0  # times it was started again after exiting

    async def start(self) -> None:
        model_dir, served_name, log_level, api_key, deployment_id = self._start_args
        launch = self.launch
        cmd = [sys.executable, "-m", "launcher.cli", "engine", "--model", model_dir,
               "--served-model-name", served_name, "--host", launch.host,
               "--port", str(launch.port), "--log-level", log_level,
               "--deployment", deployment_id, *launch.args]
        inherited = {k: v for k, v in os.environ.items() if k != GROUP_ENV}  # up's, not its
        env = {**inherited, **launch.env, "PYTHONUNBUFFERED": "1"}
        env.pop("MICROSERVE_API_KEY", None)  # the router's client key, not the engines'
        if api_key is not None:
            env["MICROSERVE_API_KEY"] = api_key  # not on the command line: ps shows that
        if self._relay is not None:  # the previous run's output is all relayed
            await asyncio.gather(self._relay, return_exceptions=True)
        self.tail = []
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_die_with_parent)
        self._relay = asyncio.create_task(self._relay_output())

    async def _relay_output(self) -> None:
        prefix = f"[{self.launch.name}] "
        async for line in self.proc.stdout:
            text = line.decode(errors="replace").rstrip("\n")
            self.tail = (self.tail + [text])[-30:]
            print(prefix + text, flush=True)

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                if self.proc.returncode is not None:
                    raise EngineExited(f"engine {self.launch.name} exited with "
                                       f"{self.proc.returncode} while starting:\n"
                                       + "\n".join(self.tail))
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(self.launch.url + "/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {self.launch.name} not healthy after "
                                       f"{timeout_s:.0f} s")
                await asyncio.sleep(0.2)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set: whenever the engine exits, log why and start it again after
        a backoff. Returns (without restarting) when it failed MAX_RESTARTS times in a row."""
        failures = 0
        healthy_since = time.monotonic()
        backoff = restart_backoff()
        while not stop.is_set():
            code = await self.proc.wait()
            if stop.is_set():  # stopped on purpose
                return
            if self._relay is not None:
                await asyncio.gather(self._relay, return_exceptions=True)
            stable = time.monotonic() - healthy_since >= STABLE_S
            failures = 1 if stable else failures + 1
            name = self.launch.name
            log.error("engine %s exited with status %s; its last output:\n%s", name, code,
                      "\n".join(self.tail[-10:]) or "(none)")
            if GROUP_ENV in self.launch.env:
                log.error("engine %s was a member of the deployment's NVSHMEM group, which is "
                          "fixed: a PE cannot join a running group, so it is not restarted and "
                          "the deployment stops; start it again whole (an engine that must "
                          "restart alone needs --kv-transfer cuda_ipc or tcp)", name)
                return
            if failures >= MAX_RESTARTS:
                log.error("engine %s failed %d times in a row; giving up", name, failures)
                return
            delay = backoff[min(failures - 1, len(backoff) - 1)]
            log.warning("restarting engine %s in %g s (failure %d of %d allowed in a row); "
                        "the router routes around it meanwhile", name, delay, failures,
                        MAX_RESTARTS - 1)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                return
            await self.start()
            self.restarts += 1
            try:
                await self.wait_healthy(ENGINE_START_TIMEOUT_S)
            except EngineExited:
                healthy_since = time.monotonic()  # not stable: counts as one more failure
                continue
            except RuntimeError as e:  # hung while starting: kill it, which counts as a failure
                log.error("%s", e)
                self.proc.kill()
                healthy_since = time.monotonic()
                continue
            healthy_since = time.monotonic()
            log.info("engine %s is back (restart %d); the router takes it again when its "
                     "next health poll answers", name, self.restarts)

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.error("engine %s ignored SIGTERM for %d s; killing it", self.launch.name,
                          STOP_TIMEOUT_S)
                self.proc.kill()
                await self.proc.wait()
        if self._relay is not None:
            await asyncio.gather(self._relay, return_exceptions=True)
        return self.proc.returncode


class EngineExited(RuntimeError):
    """An engine process exited before it answered /health."""


async def up(deployment: Deployment, *, log_level: str = "info", api_key: str | None = None,
             admin_token: str | None = None, engine_api_key: str | None = None) -> int:
    """Run the deployment until Ctrl-C/SIGTERM (0) or until an engine keeps failing (1).

    Raises PortInUse, before anything is written or started, if the router's or an engine's
    port is taken: another deployment's engines must never be taken for this one's, nor its
    admin-token file overwritten. Without `admin_token` a new one is made once the ports are
    known free, saved in a file while the router runs (launcher/credentials.py) and removed
    when it stops."""
    restart_backoff()  # a bad value fails here, before anything starts
    try:
        router_sock = listen_socket(deployment.host, deployment.port)  # held until the end
    except PortInUse:
        raise PortInUse(deployment.host, deployment.port, "the router") from None
    try:
        for launch in deployment.engines:
            check_port_free(launch.host, launch.port, f"engine {launch.name}")
        with credentials.admin_token(admin_token, deployment.port) as token:
            return await _up(deployment, router_sock, log_level, api_key, token,
                             engine_api_key)
    finally:
        router_sock.close()


async def _up(deployment: Deployment, router_sock, log_level: str, api_key: str | None,
              admin_token: str | None, engine_api_key: str | None) -> int:
    from microserve.model_files import resolve_model

    model_dir = str(resolve_model(deployment.model))  # converted once, before the engines start
    # Names this run's engines: its router adopts no other engine that answers on their ports.
    deployment_id = f"{deployment.served_model_name}@{deployment.port}-{secrets.token_hex(4)}"
    launches = with_cpu_threads(deployment.engines)
    rendezvous = None  # the NVSHMEM group's, when engines receive with nvshmem
    if nvshmem_members(launches):
        rendezvous = tempfile.mkdtemp(prefix="microserve-nvshmem-")  # private to this user
        launches = with_nvshmem_group(launches, rendezvous)
    engines = [EngineProcess(launch, model_dir, deployment.served_model_name, log_level,
                             engine_api_key, deployment_id) for launch in launches]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router: Router | None = None
    try:
        for engine in engines:
            await engine.start()
        starting = asyncio.gather(*(e.wait_healthy(ENGINE_START_TIMEOUT_S) for e in engines))
        if not await _unless(stop, starting):
            return 0
        settings = deployment.router.settings()
        settings["data_dir"] = settings["data_dir"] or str(default_data_dir(deployment.port))
        router = Router(RouterConfig(
            tokenizer_dir=model_dir, served_model_name=deployment.served_model_name,
            engines=tuple(EngineSpec(e.name, e.url, e.role) for e in deployment.engines),
            api_key=api_key, admin_token=admin_token, engine_api_key=engine_api_key,
            deployment=deployment_id, **settings))
        await router.start()
        return await _serve(router, deployment, engines, stop, log_level, router_sock)
    finally:
        stop.set()  # ends the supervisors' waits
        if router is not None:
            await router.close()
        codes = await asyncio.gather(*(e.stop() for e in engines))
        log.info("engines stopped: %s", dict(zip((e.launch.name for e in engines), codes)))
        if rendezvous is not None:
            shutil.rmtree(rendezvous, ignore_errors=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def default_data_dir(port: int) -> Path:
    """Where `up` keeps the Files and Batches API's data when the deployment names no
    data_dir: one directory per router port, so two deployments never share one."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "microserve" / f"router-{port}"


async def _unless(stop: asyncio.Event, work) -> bool:
    """Await `work` unless `stop` is set first (then cancel it). True if it finished."""
    work = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait((work, stopper), return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False
    work.result()  # raises what it raised
    return True


async def _serve(router: Router, deployment: Deployment, engines: list[EngineProcess],
                 stop: asyncio.Event, log_level: str, sock) -> int:
    server = router.server(log_level)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if serving.done():
        serving.result()  # raises why it could not start
        raise RuntimeError("the router stopped while starting")
    active = router.host.active
    print(f"microserve up: {deployment.served_model_name!r} on "
          f"http://{deployment.host}:{deployment.port}/v1 — strategy {active.name}, engines "
          + ", ".join(f"{e.launch.name} ({e.launch.role}) {e.launch.url}" for e in engines)
          + "; Ctrl-C stops all", flush=True)
    print(f"microserve up: batches and files kept in {router.config.data_dir}", flush=True)
    for line in transfer_lines(list(router.pool)):
        print(f"microserve up: {line}", flush=True)
    supervisors = {asyncio.create_task(e.supervise(stop)): e for e in engines}
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({serving, stopper, *supervisors},
                                 return_when=asyncio.FIRST_COMPLETED)
    gave_up = [supervisors[t] for t in done if t in supervisors and not stop.is_set()]
    for task in done & supervisors.keys():
        task.result()  # a supervisor's own bug surfaces here
    for engine in gave_up:
        log.error("engine %s keeps failing; stopping the deployment", engine.launch.name)
    server.should_exit = True
    stop.set()
    await asyncio.gather(serving, return_exceptions=True)
    for task in (stopper, *supervisors):
        task.cancel()
    await asyncio.gather(stopper, *supervisors, return_exceptions=True)
    return 1 if gave_up else 0
