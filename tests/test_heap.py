"""microserve/heap.py: the start-up heap frozen out of full collections, handed back at exit."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_a_frozen_heap_goes_back_to_the_collector_at_exit():
    """A process that froze its start-up heap ends without nanobind's leak report: Triton's
    objects frozen at start-up would otherwise outlive the interpreter, and every engine
    printed ~60 lines of "nanobind: leaked ..." when `microserve up` stopped."""
    pytest.importorskip("triton")
    code = ("import gc, triton.language\n"
            "from microserve.heap import freeze_startup_heap\n"
            "freeze_startup_heap(); freeze_startup_heap()\n"
            "assert gc.get_freeze_count() > 0\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nanobind" not in done.stderr, done.stderr[-2000:]
