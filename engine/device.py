"""Host -> device copies that never make the host wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, which CUDA performs
synchronously: the host blocks until the stream has drained everything queued before the copy.
On the step path that would cancel async scheduling (the host preparing step N+1 while the GPU
runs step N). Staging through pinned memory makes the copy an ordinary queued operation.
"""

from __future__ import annotations

import functools

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (a list, possibly nested) on `device`, without a host sync."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@functools.cache
def _gpu_properties(index: int):
    return torch.cuda.get_device_properties(index)


def gpu_of(t: torch.Tensor):
    """The properties (name, SM count, ...) of the GPU holding t, asked once per GPU; None off
    CUDA. Kernel wrappers read them to pick launch parameters, also while a graph captures."""
    if not t.is_cuda:
        return None
    return _gpu_properties(torch.cuda.current_device() if t.device.index is None
                           else t.device.index)
