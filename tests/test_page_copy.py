"""The KV page-copy kernel (kvcache/transfer/page_copy.py) against torch indexing, to the bit:
compiled on CUDA, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
from triton_kernels import DEVICE, load

page_copy = load("kvcache.transfer.page_copy")


def pool(pages: int, page_size: int, heads: int, dim: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, pages, page_size, heads, dim, generator=g)  # 3 layers
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize(("heads", "dim", "dtype", "programs", "at_once"), [
    (2, 8, torch.bfloat16, 3, 1), (3, 64, torch.float32, 4, 2), (8, 128, torch.bfloat16, 7, 4)])
def test_copy_rows_equals_torch_indexing(heads, dim, dtype, programs, at_once):
    src, dst = pool(6, 4, heads, dim, 0, dtype), pool(8, 4, heads, dim, 1, dtype)
    want = dst.clone()
    # Scattered, unsorted slots across pages, different offsets on each side.
    src_slots = torch.tensor([3, 17, 5, 22, 9, 0, 23], device=DEVICE)
    dst_slots = torch.tensor([12, 1, 27, 6, 20, 31, 0], device=DEVICE)
    rows = (2, -1, heads * dim)
    for layer in (0, 2):
        want[layer].view(rows)[:, dst_slots] = src[layer].view(rows)[:, src_slots]
        page_copy.copy_rows(src[layer], dst[layer], src_slots, dst_slots, programs, at_once)
    assert torch.equal(dst, want)  # layer 1 untouched, every other row as torch puts it


def test_copy_rows_over_a_run_of_layers_equals_one_layer_at_a_time():
    src, dst = pool(6, 4, 2, 8, 0, torch.bfloat16), pool(8, 4, 2, 8, 1, torch.bfloat16)
    want = dst.clone()
    src_slots = torch.tensor([3, 17, 5, 22, 9], device=DEVICE)
    dst_slots = torch.tensor([12, 1, 27, 6, 31], device=DEVICE)
    for layer in (1, 2):
        page_copy.copy_rows(src[layer], want[layer], src_slots, dst_slots, 3)
    page_copy.copy_rows(src[1:], dst[1:], src_slots, dst_slots, 2, rows_at_once=4)  # 2 layers
    assert torch.equal(dst, want)  # layer 0 untouched
    assert not torch.equal(dst[1], pool(8, 4, 2, 8, 1, torch.bfloat16)[1])


@pytest.mark.parametrize(("src_heads", "dst_heads"), [
    (range(2, 4), range(0, 2)),  # a rank's share out of a whole pool (split)
    (range(0, 2), range(2, 4)),  # a whole pool's share from a rank's (gather)
    (range(1, 2), range(3, 4))])
def test_copy_rows_of_some_heads_equals_torch_indexing(src_heads, dst_heads):
    """Pools split over different tensor-parallel sizes: only the heads named move."""
    src, dst = pool(6, 4, 4, 8, 0, torch.bfloat16), pool(8, 4, 4, 8, 1, torch.bfloat16)
    want = dst.clone()
    src_slots = torch.tensor([3, 17, 5, 22, 9], device=DEVICE)
    dst_slots = torch.tensor([12, 1, 27, 6, 31], device=DEVICE)
    s, d = slice(src_heads.start, src_heads.stop), slice(dst_heads.start, dst_heads.stop)
    for layer in range(3):
        want[layer][:, :, :, d].view(2, -1, len(dst_heads), 8)[:, dst_slots] = (
            src[layer][:, :, :, s].reshape(2, -1, len(src_heads), 8)[:, src_slots])
    page_copy.copy_rows(src, dst, src_slots, dst_slots, 3, 2, src_heads, dst_heads)
    assert torch.equal(dst, want)


def test_copy_rows_refuses_mismatched_pools():
    src, dst = pool(2, 4, 2, 8, 0, torch.float32), pool(2, 4, 2, 16, 0, torch.float32)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match=r"rows differ: heads range\(0, 2\) of \(2, 8\) vs "
                                         r"heads range\(0, 2\) of \(2, 16\)"):
        page_copy.copy_rows(src[0], dst[0], slots, slots)
    with pytest.raises(ValueError, match=r"heads range\(1, 3\) of \(2, 8\)"):
        page_copy.copy_rows(src[0], src[1], slots, slots, src_heads=range(1, 3),
                            dst_heads=range(0, 2))
    with pytest.raises(ValueError, match="2 source slots but 1 destinations"):
        page_copy.copy_rows(src[0], src[1], slots, slots[:1])
    with pytest.raises(ValueError, match=r"runs of as many layers: \(2, 2, 2, 4, 2, 8\) vs "
                                         r"\(3, 2, 2, 4, 2, 16\)"):
        page_copy.copy_rows(src[1:], dst, slots, slots)


def test_warm_up_leaves_the_pool_as_it_was_and_no_send_compiles_after_it():
    """The row counts are not specialised: after the start-up copy, sends of 1, 16 and 17
    rows (Triton's default would compile one variant for each kind) compile nothing."""
    p = pool(8, 4, 2, 8, seed=5, dtype=torch.bfloat16)  # 32 slots
    dst = pool(8, 4, 2, 8, seed=6, dtype=torch.bfloat16)
    before = p.clone()
    page_copy.warm_up(p, 4, 2)
    assert torch.equal(p, before)
    from triton import knobs
    compiled = []
    saved, knobs.runtime.jit_cache_hook = (knobs.runtime.jit_cache_hook,
                                           lambda *a, **k: compiled.append(k) or False)
    try:
        for n in (1, 16, 17):
            slots = torch.arange(n, dtype=torch.int64, device=DEVICE)
            page_copy.copy_rows(p, dst, slots, slots, 4, 2)
            assert torch.equal(dst.flatten(2, 3)[:, :, :n], p.flatten(2, 3)[:, :, :n])
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert compiled == []


def test_the_copy_grid_from_the_environment_is_a_number_of_programs_or_an_error_naming_it():
    """MICROSERVE_KV_COPY_PROGRAMS (kvcache/transfer/cuda_ipc.py, a diagnosis): 1-4,096
    programs; anything else fails when the engine starts, naming the variable."""
    from kvcache.transfer.cuda_ipc import _copy_programs

    assert [_copy_programs(v) for v in ("132", "1", "4096", " 8 ")] == [132, 1, 4096, 8]
    for bad in ("0", "-3", "4097", "abc", "", "1.5"):
        with pytest.raises(ValueError, match="MICROSERVE_KV_COPY_PROGRAMS"):
            _copy_programs(bad)
