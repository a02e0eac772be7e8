"""engine/kernels/host_pages.py's copy between the GPU pool's layout and the host pool's, under
Triton's interpreter on CPU (and on a GPU with the `gpu` marker): every fragment lands in its
place, byte-equal, and nothing else is written."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.host_pages import BLOCK, copy_host_pages

# [layers, K|V, pages, page_size, kv_heads, head_dim]: a fragment of 2 * 8 * 512 values is two
# and a half of the kernel's blocks
LAYERS, POOL_PAGES, FRAGMENT = 3, 6, (2, 8, BLOCK // 16 + BLOCK // 64)


def pools(device: str, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    gpu = torch.randn((LAYERS, 2, POOL_PAGES, *FRAGMENT), generator=gen).to(dtype)
    host = torch.randn((4, LAYERS, 2, *FRAGMENT), generator=gen).to(dtype)
    if device == "cuda":
        return gpu.to(device), host.pin_memory()
    return gpu, host


def check(device: str, dtype=torch.bfloat16) -> None:
    gpu, host = pools(device, dtype)
    gpu_before, host_before = gpu.clone(), host.clone()
    ids = lambda xs: torch.tensor(xs, dtype=torch.long, device=gpu.device)  # noqa: E731
    copy_host_pages(gpu, host, ids([[4, 0], [2, 1]]), to_host=True, num_programs=5)
    if device == "cuda":
        torch.cuda.synchronize()
    want = host_before.clone()
    want[2], want[1] = gpu_before[:, :, 4].cpu(), gpu_before[:, :, 0].cpu()
    assert torch.equal(host.view(torch.uint8), want.view(torch.uint8))  # byte-equal
    assert torch.equal(gpu.view(torch.uint8), gpu_before.view(torch.uint8))  # only read

    copy_host_pages(gpu, host, ids([[5, 3, 1], [1, 3, 2]]), to_host=False, num_programs=2)
    if device == "cuda":
        torch.cuda.synchronize()
    want_gpu = gpu_before.clone()
    for g, h in ((5, 1), (3, 3), (1, 2)):
        want_gpu[:, :, g] = want[h].to(gpu.device)
    assert torch.equal(gpu.view(torch.uint8), want_gpu.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_fragments_land_in_place_both_ways(dtype):
    check("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fragments_land_in_place_both_ways_on_cuda(dtype):
    check("cuda", dtype)


def test_refuses_pools_that_do_not_match():
    gpu, host = pools("cpu")
    one = torch.zeros((2, 1), dtype=torch.long)
    with pytest.raises(ValueError, match="pools differ"):
        copy_host_pages(gpu, host[:, :2], one, to_host=True)
    with pytest.raises(ValueError, match=r"\[2, n\] int64 tensor .* got torch.int64 \(3, 1\)"):
        copy_host_pages(gpu, host, torch.zeros((3, 1), dtype=torch.long), to_host=True)
    with pytest.raises(ValueError, match="torch.int32"):
        copy_host_pages(gpu, host, one.int(), to_host=True)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.cat([gpu, gpu], dim=-1)[..., ::2]  # the same shape, strided
        copy_host_pages(strided, host, one, to_host=True)
