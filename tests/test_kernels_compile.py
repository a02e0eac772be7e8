"""The GPU path's Triton kernels (GEMV, few-rows, LoRA, attention, norm and rope, fp8 quantization,
argmax, the KV page copy) compiled for an H100 (sm_90) on a machine without a GPU, with
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


def compile_for_h100(kernel, types: dict | None = None, divisible: tuple[str, ...] = (),
                     **constexprs) -> None:  # fmt: skip
    """Compile `kernel` (a triton.jit function) with `constexprs` (num_warps and num_stages,
    if among them, are launch options); every other argument a bf16 pointer (`*_ptr`), an
    i32, or as `types` (then _TYPES) says. `divisible`: arguments known to be multiples of 16
    (as the JIT specializes aligned pointers and sizes at run time, which lets the pipeliner
    stage loads through shared memory)."""
    options = {key: constexprs.pop(key) for key in ("num_warps", "num_stages")
               if key in constexprs}
    types = {**_TYPES, **(types or {})}
    signature = {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        else:
            signature[param.name] = types.get(
                param.name, "*bf16" if param.name.endswith("_ptr") else "i32")
    names = [p.name for p in kernel.params]
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexprs missing: {missing}"
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    triton.compile(source, target=H100, options=options or None)


def compile_all() -> None:
    from engine.kernels import argmax, fused, one_shot, quant
    from engine.kernels import paged_attention as pa
    from engine.kernels.fp8_format import FP8_MAX, INV_FP8_MAX, MIN_AMAX
    from engine.kernels import few_rows
    from engine.kernels.gemv import _gemv_kernel
    from engine.lora import kernels as k
    from kvcache.transfer import page_copy

    fp8 = dict(FP8_MAX=FP8_MAX, INV_FP8_MAX=INV_FP8_MAX, MIN_AMAX=MIN_AMAX)
    scales = {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "row_scale_ptr": "*fp32",
              "col_scale_ptr": "*fp32"}
    for quantized, peer in ((False, False), (True, False), (False, True)):
        compile_for_h100(fused._rms_norm_kernel, scales, HAS_RESIDUAL=True, SCALED=False,
                         BLOCK=4096, NUM_CHUNKS=1, QUANT=quantized, HAS_PEER=peer, PDL=True,
                         **fp8)
    compile_for_h100(quant._quant_fp8_kernel, scales, GATED=True, BLOCK=2048, NUM_CHUNKS=7,
                     EVEN=True, PDL=True, **fp8)
    compile_for_h100(fused._silu_and_mul_kernel, BLOCK=1024, PDL=True)
    indices = {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i64",
               "table_ptr": "*i32", "kv_lens_ptr": "*i32", "cu_seqlens_ptr": "*i32",
               "ws_ptr": "*fp32", "qk_scale": "fp32"}
    compile_for_h100(fused._rope_store_kv_kernel, indices, NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64,
                     BLOCK_HEADS=32, BLOCK_KV_HEADS=8, BLOCK_HALF=64, CACHE_FP8=False, PDL=True)
    attention = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_N=64, DOT_PRECISION="tf32",
                     FP16_DOTS=False)
    compile_for_h100(pa._decode_split_kernel, indices, GROUP_PAD=16, DIRECT_OUT=False, PDL=True,
                     **attention)
    compile_for_h100(pa._decode_merge_kernel, indices, HEAD_DIM=128, SPLITS_PAD=16, PDL=True)
    compile_for_h100(pa._extend_kernel, indices, BLOCK_M=64, **attention)
    logits = {"x_ptr": "*fp32", "max_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64"}
    compile_for_h100(argmax._chunk_max_kernel, logits, CHUNK=4096)
    compile_for_h100(argmax._row_argmax_kernel, logits, BLOCK=32)
    sums = {"buf_deltas_ptr": "*i64", "flag_ptr": "*i64", "flag_deltas_ptr": "*i64",
            "counters_ptr": "*i64", "timeout_ns": "i64"}
    compile_for_h100(one_shot._one_shot_kernel, sums, WORLD=2, BLOCK=one_shot.BLOCK, PDL=True)
    compile_for_h100(page_copy._copy_rows_kernel,
                     {"src_slots_ptr": "*i64", "dst_slots_ptr": "*i64"},
                     NUM_PROGRAMS=132, ROWS=8, BLOCK=1024)

    for lora in (False, True):
        for form in ("plain", "gated", "norm"):
            compile_for_h100(_gemv_kernel, GATED=form == "gated", NORM=form == "norm",
                             HAS_RES=form == "norm", SCALED=False, LORA=lora, PDL=True,
                             BLOCK_N=2, BLOCK_K=4096, EVEN_N=True, EVEN_K=True)
    aligned = ("x_ptr", "w_ptr", "out_ptr", "K", "N", "k_per_split", "stride_xm", "stride_wn",
               "stride_os", "stride_om")  # Llama-3.1-8B's shapes: staged loads, wgmma
    for even, stages in ((True, 3), (False, 4)):  # in bf16, as on the GPU (the CPU tests: fp16)
        compile_for_h100(few_rows._few_rows_kernel, divisible=aligned if even else (),
                         BLOCK_M=few_rows.MAX_ROWS, BLOCK_N=64, BLOCK_K=128, EVEN_K=even,
                         num_stages=stages)
    compile_for_h100(few_rows._sum_splits_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16"},
                     SPLITS=4, BLOCK=1024)

    compile_for_h100(k._bgmv_shrink_kernel, MODE=0, BLOCK_N=64, BLOCK_K=128, PDL=True)
    compile_for_h100(k._bgmv_expand_kernel, SLICES=3, SPLITS=16, NORM=False, BLOCK_N=128,
                     BLOCK_R=16, PDL=True)
    compile_for_h100(k._shrink_kernel, MODE=1, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64,
                     DOT_PRECISION="tf32", PDL=True)
    for cache in ("*bf16", "*fp8e4nv"):
        compile_for_h100(k._qkv_delta_rope_store_kernel,
                         {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
                          "slot_mapping_ptr": "*i64", "k_cache_ptr": cache, "v_cache_ptr": cache},
                         NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_R=16,
                         CACHE_FP8=cache == "*fp8e4nv", PDL=True)
    for slices, norm in ((3, True), (2, False), (1, False)):
        compile_for_h100(k._expand_kernel, SLICES=slices, SPLITS=8, NORM=norm, BLOCK_M=32,
                         BLOCK_N=64, BLOCK_R=16, COL_BLOCKS=4, DOT_PRECISION="tf32", PDL=True)


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
