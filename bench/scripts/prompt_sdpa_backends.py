"""Whole prompts' attention on one GPU: our paged extend kernel against torch SDPA per prompt
(engine/attention/triton_backend.py, `--prompt-attention sdpa`), SDPA's default backend and
each forced, at Llama-3.1-8B's heads (32 / 8 KV, head_dim 128, bf16), over K/V views of a qkv
buffer as the engine passes them. Prints microseconds per layer and TFLOP/s.

    python bench/scripts/prompt_sdpa_backends.py
"""

from __future__ import annotations

import contextlib

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.triton_backend import _causal_sdpa
from engine.kernels.paged_attention import paged_extend_attention

H, KVH, D, PS = 32, 8, 128, 16


def case(lens: list[int]) -> None:
    t = sum(lens)
    qkv = torch.randn(t, (H + 2 * KVH) * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(t, -1, D) for x in qkv.split([H * D, KVH * D, KVH * D], -1))
    pages = sum(-(-n // PS) for n in lens)
    cache = torch.zeros(2, pages, PS, KVH, D, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(len(lens), max(-(-n // PS) for n in lens), dtype=torch.int32,
                        device="cuda")
    cu, first, row = [0], 0, 0
    for s, n in enumerate(lens):
        np_ = -(-n // PS)
        table[s, :np_] = torch.arange(first, first + np_)
        flat = cache[:, first : first + np_].reshape(2, -1, KVH, D)
        flat[0, :n], flat[1, :n] = k[row : row + n], v[row : row + n]
        first, row = first + np_, row + n
        cu.append(row)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    flops = sum(4 * H * D * n * (n + 1) // 2 for n in lens)

    def paged():
        paged_extend_attention(q, cache[0], cache[1], table, cu_t, lens_t, max(lens), D**-0.5, out)

    def dense():
        for a, b in zip(cu, cu[1:]):
            out[a:b] = _causal_sdpa(q[a:b], k[a:b], v[a:b], D**-0.5)

    paged()
    ref = out.clone()
    runs = [("paged extend", paged, None), ("sdpa default", dense, None)]
    runs += [(f"sdpa {b.name.lower()}", dense, b) for b in (
        SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
    for name, fn, backend in runs:
        try:
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        except RuntimeError as e:
            print(f"{lens}: {name}: {str(e)[:120]}")
            continue
        print(f"{str(lens):>16} {name:>18}: {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
              f"err {err:.1e}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    for lens in ([4096, 4096], [1024], [1024, 1024], [16384], [512] * 8):
        case(lens)
