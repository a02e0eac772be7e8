"""Sweep the paged-attention launches over an fp8 KV cache (GPU): how `decode_config` and
`extend_config` chose their fp8 defaults.

    python bench/scripts/fp8_kv_tiles.py

Llama-3.1-8B's attention shapes (32 query / 8 KV heads, head_dim 128, bf16 q): the extend
kernel over 8 prompts of 4,096 tokens, the decode kernel over 128 sequences at context 1,024,
each launch timed over CUDA events (tests/test_triton_attention.py's cases and timer).
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_triton_attention import L8B, PagedCase, _time_ms, pa  # noqa: E402

FP8 = torch.float8_e4m3fn


def sweep(name, run, configs, iters):
    results = []
    for cfg in configs:
        try:
            ms = _time_ms(lambda: run(cfg), iters)
        except Exception as e:  # a launch the compiler refuses (too many registers, ...)
            print(f"{name} failed {cfg}: {str(e)[:80]}", flush=True)
            continue
        results.append((ms, cfg))
        print(f"{name} {ms * 1e3:9.1f} us  {cfg}", flush=True)
    results.sort(key=lambda r: r[0])
    print(f"best {name}:", *results[:5], sep="\n  ")


def main() -> None:
    ext = PagedCase([(0, 4096)] * 8, **L8B, kv_dtype=FP8)
    bf16 = PagedCase([(0, 4096)] * 8, **L8B)
    print(f"extend, bf16 cache, its default: {_time_ms(bf16.extend, 5) * 1e3:.1f} us")
    print(f"extend, fp8 cache, its default:  {_time_ms(ext.extend, 5) * 1e3:.1f} us")
    sweep("extend", lambda cfg: ext.extend(config=cfg), [
        pa.TileConfig(block_n=bn, num_warps=w, num_stages=st, block_m=bm, maxnreg=reg)
        for bm, bn, w, st, reg in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4),
                                                    (None, 128, 168))
        if not (bm == 64 and reg == 168)], iters=5)  # fmt: skip
    dec = PagedCase([(1023, 1)] * 128, **L8B, kv_dtype=FP8)
    out = torch.empty_like(dec.q)
    sweep("decode", lambda cfg: pa.paged_decode_attention(
        dec.q, dec.k_cache, dec.v_cache, dec.page_table, dec.kv_lens, dec.scale, out, None, 1,
        config=cfg), [pa.TileConfig(block_n=bn, num_warps=w, num_stages=st)
                      for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4, 5))],
        iters=20)  # fmt: skip


if __name__ == "__main__":
    main()
