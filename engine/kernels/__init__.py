"""Triton GPU kernels. Import them from their modules (this package imports no triton):

- `engine.kernels.paged_attention`: paged decode (split-KV flash-decoding) and prefill/extend
  attention over the KV layout of `kvcache.paged` (DESIGN §5–§6).
"""
