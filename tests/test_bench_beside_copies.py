"""bench.engine_gpu's `beside-copies` figure on a CPU engine of the tiny model: the copies it
runs beside the decode steps are the host tier's own, one per step where they are synchronous
(CPU), on pages it takes from the pool and gives back; the engine ends with every request
done, its pages intact and nothing on the host."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore

from bench.engine_gpu import beside_copies


@pytest.mark.parametrize("copy_programs", [None, 2])  # staged on CPU; the copy kernel
def test_beside_copies_copies_once_a_step_and_gives_its_pages_back(tiny_model_dir,
                                                                    copy_programs):
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=256))
    try:
        free = core.kv.pool.num_free
        r = beside_copies(core, core.info.vocab_size, batch=3, context=20, pages=6, rounds=2,
                          steps=5, copy_programs=copy_programs)
        assert r["copy_programs"] == (copy_programs or 0)
        assert len(r["step_ms_alone"]) == 3 and len(r["step_ms_beside_copies"]) == 2
        # each round beside copies against the rounds alone around it; the median of two
        alone, beside = r["step_ms_alone"], r["step_ms_beside_copies"]
        assert r["slowdowns"] == [beside[k] / ((alone[k] + alone[k + 1]) / 2) - 1
                                  for k in range(2)]
        assert r["slowdown"] == pytest.approx(sum(r["slowdowns"]) / 2)
        assert r["copies"] == 2 * 5  # synchronous copies: out, in, out, ... one per step
        assert all(rate > 0 for rate in r["copies_gb_s"])
        assert len(core.requests) == 0
        core.check_integrity()
        # the copies' 6 pages are back; what the sequences left is only cached
        assert core.kv.pool.num_free + core.kv.cache.num_evictable() == free
    finally:
        core.close()


def test_the_diagnoses_need_a_gpu_and_a_known_target(tiny_model_dir):
    core = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    try:
        with pytest.raises(SystemExit, match="beside-copies-dma: DMAs on a stream of their own "
                                             "need a GPU"):
            beside_copies(core, core.info.vocab_size, dma_only=True)
        with pytest.raises(ValueError, match="dma_to 'disk': host, device or nothing"):
            beside_copies(core, core.info.vocab_size, dma_only=True, dma_to="disk")
        with pytest.raises(SystemExit, match="beside-copies-hipri: stream priorities need a GPU"):
            beside_copies(core, core.info.vocab_size, step_priority=-1)
        with pytest.raises(SystemExit, match="beside-copies-out/-in: copies on a stream of "
                                             "their own need a GPU"):
            beside_copies(core, core.info.vocab_size, copy_programs=4, one_way="out")
        with pytest.raises(ValueError, match="one_way 'up': out or in, by the copy kernel or DMAs"):
            beside_copies(core, core.info.vocab_size, one_way="up")
        with pytest.raises(ValueError, match="one_way 'in': out or in, by the copy kernel or DMAs"):
            beside_copies(core, core.info.vocab_size, copy_programs=0, one_way="in")
        assert core.kv.pool.num_free == 64  # nothing taken
    finally:
        core.close()
