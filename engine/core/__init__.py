"""The engine core: requests in, one step at a time, token ids out.

Single-threaded and synchronous on purpose. It runs in its own process (engine/core_proc.py,
which does the I/O and nothing else), so HTTP parsing, JSON and detokenization in the frontend
process never sit on the step loop's critical path; tests also drive it in-process.

One concern per module, all mixed into `EngineCore`:

    engine_core.py  EngineCore: what it runs (model runner, pages, scheduler, request table,
                    KV exchange, side tables), built once; stats, integrity
    handlers.py     handle(frame) / tick(now) / fail_step: the frames in and out, dispatched
                    by a table per frame type and per declared call (microserve/messages.CALLS)
    lifecycle.py    a request's life: add, remote_send, abort, expire, fail, remove
    step.py         step(): launch a Batch, resolve a LaunchedStep (async scheduling)
    warmup.py       the start-up requests that make Triton compile before the first real one
"""

from engine.core.engine_core import EngineCore
from engine.core.handlers import Tick
from engine.core.step import FLUSH_WAIT_S, Batch, LaunchedStep

__all__ = ["FLUSH_WAIT_S", "Batch", "EngineCore", "LaunchedStep", "Tick"]
