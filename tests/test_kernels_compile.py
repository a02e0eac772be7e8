"""The GPU path's Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, with
the ptxas the Triton wheel ships: the Triton interpreter (the CPU tests' way of running them)
accepts code the compiler refuses, such as a variable first assigned in a runtime branch and
read after it (a device call was lost to that on 2026-11-27). Compiling is enough: nothing
runs. The compiles run in a child process: this session's kernels are the interpreter's
(TRITON_INTERPRET=1 is read when a kernel is decorated). Skipped where this Triton has no CUDA
backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - another Triton layout
    pytest.skip("this Triton cannot compile ahead of time", allow_module_level=True)

H100 = GPUTarget("cuda", 90, 32)
_TYPES = {"part_ptr": "*fp32", "ws_ptr": "*fp32", "norm_ptr": "*bf16", "slot_ptr": "*i32",
          "slots_ptr": "*i32", "rows_ptr": "*i32", "tiles_ptr": "*i32", "eps": "fp32"}


def compile_for_h100(kernel, **constexprs) -> None:
    """Compile `kernel` (a triton.jit function) with `constexprs`; every other argument a
    bf16 pointer (`*_ptr`), an i32, or as _TYPES says."""
    signature = {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        else:
            signature[param.name] = _TYPES.get(
                param.name, "*bf16" if param.name.endswith("_ptr") else "i32")
    names = [p.name for p in kernel.params]
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexprs missing: {missing}"
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    triton.compile(source, target=H100)


def compile_all() -> None:
    from engine.kernels.gemv import _gemv_kernel
    from engine.lora import kernels as k

    for lora in (False, True):
        for form in ("plain", "gated", "norm"):
            compile_for_h100(_gemv_kernel, GATED=form == "gated", NORM=form == "norm",
                             HAS_RES=form == "norm", SCALED=False, LORA=lora, PDL=True,
                             BLOCK_N=2, BLOCK_K=4096, EVEN_N=True, EVEN_K=True)

    compile_for_h100(k._bgmv_shrink_kernel, MODE=0, BLOCK_N=64, BLOCK_K=128, PDL=True)
    compile_for_h100(k._bgmv_expand_kernel, SLICES=3, SPLITS=16, NORM=False, BLOCK_N=128,
                     BLOCK_R=16, PDL=True)
    compile_for_h100(k._shrink_kernel, MODE=1, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64,
                     DOT_PRECISION="tf32", PDL=True)
    compile_for_h100(k._expand_kernel, SLICES=3, SPLITS=8, NORM=True, BLOCK_M=32, BLOCK_N=64,
                     BLOCK_R=16, DOT_PRECISION="tf32", PDL=True)


def test_gpu_kernels_compile_for_h100(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-4000:]


if __name__ == "__main__":
    try:
        from triton.backends import backends
        if "nvidia" not in backends:
            raise ImportError("no nvidia backend")
    except ImportError as e:
        print(f"no sm_90 toolchain in this Triton: {e}")
        sys.exit(3)
    compile_all()
