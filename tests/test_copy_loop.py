"""bench/scripts/copy_loop.py: py-spy's collapsed stacks summed per process and thread, per
leaf frame and inclusive, on a made-up profile whose every count is known."""

from __future__ import annotations

import pytest

from bench.scripts.copy_loop import heaviest, main

RAW = """\
process 7:"python -m launcher.cli engine --port 1";thread (7): MainThread;run (a.py:1);validate (pydantic/x.py:2) 5
process 7:"python -m launcher.cli engine --port 1";process 9:"python -m engine.core_proc --config {\\"a\\": 1}";thread (9): MainThread;remote_send (engine/kv_sender.py:141);kv_digest (kvcache/transfer/auth.py:111) 3
process 7:"python -m launcher.cli engine --port 1";process 9:"python -m engine.core_proc --config {\\"a\\": 1}";thread (9): MainThread;remote_send (engine/kv_sender.py:141) 2
process 7:"python -m launcher.cli engine --port 1";process 9:"python -m engine.core_proc --config {\\"a\\": 1}";thread (11): kv-sender;write (kvcache/transfer/shm.py:453);kv_digest (kvcache/transfer/auth.py:111) 4
"""


def test_samples_are_summed_per_thread_per_leaf_and_inclusive(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(RAW)
    assert heaviest(str(path), top=3) == [
        "samples per process and thread:",
        "       5  process 7; thread (7): MainThread",
        "       5  process 7; process 9; thread (9): MainThread",
        "       4  process 7; process 9; thread (11): kv-sender",
        "leaf frames:",
        "       7  kv_digest (kvcache/transfer/auth.py:111)",
        "       5  validate (pydantic/x.py:2)",
        "       2  remote_send (engine/kv_sender.py:141)",
        "inclusive (engine, kvcache, microserve frames):",
        "       7  kv_digest (kvcache/transfer/auth.py:111)",
        "       5  remote_send (engine/kv_sender.py:141)",
        "       4  write (kvcache/transfer/shm.py:453)",
    ]


def test_a_loop_of_nothing_is_refused_before_any_engine_starts():
    with pytest.raises(SystemExit):
        main(["--tokens", "8"])
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
