"""Programmatic dependent launch (PDL, sm_90+) for the decode-path kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still
running: its programs get scheduled, do what does not depend on that kernel (index math, a
weight tile), then `gdc_wait()` blocks until the previous kernel has finished and its writes
are visible. Every kernel here that takes the flag waits before touching data another kernel
wrote, so each one also finishes after all the kernels before it: ordering stays as strict as
a plain stream. `gdc_launch_dependents()` lets the next kernel start early. In a batch-1
decode step (~300 short kernels) this hides most of each launch gap (measured on an H100,
2026-11-23: see docs/benchmarks.md).

Off under the Triton interpreter and below sm_90; an engine with `EngineConfig.pdl` False
turns it off for its process (`configure`, called by the model runner; `python -m
bench.engine_gpu --no-pdl`). A kernel takes a `PDL: tl.constexpr` and starts with
`if PDL: gdc_wait(); gdc_launch_dependents()` (inline: a @triton.jit helper shared across
modules breaks the CPU interpreter's reloads in the tests).
"""

from __future__ import annotations

import functools
import os

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_enabled = True  # set by configure() only


def configure(enabled: bool) -> None:
    """Whether this process's kernels launch with PDL where the GPU has it: an engine's
    `EngineConfig.pdl`, set by its model runner (an engine owns its process, as it owns torch's
    BLAS choice)."""
    global _enabled
    _enabled = enabled


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on t launch with PDL."""
    if not (_enabled and t.is_cuda) or _INTERPRETED:
        return False
    index = t.device.index
    return _supported(torch.cuda.current_device() if index is None else index)


def launch_options(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}

