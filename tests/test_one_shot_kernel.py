"""The one-shot all-reduce kernel (engine/kernels/one_shot.py) as one rank sees it, on the
CPU under the Triton interpreter: the other ranks' buffers and flags are rows of the same
tensors, filled as those ranks would have left them when they arrived at the barrier. (The
kernels of two ranks meeting over NVLink, bit-equal to NCCL, are tests/test_gpu_tp.py's.)
float32: the interpreter rounds bfloat16 its own way."""

from __future__ import annotations

import pytest
import torch
from triton_kernels import DEVICE, load

k = load("engine.kernels.one_shot")

HALF = 3 * k.BLOCK  # the buffers' message limit: three programs


class Ranks:
    """WORLD ranks' data buffers (two halves each) and flag arrays, rows of two tensors; the
    kernel runs as rank `me` with its own counters."""

    def __init__(self, world: int, me: int):
        self.world, self.me = world, me
        self.data = torch.full((world, 2 * HALF), float("nan"), device=DEVICE)
        self.flags = torch.zeros(world, k.programs(HALF) * world, dtype=torch.int64,
                                 device=DEVICE)  # fmt: skip
        self.counters = torch.zeros(k.programs(HALF), dtype=torch.int64, device=DEVICE)

    def arrive(self, r: int, count: int, x: torch.Tensor) -> None:
        """Rank r wrote x for its call `count` and set its flag on `me` (every program)."""
        half = count % 2
        self.data[r, half * HALF : half * HALF + x.numel()] = x
        self.flags[self.me, r :: self.world] = count

    def run(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        rows = torch.arange(self.world, device=DEVICE)
        k._one_shot_kernel[(k.programs(x.numel()),)](
            x, out, self.data[0], rows * self.data.stride(0), self.flags[0],
            rows * self.flags.stride(0), self.counters, x.numel(), HALF, self.me, 10**9,
            WORLD=self.world, BLOCK=k.BLOCK, PDL=False,
        )  # fmt: skip
        return out


def parts(world: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(DEVICE) for _ in range(world)]


def rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(xs[0])
    for x in xs:
        acc = acc + x
    return acc


@pytest.mark.parametrize("world,me,n", [(2, 0, 8), (2, 1, 2 * k.BLOCK + 24), (3, 1, HALF),
                                        (4, 3, k.BLOCK)])
def test_the_sum_in_rank_order_its_copy_its_flags_on_every_rank(world, me, n):
    ranks = Ranks(world, me)
    used = k.programs(n)
    for count in (1, 2, 3):  # calls alternate halves
        xs = parts(world, n, seed=100 * count + n)
        for r in range(world):
            if r != me:
                ranks.arrive(r, count, xs[r])
        other = (count + 1) % 2  # the half this call must not read
        ranks.data[:, other * HALF : other * HALF + n] = float("nan")
        out = ranks.run(xs[me])
        assert torch.equal(out, rank_order_sum(xs))
        half = count % 2
        assert torch.equal(ranks.data[me, half * HALF : half * HALF + n], xs[me])
        assert ranks.counters.tolist() == [count] * used + [0] * (k.programs(HALF) - used)
        for r in range(world):  # this rank told every other one it arrived, per program
            if r != me:
                flags = ranks.flags[r].view(-1, world)[:, me].tolist()
                assert flags == [count] * used + [0] * (k.programs(HALF) - used)


def test_a_rank_already_at_its_next_call_lets_this_one_pass():
    """A rank that passed this call's barrier may have set its flag for the next call before
    this rank read it: count + 1 means it arrived at this call too."""
    ranks = Ranks(2, 0)
    xs = parts(2, 64, seed=7)
    ranks.arrive(1, 1, xs[1])
    ranks.flags[0, 1::2] = 2
    assert torch.equal(ranks.run(xs[0]), xs[0] + xs[1])
    assert ranks.counters[0].item() == 1
