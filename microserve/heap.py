"""Keep the garbage collector's full passes short in long-running processes.

CPython's oldest-generation collection walks every tracked object in the process: a router
holds ~60,000 after start-up (fastapi, transformers, the tokenizer), and importing torch alone
leaves ~165,000. One such pass over them took 70 and 137 ms on this project's 2-core CPU, and it
runs on whichever thread allocates, holding the GIL: a router's event loop or an engine core's
step loop stops for all of it. `freeze_startup_heap()`, called once a process has started,
moves what start-up left alive to the permanent generation, which no later pass walks (what
is freed later is still freed by reference counting). vLLM's API server does the same after
its start.

At exit the frozen objects go back to the collector (atexit, before the interpreter's own
end): left frozen, they outlive it, and a nanobind extension (Triton's) reports each of its
objects among them as a leak, ~60 lines of "nanobind: leaked ..." from every engine on Ctrl-C.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often it is called
    atexit.register(gc.unfreeze)
