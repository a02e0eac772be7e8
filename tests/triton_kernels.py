"""Triton kernel modules for tests: compiled on CUDA, run by the Triton interpreter on CPU.

    from triton_kernels import DEVICE, INTERPRET, load
    gemv_mod = load("engine.kernels.gemv")

TRITON_INTERPRET=1 is read when `triton.jit` decorates a kernel (triton's own helpers too, at
`import triton`) and again when it runs, so without CUDA it is set when this module is first
imported, which must come before triton's, and stays set for the session; a kernel module that
an earlier test imported before that (compiled) is reloaded.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def load(name: str) -> ModuleType:
    """Import `name`; under the interpreter, reload it if its kernels were decorated compiled."""
    from triton.runtime.jit import JITFunction

    module = importlib.import_module(name)
    compiled = any(isinstance(v, JITFunction) for v in vars(module).values())
    return importlib.reload(module) if INTERPRET and compiled else module
