"""The float8 e4m3 format's numbers, shared by the fp8 kernels (quant.py, fused.py), the fp8
weights (engine/models/fp8.py) and the fp8 KV cache: here so that the kernels need not import
the model code that calls them."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# scale = amax * (1 / 448): a product rounds the same in torch (CPU and CUDA) and Triton, while
# torch on CUDA divides by a Python number as a product with its reciprocal anyway
INV_FP8_MAX = 1.0 / FP8_MAX
# a row of zeros (a padded token in a CUDA graph) quantizes to zeros, not NaN
MIN_AMAX = 1e-12
