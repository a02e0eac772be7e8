"""Triton GPU kernels. Import them from their modules (this package imports no triton):

- `engine.kernels.paged_attention`: paged decode (split-KV flash-decoding) and prefill/extend
  attention over the KV layout of `kvcache.paged` (docs/gpu.md).
- `engine.kernels.fused`: add + RMSNorm, RoPE + KV-cache write, SiLU·mul.
- `engine.kernels.gemv`: one-row projections (batch-1 decode), with RMSNorm or SiLU·mul folded in.
- `engine.kernels.pdl`: programmatic dependent launch for the decode-path kernels.
"""
