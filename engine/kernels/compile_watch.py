"""Name every Triton kernel compiled after warm-up.

A Triton kernel compiles on its first launch with a new specialization (its constexprs, and
which integer arguments equal 1 or are multiples of 16); on an H100 that stalls the step that
launches it by ~0.1–1 s. Warm-up (engine/core/warmup.py) serves requests of the shapes a server
meets so the compiles happen before the first real request; a compile after it means warm-up
missed a shape. `CompileWatch` counts each one and logs the kernel with its specialization,
so an operator (and `bench.peers`' TTFT p99) sees which.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

log = logging.getLogger("engine.kernels")


class CompileWatch:
    """Counts Triton's in-process compile-cache misses from `start` on (Triton's
    `jit_cache_hook`) and logs each; `compiles` is the count. One per process (`COMPILES`): an
    engine core reads the count when its warm-up ends."""

    def __init__(self):
        self.compiles = 0
        self._installed = False
        self._starting = 0  # engines of this process starting now (`starting`)

    @contextmanager
    def starting(self):
        """Around an engine's start-up (graph capture, warm-up): compiles then are not
        counted, even where another engine of the process already installed the hook (two
        engines in one bench logged the second one's captures as ~40 misses of warm-up)."""
        self._starting += 1
        try:
            yield
        finally:
            self._starting -= 1

    def start(self) -> bool:
        """Install the hook (once per process; another hook already there is kept). False
        where this Triton has no such hook."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        if runtime.jit_cache_hook is None:
            runtime.jit_cache_hook = self._hook
        self._installed = runtime.jit_cache_hook == self._hook
        return self._installed

    def stop(self) -> None:
        if self._installed:
            from triton import knobs

            if knobs.runtime.jit_cache_hook == self._hook:
                knobs.runtime.jit_cache_hook = None
            self._installed = False

    def _hook(self, *args, **kwargs) -> bool:
        if self._starting:
            return False  # an engine's start-up compiles: compile as usual, unwatched
        self.compiles += 1
        log.warning("Triton compiled %s after warm-up: warm-up missed this shape, and the step "
                    "that launched it waited for the compile", _describe(kwargs))
        return False  # compile as usual


def _describe(hook_kwargs: dict) -> str:
    """The kernel's name with what made this variant: its constexprs and the arguments Triton
    specialized (e.g. `n: tt.divisibility=16`, a multiple of 16), as Triton's hook passes
    them; Triton's own `repr` where they are not in the form Triton 3.6 gives."""
    try:
        fn, compile = hook_kwargs["fn"], hook_kwargs["compile"]
        names = list(compile["signature"])

        def name(key) -> str:  # Triton keys arguments by (index,)
            index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
            return names[index] if isinstance(index, int) and index < len(names) else str(index)

        constants = ", ".join(f"{name(k)}={v}" for k, v in compile["constants"].items())
        attrs = (compile.get("configs") or [{}])[0]
        special = ", ".join(f"{name(k)}: " + " ".join(f"{a[0]}={a[1]}" for a in v)
                            for k, v in attrs.items() if v)
        return f"{fn.module}.{fn.name} ({constants or 'no constexprs'}; {special or 'none'})"
    except (KeyError, AttributeError, TypeError, IndexError):
        return str(hook_kwargs.get("repr", "a Triton kernel"))


COMPILES = CompileWatch()
