"""microserve: shared, torch-free pieces used by both the router and the engine.

Importing this package (or any module in it) never imports torch: a router host may have no
GPU stack. Engine-only code lives in `engine/` and `kvcache/`.
"""

__version__ = "0.1.0"
