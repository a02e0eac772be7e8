"""The compile watch: Triton's cache hook counts and names each compile after warm-up."""

import logging

import pytest

from engine.kernels.compile_watch import CompileWatch

knobs = pytest.importorskip("triton").knobs


def test_the_hook_counts_names_and_lets_triton_compile(caplog):
    watch = CompileWatch()
    assert knobs.runtime.jit_cache_hook is None
    assert watch.start()
    try:
        assert knobs.runtime.jit_cache_hook == watch._hook
        assert watch.start()  # again: still the one hook
        with caplog.at_level(logging.WARNING, "engine.kernels"):
            for i in range(CompileWatch.KEEP + 2):
                # Triton calls it with these keywords; False: compile as usual
                assert watch._hook(key=(i,), repr=f"_extend_kernel[{i}]", fn=None, compile={},
                                   is_manual_warmup=False, already_compiled=False) is False
        assert watch.compiles == CompileWatch.KEEP + 2
        assert watch.kernels == [f"_extend_kernel[{i}]" for i in range(2, CompileWatch.KEEP + 2)]
        assert "Triton compiled _extend_kernel[0] after warm-up" in caplog.text
    finally:
        watch.stop()
    assert knobs.runtime.jit_cache_hook is None


def test_another_hook_is_kept():
    def theirs(**kwargs):
        return False

    knobs.runtime.jit_cache_hook = theirs
    try:
        watch = CompileWatch()
        assert not watch.start()
        watch.stop()
        assert knobs.runtime.jit_cache_hook is theirs
    finally:
        knobs.runtime.jit_cache_hook = None
