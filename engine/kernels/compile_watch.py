"""Name every Triton kernel compiled after warm-up.

A Triton kernel compiles on its first launch with a new specialization (its constexprs, and
which integer arguments equal 1 or are multiples of 16); on an H100 that stalls the step that
launches it by ~0.1–1 s. Warm-up (engine/core/warmup.py) serves requests of the shapes a server
meets so the compiles happen before the first real request; a compile after it means warm-up
missed a shape. `watch` counts each one and logs the kernel with its specialization, so an
operator (and `bench.peers`' TTFT p99) sees which.
"""

from __future__ import annotations

import logging

log = logging.getLogger("engine.kernels")


class CompileWatch:
    """Counts Triton's in-process compile-cache misses from `start` on (Triton's
    `jit_cache_hook`); `compiles` is the count, `kernels` the last few names. One per process
    (`COMPILES`): an engine core reads the count when its warm-up ends."""

    KEEP = 16

    def __init__(self):
        self.compiles = 0
        self.kernels: list[str] = []
        self._installed = False

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
        name = kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "a Triton kernel")
        self.compiles += 1
        self.kernels = (self.kernels + [name])[-self.KEEP:]
        log.warning("Triton compiled %s after warm-up: warm-up missed this shape, and the step "
                    "that launched it waited for the compile", name)
        return False  # compile as usual


COMPILES = CompileWatch()
