"""A deployment file (TOML) read and checked: what `microserve up` starts (launcher/up.py).

Config (TOML; see deploy/local-cpu.toml):

    model = "smollm2-135m-instruct"      # or a Hugging Face directory; what every engine loads
    served_model_name = "..."            # optional: the name clients use
    tool_call_parser = "hermes"          # the router's tool-call format: hermes, llama3_json

    [router]
    host = "127.0.0.1"                   # 127.0.0.1 unless you mean it
    port = 8000
    max_connections = 4096               # client connections open at once, then a 503
    header_timeout_s = 10                # a request's head must arrive within this, then a 408
    body_timeout_s = 60                  # and its body within this after the head
    keep_alive_s = 75                    # an idle connection closes this long after an answer
    strategy = "pd"                      # a built-in (strategies/) or a .py path
    strategy_args = { }                  # the strategy's constructor arguments
    watch_strategy = false               # reload the strategy file when it changes
    strategies_dir = "strategies/"       # PUT /admin/strategy {"path"} loads .py files from here
    queue_timeout_s = 60                 # a request waits this long for KV pages, or for a
                                         # prefill engine to start on it, then a 503
    liveness_timeout_s = 5               # an engine silent this long (stopped, hung) is down

    [[engines]]
    name = "prefill-0"
    role = "prefill"                     # prefill, decode or any
    port = 8001                          # default: the router's port + 1 + its index
    args = ["--kv-cache-memory-gb", "1"] # more `microserve engine` options
    env = { CUDA_VISIBLE_DEVICES = "0" } # more environment

Engines whose args say `--kv-transfer nvshmem` form the deployment's NVSHMEM group, fixed at
start-up (microserve/nvshmem_group.py): each gets its rank (in the file's order), the group's
size and a rendezvous directory of this run through MICROSERVE_NVSHMEM_GROUP. A member that
exits is not restarted (a PE cannot join a running group): the deployment stops instead.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from microserve.http_limits import HttpLimits
from microserve.nvshmem_group import GROUP_ENV, group_specs
from router.engines import ROLES

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineLaunch:
    name: str
    port: int
    role: str = "any"
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Deployment:
    model: str | None
    served_model_name: str
    engines: tuple[EngineLaunch, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    http_limits: HttpLimits = HttpLimits()  # the router's
    strategy: str = "data_parallel"
    strategy_args: dict = field(default_factory=dict)
    watch_strategy: bool = False
    strategies_dir: str | None = None
    queue_timeout_s: float = 60.0
    tool_call_parser: str = "hermes"
    liveness_timeout_s: float | None = None  # None: the router's default


_TOP_KEYS = {"model", "served_model_name", "tool_call_parser", "router", "engines"}
_ROUTER_KEYS = {"host", "port", "strategy", "strategy_args", "watch_strategy", "strategies_dir",
                "queue_timeout_s", "liveness_timeout_s"}
_ENGINE_KEYS = {"name", "role", "host", "port", "args", "env"}
_HTTP_LIMIT_KEYS = {f.name for f in fields(HttpLimits)}  # [router] keys too


def load_deployment(path: str | Path, port: int | None = None,
                    strategies_dir: str | None = None,
                    queue_timeout_s: float | None = None, model: str | None = None,
                    host: str | None = None,
                    liveness_timeout_s: float | None = None) -> Deployment:
    """Read and check a config file; `port`, `strategies_dir`, `queue_timeout_s`, `model`,
    `host` (the router's) and `liveness_timeout_s` override its values. Raises ValueError
    naming the key and the file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from e
    _no_unknown(raw, _TOP_KEYS, str(path))
    router = raw.get("router", {})
    _no_unknown(router, _ROUTER_KEYS | _HTTP_LIMIT_KEYS, f"{path} [router]")
    router_port = port if port is not None else int(router.get("port", 8000))
    engines = raw.get("engines", [])
    if not engines:
        raise ValueError(f"{path} has no [[engines]]")
    launches = []
    for i, engine in enumerate(engines):
        where = f"{path} engines[{i}]"
        _no_unknown(engine, _ENGINE_KEYS, where)
        if "name" not in engine:
            raise ValueError(f"{where} has no name")
        role = engine.get("role", "any")
        if role not in ROLES:
            raise ValueError(f"{where}: role {role!r} is not one of {ROLES}")
        args = engine.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: args must be a list of strings, got {args!r}")
        for reserved in ("--model", "--port", "--host", "--served-model-name"):
            if reserved in args:
                raise ValueError(f"{where}: set {reserved} through the config's keys, not args")
        launches.append(EngineLaunch(
            name=engine["name"], port=int(engine.get("port", router_port + 1 + i)), role=role,
            host=engine.get("host", "127.0.0.1"), args=tuple(args),
            env={str(k): str(v) for k, v in engine.get("env", {}).items()}))
    _check_nvshmem_group(launches, str(path))
    ports = [router_port] + [e.port for e in launches]
    if len(set(ports)) != len(ports):
        raise ValueError(f"{path}: the router and engines need distinct ports, got {ports}")
    model = model or raw.get("model")
    return Deployment(
        model=model, served_model_name=raw.get("served_model_name") or model or DEFAULT_MODEL_NAME,
        engines=tuple(launches), host=host or router.get("host", "127.0.0.1"), port=router_port,
        http_limits=_http_limits(router, f"{path} [router]"),
        strategy=router.get("strategy", "data_parallel"),
        strategy_args=dict(router.get("strategy_args", {})),
        watch_strategy=bool(router.get("watch_strategy", False)),
        strategies_dir=strategies_dir or router.get("strategies_dir"),
        queue_timeout_s=float(queue_timeout_s if queue_timeout_s is not None
                              else router.get("queue_timeout_s", 60.0)),
        tool_call_parser=_tool_call_parser(raw.get("tool_call_parser", "hermes"), str(path)),
        liveness_timeout_s=_seconds(liveness_timeout_s if liveness_timeout_s is not None
                                    else router.get("liveness_timeout_s"),
                                    f"{path} [router] liveness_timeout_s"))


def _seconds(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number of seconds, got {value!r}")
    return float(value)


def _http_limits(router: dict, where: str) -> HttpLimits:
    given = {key: router[key] for key in _HTTP_LIMIT_KEYS if key in router}
    for key, value in given.items():
        kind, noun = ((int, "a whole number") if key == "max_connections"
                      else ((int, float), "a number of seconds"))
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{where}: {key} must be {noun}, got {value!r}")
    try:
        return HttpLimits(**given)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _tool_call_parser(name: str, where: str) -> str:
    from microserve.tool_parsers import PARSERS

    if name not in PARSERS:
        raise ValueError(f"{where}: tool_call_parser {name!r} is not one of {', '.join(PARSERS)}")
    return name


def _no_unknown(table: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")


def _arg(launch: EngineLaunch, flag: str, default: str) -> str:
    """The value of `flag` in the engine's args (the last one given, as argparse keeps)."""
    value = default
    args = list(launch.args)
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _on_cpu(launch: EngineLaunch) -> bool:
    return _arg(launch, "--device", "cpu") == "cpu"


def nvshmem_members(launches) -> list[int]:
    """Indices of the engines that receive KV with nvshmem: the deployment's NVSHMEM group."""
    return [i for i, launch in enumerate(launches)
            if _arg(launch, "--kv-transfer", "auto") == "nvshmem"]


def _check_nvshmem_group(launches: list[EngineLaunch], where: str) -> None:
    members = nvshmem_members(launches)
    for i in members:
        if _on_cpu(launches[i]):
            raise ValueError(f"{where} engines[{i}]: --kv-transfer nvshmem needs a GPU "
                             f"(--device cuda or cuda:N)")
    if len(members) == 1:
        raise ValueError(f"{where}: only engines[{members[0]}] has --kv-transfer nvshmem, and "
                         f"only members of its NVSHMEM group can write its KV pool: give the "
                         f"engines that send to it --kv-transfer nvshmem too (or use cuda_ipc)")


def with_nvshmem_group(launches: list[EngineLaunch], rendezvous: str) -> list[EngineLaunch]:
    """The engines receiving with nvshmem, each with its place in the deployment's NVSHMEM
    group (rank in the file's order, the group's size, `rendezvous`) in its environment."""
    members = nvshmem_members(launches)
    specs = dict(zip(members, group_specs(len(members), rendezvous)))
    return [replace(launch, env={**launch.env, GROUP_ENV: str(specs[i])}) if i in specs
            else launch for i, launch in enumerate(launches)]


def with_cpu_threads(launches: tuple[EngineLaunch, ...]) -> list[EngineLaunch]:
    """CPU engines on one host split its cores (each gets cores // CPU engines, at least one)
    unless their args say --cpu-threads: engines that each spin threads on every core slow
    each other down about tenfold."""
    on_cpu = [launch for launch in launches if _on_cpu(launch)]
    threads = max(1, (os.cpu_count() or 1) // max(1, len(on_cpu)))
    return [replace(launch, args=(*launch.args, "--cpu-threads", str(threads)))
            if launch in on_cpu and "--cpu-threads" not in launch.args else launch
            for launch in launches]
