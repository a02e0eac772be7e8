"""Greedy tokens of 4 random prompts (5-3,000 tokens) from one engine, to a JSON file.
usage: python bench/scripts/fp8_checkpoint_tokens.py MODEL OUT.json [fp8]

Run once on an fp8 checkpoint (`microserve quantize`) and once on its source with fp8: the
two files' tokens must be equal (docs/benchmarks.md, fp8 checkpoints)."""
import json
import random
import sys
import time

sys.path.insert(0, "tests")
from test_engine_core import greedy, run_all  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from microserve.model_files import resolve_model  # noqa: E402

t = time.perf_counter()
core = EngineCore(EngineConfig(model=str(resolve_model(sys.argv[1])), device="cuda",
                               quantization=sys.argv[3] if len(sys.argv) > 3 else None))
startup = time.perf_counter() - t
rng = random.Random(0)
prompts = {f"p{i}": [rng.randrange(128000) for _ in range(n)]
           for i, n in enumerate([5, 200, 1000, 3000])}
out = run_all(core, prompts, greedy(32))
json.dump({"startup_s": startup, "quantization": core.info.quantization,
           "tokens": {k: v[0] for k, v in out.items()}}, open(sys.argv[2], "w"))
print(sys.argv[1], "startup", round(startup, 1), "s", core.info.quantization,
      {k: v[0][:6] for k, v in out.items()})
