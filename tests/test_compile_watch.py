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


def test_compiles_while_an_engine_of_the_process_starts_are_not_counted(caplog):
    """Two engines in one process (the benches): the second one's graph captures and warm-up
    compile after the first installed the hook; those are its start-up's, not misses."""
    watch = CompileWatch()
    assert watch.start()
    try:
        hook = dict(key=(0,), repr="_expand_kernel", fn=None, compile={},
                    is_manual_warmup=False, already_compiled=False)
        with caplog.at_level(logging.WARNING, "engine.kernels"):
            with watch.starting():
                with watch.starting():  # nested: still starting
                    assert watch._hook(**hook) is False
                assert watch._hook(**hook) is False
            assert watch.compiles == 0 and caplog.records == []
            assert watch._hook(**hook) is False  # started: counted again
        assert watch.compiles == 1 and len(caplog.records) == 1
    finally:
        watch.stop()


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
