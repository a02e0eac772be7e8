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
            for i in range(3):
                # Triton calls it with these keywords; False: compile as usual
                assert watch._hook(key=(i,), repr=f"_extend_kernel[{i}]", fn=None, compile={},
                                   is_manual_warmup=False, already_compiled=False) is False
        assert watch.compiles == 3
        assert [r.getMessage().split(" after")[0] for r in caplog.records] == [
            f"Triton compiled _extend_kernel[{i}]" for i in range(3)]
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


def test_a_compile_is_named_with_what_made_its_variant():
    from triton.runtime.jit import JitFunctionInfo

    from engine.kernels.compile_watch import _describe

    fn = JitFunctionInfo("engine.kernels.paged_attention", "_extend_kernel", None)
    # the form Triton 3.6 passes (seen on the H100): arguments keyed by (index,)
    compile = {"key": "[...]", "signature": {"q": "*bf16", "n": "i32", "BLOCK_M": "constexpr"},
               "constants": {(2,): 64}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                     (1,): []}]}
    assert _describe({"fn": fn, "compile": compile, "repr": "x"}) == (
        "engine.kernels.paged_attention._extend_kernel (BLOCK_M=64; q: tt.divisibility=16)")
    assert _describe({"fn": fn, "compile": {}, "repr": "k[...]"}) == "k[...]"  # another Triton
