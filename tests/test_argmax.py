"""The two-pass Triton argmax (engine/kernels/argmax.py) against torch.argmax.

Without CUDA the kernels run under the Triton interpreter on CPU; with CUDA compiled, plus a
`gpu`-marked run at Llama-3.1-8B's vocabulary and batch sizes.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernels import DEVICE, load

argmax_mod = load("engine.kernels.argmax")
CHUNK = argmax_mod.CHUNK


def random_logits(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(rows, n, generator=g, device=DEVICE) * 4


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 7), (3, CHUNK), (2, CHUNK + 1), (4, 3 * CHUNK + 5)])
def test_matches_torch(rows, n):
    x = random_logits(rows, n, seed=rows * 1000 + n)
    assert torch.equal(argmax_mod.argmax_rows(x), x.argmax(dim=-1))


def test_ties_take_the_lowest_index_across_chunks():
    x = torch.zeros(3, 3 * CHUNK, device=DEVICE)
    x[0, [5, CHUNK + 1, 2 * CHUNK]] = 9.0  # first in chunk 0
    x[1, [CHUNK + 7, CHUNK + 9, 2 * CHUNK + 3]] = 9.0  # first in chunk 1
    # row 2: all equal, the answer is 0
    assert argmax_mod.argmax_rows(x).tolist() == [5, CHUNK + 7, 0]
    assert x.argmax(dim=-1).tolist() == [5, CHUNK + 7, 0]


def test_infinities_and_nan():
    x = torch.full((3, CHUNK + 10), float("-inf"), device=DEVICE)
    x[1, CHUNK + 4] = float("inf")
    x[1, 3] = 1e30
    x[2, 9] = 1.0
    x[2, CHUNK + 2] = float("nan")  # NaN is the largest, as torch orders it
    assert argmax_mod.argmax_rows(x).tolist() == [0, CHUNK + 4, CHUNK + 2]
    assert argmax_mod.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_rows_of_a_wider_tensor():
    """The sampler passes logits[:, :vocab_size] of a padded LM head: a row stride > V."""
    wide = random_logits(3, CHUNK + 300, seed=5)
    wide[:, CHUNK + 100:] = 100.0  # padding past the vocabulary must not win
    x = wide[:, : CHUNK + 100]
    assert torch.equal(argmax_mod.argmax_rows(x), x.argmax(dim=-1))


def test_empty_batch_and_bad_shapes():
    assert argmax_mod.argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[B, V\] with a contiguous last dim, got shape \(10,\)"):
        argmax_mod.argmax_rows(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_mod.argmax_rows(torch.zeros(8, 4, device=DEVICE).t())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 128])
def test_llama3_vocabulary(rows):
    x = random_logits(rows, 128256, seed=rows)
    assert torch.equal(argmax_mod.argmax_rows(x), x.argmax(dim=-1))
