"""FP8 projections against bf16 ones, per Llama-3.1-8B projection and token count (CUDA).

    python -m bench.fp8_sweep [--m 1,16,128,512,2048,8192] [--json out.json]

For each projection (qkv, o, gate_up, down) and each M, the time of:
- bf16: `torch.mm` (the engine's GEMM library, cuBLASLt);
- fp8 rowwise: the engine's W8A8 path (engine/models/fp8.py): the Triton per-token
  quantization of the input (gated for down) + `torch._scaled_mm` with per-token and
  per-channel scales, and each of the two alone;
- fp8 tensorwise: `torch._scaled_mm` with one scale each (cuBLASLt's fp8 GEMM), for scale,
  with bf16 out and with fp32 out (what o and down run at small M, their scales applied by the
  norm after them: engine/models/fp8.py);
- M <= 256: the rowwise GEMM with its operands swapped (y^T = W8 x8^T, then transposed);
- M = 1: the Triton GEMV over bf16 and over fp8 weights (the batch-1 decode path).
Weights rotate over copies larger than L2, so each call reads its weight from HBM as in a
step. Each figure is `--iters` calls captured in a CUDA graph, as the engine replays them,
timed over the replay (median of 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.kernels.gemv import gemv
from engine.kernels.quant import quantize_fp8
from engine.models.fp8 import Fp8Linear
from engine.model_runner import set_blas_library

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time(fn, iters: int) -> float:
    """Microseconds a call of fn() takes on the GPU: `iters` calls captured in one CUDA graph
    (so launches cost what they cost in the engine's graphs), the median of 5 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def sweep(ms: list[int], iters: int) -> dict:
    results = {}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-4 * l2 // (n * k * 2)))
        linears = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                   for _ in range(copies)]  # fmt: skip
        projs = [Fp8Linear.from_linear(lin) for lin in linears]
        for p in projs:
            p.use_triton = True
        ones = torch.ones((), device="cuda")
        in_k = 2 * k if name == "down" else k
        gated = name == "down"
        for m in ms:
            x = torch.randn(m, in_k, device="cuda", dtype=torch.bfloat16)
            plain = x[:, :k].contiguous() if gated else x
            i = iter(range(10**9))
            row = {}
            row["bf16_us"] = _time(lambda: torch.mm(plain, linears[next(i) % copies].weight.t()),
                                   iters)  # fmt: skip
            x8, sx = quantize_fp8(x, gated=gated)
            row["fp8_quant_us"] = _time(lambda: quantize_fp8(x, gated=gated), iters)
            row["fp8_rowwise_mm_us"] = _time(lambda: projs[next(i) % copies].matmul(x8, sx), iters)
            row["fp8_rowwise_us"] = _time(lambda: projs[next(i) % copies](x, gated=gated), iters)
            row["fp8_tensorwise_mm_us"] = _time(lambda: torch._scaled_mm(
                x8, projs[next(i) % copies].weight.t(), scale_a=ones, scale_b=ones,
                out_dtype=torch.bfloat16), iters)  # fmt: skip
            row["fp8_tensorwise_f32_mm_us"] = _time(lambda: torch._scaled_mm(
                x8, projs[next(i) % copies].weight.t(), scale_a=ones, scale_b=ones,
                out_dtype=torch.float32), iters)  # fmt: skip
            if m <= 256:  # swapped operands: y^T = W8 x8^T, scales swapped, then transposed
                proj = projs[0]
                row["fp8_rowwise_swapped_mm_us"] = _time(lambda: torch._scaled_mm(
                    proj.weight, x8.t(), scale_a=proj.weight_scale.view(-1, 1),
                    scale_b=sx.view(1, -1), out_dtype=torch.bfloat16).t().contiguous(),
                    iters)  # fmt: skip
            if m == 1:
                row["gemv_bf16_us"] = _time(lambda: gemv(x, linears[next(i) % copies].weight,
                                                         gated=gated), iters)  # fmt: skip
                row["gemv_fp8_us"] = _time(lambda: gemv(
                    x, projs[next(i) % copies].weight, gated=gated,
                    scale=projs[next(i) % copies].weight_scale), iters)  # fmt: skip
            flops = 2 * m * n * k
            row["bf16_tflops"] = flops / row["bf16_us"] / 1e6
            row["fp8_rowwise_tflops"] = flops / row["fp8_rowwise_us"] / 1e6
            results[f"{name} m={m}"] = row
            print(name, m, json.dumps({key: round(v, 1) for key, v in row.items()}), flush=True)
        linears = projs = None  # free them before the next shape
        torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--m", default="1,16,128,512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    set_blas_library("cublaslt")  # the engine's choice on CUDA
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__,
           "sweep": sweep([int(m) for m in args.m.split(",")], args.iters)}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
