"""The strategy host: loads strategy modules, swaps them while traffic flows, tracks who runs where.

    host = StrategyHost(pool)
    await host.load(StrategySource.builtin("pd"))                         # strategies/pd.py
    await host.load(StrategySource.file("/srv/my_strategy.py"), args={"ratio": 0.2})
    await host.load(StrategySource.upload(code, "upload.py"), class_name="Mine")

Each load executes the module's source in a fresh module namespace (so a file edited since the
last load is read anew, and two versions of one module never share globals), finds the Strategy
subclass it defines (or `class_name`), builds it with `args`, awaits its `start(engines)`, and
only then makes it the active instance: one assignment, so a request sees either the old
instance or the new one, never a half-loaded one. A module that fails to compile, import, build
or start raises StrategyLoadError and the active instance stays as it was.

Requests hold their instance from start to end (`acquire`/`release`): a swapped-out instance
is told at once (`retire()`), finishes the requests it has, then its `stop()` runs. Loads are
serialized; a load while another is in progress raises SwapInProgress (a 409 in the admin API)
rather than queueing behind it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import stat
import sys
import time
import traceback
import types
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import strategies
from microserve.metrics import Registry
from microserve.backend import Client
from router.arm_stats import Slo
from router.arms import Arm, Experiment
from router.engines import EnginePool
from router.strategy import Strategy

log = logging.getLogger("microserve.router")

BUILTIN_DIR = Path(strategies.__file__).parent
MODULE_PREFIX = "microserve_strategy_v"  # + version: each load's module name in sys.modules
HISTORY = 16  # loads GET /admin/strategy lists, with their request counts
MAX_SOURCE_BYTES = 1 << 20  # a strategy is tens of lines; refuse reading anything huge


class StrategyLoadError(ValueError):
    """The module did not compile, import, define one Strategy, construct or start (a 400)."""


class SwapInProgress(RuntimeError):
    """Another load is running (a 409)."""


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.py") if not p.stem.startswith("_"))


@dataclass(frozen=True)
class StrategySource:
    """Where a strategy's code comes from: `origin` is what GET /admin/strategy shows, `path`
    the file to read (and watch), or `code` the uploaded text."""

    origin: str
    path: Path | None = None
    code: str | None = None

    @classmethod
    def builtin(cls, name: str) -> StrategySource:
        if name not in builtin_names():
            raise StrategyLoadError(f"no built-in strategy {name!r} (built-in: "
                                    f"{', '.join(builtin_names())})")
        return cls(f"builtin:{name}", path=BUILTIN_DIR / f"{name}.py")

    @classmethod
    def file(cls, path: str | Path, root: Path | None = None) -> StrategySource:
        """A .py file. With `root` (the admin API's strategies directory), a relative `path` is
        taken inside it and the file, symlinks resolved, must lie in it: the same refusal
        whether or not such a file exists, before anything is read."""
        if "\x00" in str(path):  # no file has such a name; resolve() would raise ValueError
            raise StrategyLoadError(f"strategy path {str(path)!r} contains a NUL character")
        given = Path(path)
        if root is not None:
            root = root.resolve()
            resolved = (root / given).resolve()
            if not resolved.is_relative_to(root):
                raise StrategyLoadError(f"strategy path {str(path)!r} is outside the strategies "
                                        f"directory {root}")
        else:
            resolved = given.resolve()
        if resolved.suffix != ".py":
            raise StrategyLoadError(f"strategy path {str(path)!r} does not name a .py file")
        return cls(f"file:{resolved}", path=resolved)

    @classmethod
    def upload(cls, code: str, filename: str = "upload.py") -> StrategySource:
        return cls(f"upload:{filename}", code=code)

    @classmethod
    def parse(cls, spec: str) -> StrategySource:
        """A command-line value: a built-in name ('pd') or a path to a .py file."""
        if spec.endswith(".py") or "/" in spec:
            return cls.file(spec)
        return cls.builtin(spec)

    def read(self) -> tuple[str, str]:
        """(source text, file name for tracebacks). A file is read only if it is a regular
        file of at most MAX_SOURCE_BYTES (a FIFO or a device would block or never end);
        errors name the file and why, never what it holds. Blocking: run it in a thread."""
        if self.code is not None:
            return self.code, f"<{self.origin}>"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise StrategyLoadError(f"cannot read strategy file {self.path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StrategyLoadError(f"strategy file {self.path} is not a regular file")
            if st.st_size > MAX_SOURCE_BYTES:
                raise StrategyLoadError(f"strategy file {self.path} has {st.st_size} bytes, "
                                        f"more than the {MAX_SOURCE_BYTES} a strategy may have")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_SOURCE_BYTES + 1)
        except OSError as e:
            raise StrategyLoadError(f"cannot read strategy file {self.path}: {e.strerror}") from e
        finally:
            os.close(fd)
        try:
            return data.decode(), str(self.path)
        except UnicodeDecodeError:
            raise StrategyLoadError(f"strategy file {self.path} is not UTF-8 text") from None

    def mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime if self.path is not None else None
        except OSError:
            return None


@dataclass(eq=False)
class LoadedStrategy:
    """One loaded instance and its accounting (written by the host only)."""

    instance: Strategy
    version: int
    source: StrategySource
    args: dict
    module: str  # its module's name in sys.modules
    mtime: float | None  # of its file when loaded
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0
    started: int = 0
    finished: int = 0  # ended with a finish reason
    failed: int = 0  # ended any other way: error, abort, client gone
    retired: bool = False
    arm: Arm | None = None  # the A/B arm it serves, if it is one

    @property
    def name(self) -> str:
        return type(self.instance).__name__

    def describe(self) -> dict:
        return {"version": self.version, "class": self.name, "source": self.source.origin,
                "args": self.args, "loaded_at": self.loaded_at, "inflight": self.inflight,
                "started": self.started, "finished": self.finished, "failed": self.failed,
                "settings": self.instance.describe(),
                **({"arm": self.arm.name} if self.arm is not None else {})}


@dataclass(frozen=True)
class ArmSpec:
    """One arm of a PUT: its name, strategy and weight."""

    name: str
    source: StrategySource
    args: dict
    class_name: str | None
    weight: float


class StrategyHost:
    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.active: LoadedStrategy | None = None  # None while an experiment runs
        self.experiment: Experiment | None = None  # A/B arms (router/arms.py)
        self.retired: list[LoadedStrategy] = []  # swapped out, requests still running
        self.history: deque[LoadedStrategy] = deque(maxlen=HISTORY)  # the last loads, active last
        self._versions = itertools.count(1)
        self._loading = asyncio.Lock()
        self._stopping: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        self.failed_loads = 0

    # -- loading --------------------------------------------------------------------------------

    async def load(self, source: StrategySource, args: dict | None = None,
                   class_name: str | None = None) -> LoadedStrategy:
        """Load, build and start a strategy, then make it the active one.

        Raises:
            SwapInProgress: another load has not finished.
            StrategyLoadError: it failed; the active strategy is unchanged.
        """
        if self._loading.locked():
            raise SwapInProgress("a strategy load is already in progress; retry when it is done")
        async with self._loading:
            try:
                loaded = await self._build(source, dict(args or {}), class_name)
            except StrategyLoadError:
                self.failed_loads += 1
                raise
            old, self.active = self.active, loaded
            self.history.append(loaded)
            log.info("strategy v%d active: %s from %s, args %s", loaded.version, loaded.name,
                     source.origin, loaded.args)
            if old is not None:
                self._retire(old)
            if self.experiment is not None:  # a single strategy ends the experiment
                log.info("A/B experiment ended: arms %s retired",
                         [a.name for a in self.experiment.arms])
                for arm in self.experiment.arms:
                    self._retire(arm.loaded)
                self.experiment = None
            return loaded

    async def load_arms(self, specs: list[ArmSpec], sticky_by: str, slo: Slo) -> Experiment:
        """Serve `specs` as A/B arms (router/arms.py). An arm of the running experiment with
        the same name, source, arguments and class keeps its instance and numbers (only its
        weight changes); other arms are built and started; arms left out, and a single
        active strategy, are retired (their requests finish on them). Raises as `load`; a
        failed arm names itself, and nothing changes."""
        if self._loading.locked():
            raise SwapInProgress("a strategy load is already in progress; retry when it is done")
        async with self._loading:
            old = {a.name: a for a in self.experiment.arms} if self.experiment else {}
            arms, built = [], []
            try:
                for spec in specs:
                    arm = old.get(spec.name)
                    if arm is None or not _same(arm.loaded, spec):
                        loaded = await self._build(spec.source, dict(spec.args),
                                                   spec.class_name)
                        built.append(loaded)
                        arm = Arm(spec.name, spec.weight, loaded)
                        loaded.arm = arm
                    arm.weight, arm.slo = spec.weight, slo
                    arms.append(arm)
            except StrategyLoadError as e:
                self.failed_loads += 1
                for loaded in built:
                    await self._stop(loaded)
                raise StrategyLoadError(f"arm {spec.name!r}: {e}") from e
            kept = {id(a) for a in arms}
            for arm in old.values():
                if id(arm) not in kept:
                    self._retire(arm.loaded)
            if self.active is not None:
                self._retire(self.active)
                self.active = None
            self.history.extend(built)
            self.experiment = Experiment(arms, sticky_by, slo)
            log.info("A/B experiment: %s, sticky by %s", ", ".join(
                f"{a.name}={a.loaded.name} v{a.loaded.version} weight {a.weight:g}"
                for a in arms), sticky_by)
            return self.experiment

    def reweight(self, name: str, weight: float) -> Arm:
        """Change one arm's weight (0 stops it taking new requests). Raises KeyError for an
        unknown arm (or no experiment), ValueError if no arm would be left with weight."""
        arm = self.experiment.arm(name) if self.experiment else None
        if arm is None:
            raise KeyError(name)
        if weight + sum(a.weight for a in self.experiment.arms if a is not arm) <= 0:
            raise ValueError(f"weight {weight:g} for arm {name!r} would leave no arm with a "
                             "positive weight")
        log.info("A/B arm %s: weight %g -> %g", name, arm.weight, weight)
        arm.weight = weight
        return arm

    def _retire(self, loaded: LoadedStrategy) -> None:
        loaded.retired = True
        try:
            loaded.instance.retire()
        except Exception:
            log.exception("strategy v%d retire() failed", loaded.version)
        self.retired.append(loaded)
        self._stop_if_idle(loaded)

    async def _build(self, source: StrategySource, args: dict,
                     class_name: str | None) -> LoadedStrategy:
        code, filename = await asyncio.to_thread(source.read)
        version = next(self._versions)
        module = types.ModuleType(f"{MODULE_PREFIX}{version}")
        module.__file__ = filename
        # Registered while it runs: dataclasses and pickling look classes' modules up there.
        sys.modules[module.__name__] = module
        try:
            try:
                exec(compile(code, filename, "exec"), module.__dict__)
            except Exception as e:
                raise StrategyLoadError(f"strategy module {source.origin} failed to load: "
                                        f"{_brief(e)}") from e
            cls = _strategy_class(module, class_name, source.origin)
            try:
                instance = cls(**args)
            except Exception as e:
                raise StrategyLoadError(f"{cls.__name__}(**{args!r}) failed: {_brief(e)}") from e
            try:
                await instance.start(self.pool)
            except Exception as e:
                await _quietly(instance.stop())
                raise StrategyLoadError(f"{cls.__name__}.start() failed: {_brief(e)}") from e
        except StrategyLoadError:
            del sys.modules[module.__name__]
            raise
        return LoadedStrategy(instance, version, source, args, module.__name__, source.mtime())

    # -- requests -------------------------------------------------------------------------------

    def acquire(self, client: Client | None = None, request_id: str = "") -> LoadedStrategy:
        """The active strategy, or in an experiment the arm's strategy for this client and
        request, held by one more request until `release`."""
        if self.experiment is not None:
            loaded = self.experiment.choose(client, request_id).loaded
        else:
            loaded = self.active
        if loaded is None:
            raise RuntimeError("no strategy loaded")
        loaded.inflight += 1
        loaded.started += 1
        return loaded

    def release(self, loaded: LoadedStrategy, finished: bool) -> None:
        loaded.inflight -= 1
        if finished:
            loaded.finished += 1
        else:
            loaded.failed += 1
        if loaded.retired:
            self._stop_if_idle(loaded)

    def _stop_if_idle(self, loaded: LoadedStrategy) -> None:
        if loaded.inflight == 0 and loaded in self.retired:
            self.retired.remove(loaded)
            task = asyncio.get_running_loop().create_task(self._stop(loaded))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    @staticmethod
    async def _stop(loaded: LoadedStrategy) -> None:
        await _quietly(loaded.instance.stop(), f"strategy v{loaded.version} stop()")
        sys.modules.pop(loaded.module, None)
        log.info("strategy v%d (%s) stopped after its last request", loaded.version, loaded.name)

    # -- watching -------------------------------------------------------------------------------

    def watch(self, interval_s: float = 1.0) -> None:
        """Reload the active strategy (same args) whenever its file changes."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(interval_s))

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            loaded = self.active
            if loaded is None or loaded.source.path is None or self._loading.locked():
                continue
            mtime = loaded.source.mtime()
            if mtime is None or mtime == loaded.mtime:
                continue
            loaded.mtime = mtime  # one attempt per change, whether it loads or not
            try:
                await self.load(loaded.source, loaded.args, type(loaded.instance).__name__)
            except (StrategyLoadError, SwapInProgress) as e:
                log.error("strategy file %s changed but did not load; v%d stays: %s",
                          loaded.source.path, loaded.version, e)

    # -- shutdown -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop watching and stop every instance (call after the requests have ended)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        arms = [a.loaded for a in self.experiment.arms] if self.experiment else []
        for loaded in [*self.retired, *([self.active] if self.active else []), *arms]:
            await self._stop(loaded)
        self.retired.clear()
        self.active, self.experiment = None, None
        await asyncio.gather(*self._stopping, return_exceptions=True)

    def metrics_text(self) -> str:
        registry = Registry()
        version = registry.gauge("microserve_router_strategy_version",
                                 "Version of the active strategy (1 for the first load).",
                                 ["strategy"])
        if self.active is not None:
            version.set(self.active.version, strategy=self.active.name)
        registry.gauge("microserve_router_strategies_retired_running",
                       "Swapped-out strategy instances still finishing requests.",
                       ).set(len(self.retired))
        registry.counter("microserve_router_strategy_load_failures_total",
                         "Strategy loads that failed (the active one stayed).",
                         ).inc(self.failed_loads)
        return registry.render()

    def describe(self) -> dict:
        return {"active": self.active.describe() if self.active else None,
                "retired": [r.describe() for r in self.retired],
                "history": [h.describe() for h in self.history],
                "experiment": self.experiment.describe() if self.experiment else None,
                "builtin": builtin_names(), "failed_loads": self.failed_loads}


def _same(loaded: LoadedStrategy, spec: ArmSpec) -> bool:
    return (loaded.source == spec.source and loaded.args == spec.args
            and spec.class_name in (None, loaded.name))


def _strategy_class(module: types.ModuleType, class_name: str | None,
                    origin: str) -> type[Strategy]:
    """The Strategy subclass the module defines (or the one named `class_name`)."""
    if class_name is not None:
        cls = getattr(module, class_name, None)
        if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
            raise StrategyLoadError(f"{origin} has no Strategy subclass named {class_name!r}")
        return cls
    defined = [obj for obj in vars(module).values() if inspect.isclass(obj)
               and issubclass(obj, Strategy) and obj.__module__ == module.__name__
               and not inspect.isabstract(obj)]
    if len(defined) != 1:
        names = ", ".join(c.__name__ for c in defined) or "none"
        raise StrategyLoadError(f"{origin} must define exactly one Strategy subclass, or name "
                                f"one with 'class' (found: {names})")
    return defined[0]


def _brief(exc: BaseException) -> str:
    """The exception as one line, with where in the strategy's file it was raised."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{f.filename}, line {f.lineno}" for f in reversed(frames)
                  if not f.filename.endswith(("router/host.py",))), None)
    return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")


async def _quietly(work, what: str = "") -> None:
    try:
        await work
    except Exception:
        log.exception("%s failed", what or "strategy stop()")
