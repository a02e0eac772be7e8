"""A deployment file (TOML) read and checked: what `microserve up` starts (launcher/up.py).

Config (TOML; see deploy/local-cpu.toml, and docs/router.md for every key):

    model = "smollm2-135m-instruct"      # or a Hugging Face directory; what every engine loads
    served_model_name = "..."            # optional: the name clients use
    tool_call_parser = "hermes"          # the router's tool-call format: hermes, llama3_json
    reasoning_parser = "deepseek_r1"     # optional: thinking split from the answer
    generation_config = "auto"           # requests' sampling defaults: the model's, or openai
    chat_template = "t.jinja"            # optional: instead of the model's (a file, or the text)

    [router]                             # the router's settings (router/settings.py)
    port = 8000
    strategy = "pd"                      # a built-in (strategies/) or a .py path

    [[engines]]
    name = "prefill-0"
    role = "prefill"                     # prefill, decode or any
    port = 8001                          # default: the router's port + 1 + its index
    args = ["--kv-cache-memory-gb", "1"] # more `microserve engine` options
    env = { CUDA_VISIBLE_DEVICES = "0" } # more environment

The [router] keys, `tool_call_parser`, `reasoning_parser`, `generation_config` and `chat_template` are the router's
settings (router/settings.py): their names, types and defaults come from there, as `microserve
router`'s options do. Each engine's
args are parsed as `microserve engine` parses them, into the EngineConfig it will run with
(`EngineLaunch.config`): a bad one fails here, naming the engine and the option.

Engines whose args say `--kv-transfer nvshmem` form the deployment's NVSHMEM group, fixed at
start-up (kvcache/transfer/nvshmem_group.py): each gets its rank (in the file's order), the group's
size and a rendezvous directory of this run through MICROSERVE_NVSHMEM_GROUP. A member that
exits is not restarted (a PE cannot join a running group): the deployment stops instead.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from microserve.http_limits import HttpLimits
from kvcache.transfer.nvshmem_group import GROUP_ENV, group_specs
from router.engines import ROLES
from router.settings import SETTINGS, RouterSettings

if TYPE_CHECKING:
    from engine.config import EngineConfig


@dataclass(frozen=True)
class EngineLaunch:
    name: str
    port: int
    config: EngineConfig  # its args parsed as `microserve engine` parses them
    role: str = "any"
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()  # what its command line says, after what `up` adds
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Deployment:
    model: str | None
    served_model_name: str
    engines: tuple[EngineLaunch, ...]
    router: RouterSettings = RouterSettings()  # the file's, with the command line's overrides
    router_given: frozenset[str] = frozenset()  # the settings the file or the command line set

    @property
    def host(self) -> str:
        return self.router.host

    @property
    def port(self) -> int:
        return self.router.port

    @property
    def http_limits(self) -> HttpLimits:
        return self.router.http_limits

    @property
    def liveness_timeout_s(self) -> float | None:
        """As the file or the command line set it; None: the router's default."""
        return self.router.liveness_timeout_s if "liveness_timeout_s" in self.router_given else None


# The file's keys: [router] and the top level's are the router's settings (router/settings.py)
_TOP_KEYS = {"model", "served_model_name", "router", "engines",
             *(name for name, f in SETTINGS.items() if f.metadata["file"] == "top")}
_HTTP_LIMITS = {f.name: f for f in fields(HttpLimits)}  # [router] keys too
_ROUTER_KEYS = {*(name for name, f in SETTINGS.items()
                  if f.metadata["file"] == "router" and name != "http_limits"), *_HTTP_LIMITS}
_ENGINE_KEYS = {"name", "role", "host", "port", "args", "env"}
# A setting's type -> what a value must be, and how an error says it
_KINDS = {"str": (str, "a string"), "int": (int, "a whole number"),
          "float": ((int, float), "a number of seconds"), "bool": (bool, "true or false"),
          "dict": (dict, "a table")}


def load_deployment(path: str | Path, model: str | None = None, **overrides) -> Deployment:
    """Read and check a deployment file. `model` and `overrides` (router settings by name; None:
    not given) take the place of the file's values: what `microserve up`'s options say. Each
    engine's args are parsed as `microserve engine` would parse them. Raises ValueError naming
    the file, the table or engine, and the key or argument."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path} is not valid TOML: {e}") from e
    _no_unknown(raw, _TOP_KEYS, str(path))
    table = raw.get("router", {})
    _no_unknown(table, _ROUTER_KEYS, f"{path} [router]")
    given = {**_router_settings(raw, table, str(path)),
             **{name: value for name, value in overrides.items() if value is not None}}
    try:
        router = RouterSettings(**given)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    from launcher.options import DEFAULT_MODEL_NAME  # imports the engine's config

    model = model or raw.get("model")
    launches = _engines(raw.get("engines", []), router.port, model or DEFAULT_MODEL_NAME, path)
    ports = [router.port] + [e.port for e in launches]
    if len(set(ports)) != len(ports):
        raise ValueError(f"{path}: the router and engines need distinct ports, got {ports}")
    return Deployment(
        model=model, served_model_name=raw.get("served_model_name") or model or DEFAULT_MODEL_NAME,
        engines=tuple(launches), router=router, router_given=frozenset(given))


def _router_settings(raw: dict, table: dict, path: str) -> dict:
    """The router settings the file sets, each checked against its declared type."""
    given = {}
    for name, setting in SETTINGS.items():
        where = setting.metadata["file"]
        if where == "top" and name in raw:
            given[name] = _typed(raw[name], setting.type, f"{path} {name}")
        elif where == "router" and name in table:
            given[name] = _typed(table[name], setting.type, f"{path} [router] {name}")
    limits = {key: _typed(table[key], f.type, f"{path} [router]: {key}")
              for key, f in _HTTP_LIMITS.items() if key in table}
    if limits:
        try:
            given["http_limits"] = HttpLimits(**limits)
        except ValueError as e:
            raise ValueError(f"{path} [router]: {e}") from None
    return given


def _typed(value, annotation: str, name: str):
    """`value` if it is what a setting of type `annotation` takes (a float as float), else a
    ValueError saying what `name` must be."""
    kind, noun = _KINDS[annotation.removesuffix(" | None")]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {noun}, got {value!r}")
    return float(value) if annotation.startswith("float") else value


def _engines(engines: list, router_port: int, model: str, path: Path) -> list[EngineLaunch]:
    """The [[engines]] tables, each one's args parsed into its EngineConfig."""
    from launcher.options import engine_config, parse_engine_args

    if not engines:
        raise ValueError(f"{path} has no [[engines]]")
    launches, parsed = [], []
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
        try:
            parsed.append(parse_engine_args(args))
        except ValueError as e:
            raise ValueError(f"{where} ({engine['name']}): {e}") from None
    group = _nvshmem_group(parsed, str(path))
    for i, (engine, options) in enumerate(zip(engines, parsed)):
        if i in group:
            options.nvshmem_group = str(group[i])
        try:
            config = engine_config(options, model)
        except ValueError as e:
            raise ValueError(f"{path} engines[{i}] ({engine['name']}): {e}") from None
        launches.append(EngineLaunch(
            name=engine["name"], port=int(engine.get("port", router_port + 1 + i)),
            config=config, role=engine.get("role", "any"), host=engine.get("host", "127.0.0.1"),
            args=tuple(engine.get("args", [])),
            env={str(k): str(v) for k, v in engine.get("env", {}).items()}))
    _check_gpu_shares(launches, str(path))
    return launches


def _check_gpu_shares(launches: list[EngineLaunch], where: str) -> None:
    """Refuse engines whose memory shares on one GPU add up to more than all of it (each rank
    of a tensor-parallel engine takes its share of its own GPU): they would fail one after
    another at start-up, out of memory. Engines given CUDA_VISIBLE_DEVICES number GPUs their
    own way and are left out."""
    claims: dict[int, list[tuple[str, float]]] = {}
    for launch in launches:
        c = launch.config
        if not c.device.startswith("cuda") or "CUDA_VISIBLE_DEVICES" in launch.env:
            continue
        first = int(c.device.partition(":")[2] or 0)
        for gpu in range(first, first + c.tensor_parallel_size):
            claims.setdefault(gpu, []).append((launch.name, c.gpu_memory_utilization))
    for gpu, shares in sorted(claims.items()):
        total = sum(share for _, share in shares)
        if total > 1.0 + 1e-9:
            named = ", ".join(f"{name} {share:g}" for name, share in shares)
            raise ValueError(f"{where}: GPU cuda:{gpu} is shared by {named} "
                             f"(--gpu-memory-utilization), {total:g} of its memory in all; give "
                             f"the engines shares adding up to at most 1 (e.g. "
                             f"{1 / len(shares):.2f} each), or other GPUs (a tensor-parallel "
                             f"engine on cuda:N takes cuda:N .. N+size-1)")


def _no_unknown(table: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(known))})")


# The group's places are known when the file is read; its rendezvous directory is made when
# `up` starts it (with_nvshmem_group): until then the members' configs name this one.
_RENDEZVOUS_UNMADE = "/nonexistent/made-by-microserve-up"


def _nvshmem_group(parsed: list, where: str) -> dict:
    """Index -> GroupSpec of the engines that receive KV with nvshmem: the deployment's NVSHMEM
    group, checked (GPU engines, at least two)."""
    members = [i for i, options in enumerate(parsed) if options.kv_transfer == "nvshmem"]
    for i in members:
        if parsed[i].device == "cpu":
            raise ValueError(f"{where} engines[{i}]: --kv-transfer nvshmem needs a GPU "
                             f"(--device cuda or cuda:N)")
    if len(members) == 1:
        raise ValueError(f"{where}: only engines[{members[0]}] has --kv-transfer nvshmem, and "
                         f"only members of its NVSHMEM group can write its KV pool: give the "
                         f"engines that send to it --kv-transfer nvshmem too (or use cuda_ipc)")
    return dict(zip(members, group_specs(len(members), _RENDEZVOUS_UNMADE)))


def nvshmem_members(launches) -> list[int]:
    """Indices of the engines that receive KV with nvshmem: the deployment's NVSHMEM group."""
    return [i for i, launch in enumerate(launches) if launch.config.kv_transfer == "nvshmem"]


def with_nvshmem_group(launches: list[EngineLaunch], rendezvous: str) -> list[EngineLaunch]:
    """The engines receiving with nvshmem, each with its place in the deployment's NVSHMEM
    group (rank in the file's order, the group's size, `rendezvous`) in its environment."""
    members = nvshmem_members(launches)
    specs = dict(zip(members, group_specs(len(members), rendezvous)))
    return [replace(launch, env={**launch.env, GROUP_ENV: str(specs[i])},
                    config=replace(launch.config, nvshmem_group=str(specs[i])))
            if i in specs else launch for i, launch in enumerate(launches)]


def with_cpu_threads(launches: tuple[EngineLaunch, ...]) -> list[EngineLaunch]:
    """The engines of one host split its cores for torch's intra-op threads (each gets cores
    // engines, at least one) unless their args say --cpu-threads: engines that each spin
    threads on every core slow each other down about tenfold. GPU engines too: their host
    work (packing LoRA adapters, for one) ran ~1,300 small parallel ops an adapter, and two
    engines of 32 threads each on a 32-core host took 10 s an adapter at start-up (2026-11-27,
    two H200s)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, len(launches)))
    return [replace(launch, args=(*launch.args, "--cpu-threads", str(threads)),
                    config=replace(launch.config, cpu_threads=threads))
            if launch.config.cpu_threads is None else launch for launch in launches]
