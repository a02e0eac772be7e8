"""Which Triton kernels compile after an engine's start-up, and what the first request of each
shape pays for it (against the same shape again).
usage: TRITON_CACHE_DIR=/tmp/empty python bench/scripts/first_requests.py [fp8]

The kernel list names new cache entries by kernel name, so a second variant of a kernel
already listed (another extend tile height) does not show; the times do."""
import os
import random
import sys
import time

sys.path.insert(0, "tests")
from test_engine_core import greedy, run_all  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from microserve.messages import SamplingParams  # noqa: E402
from microserve.model_files import resolve_model  # noqa: E402

cache = os.environ["TRITON_CACHE_DIR"]


def kernels() -> set[str]:
    out = set()
    for d in os.listdir(cache):
        for f in os.listdir(os.path.join(cache, d)):
            if f.endswith(".json") and not f.startswith("__grp__"):
                out.add(f.removesuffix(".json"))
    return out


t = time.perf_counter()
q = sys.argv[1] if len(sys.argv) > 1 else None
core = EngineCore(EngineConfig(model=str(resolve_model("random:llama-3.1-8b")), device="cuda",
                               quantization=q))
print(f"startup {time.perf_counter() - t:.1f} s, {len(kernels())} kernels compiled", flush=True)
rng = random.Random(0)
seen = kernels()


def case(name, lengths, params=None):
    global seen
    times = []
    for rep in range(2):
        prompts = {f"{name}-{rep}-{i}": [rng.randrange(128000) for _ in range(n)]
                   for i, n in enumerate(lengths)}
        t = time.perf_counter()
        run_all(core, prompts, params or greedy(4))
        times.append(time.perf_counter() - t)
    new = kernels() - seen
    seen |= new
    print(f"{name:28s} first {times[0] * 1e3:8.1f} ms  again {times[1] * 1e3:8.1f} ms  "
          f"new kernels: {sorted(new)}", flush=True)


case("1x1024", [1024])
case("1x100", [100])
case("1x40", [40])
case("1x10", [10])
case("8x300", [300] * 8)
case("1x5000 (chunked)", [5000])
case("64x1024", [1024] * 64)
case("sampled t0.8 top_p", [200] * 4,
     SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True))
case("sampled top_k logprobs", [200] * 4,
     SamplingParams(max_tokens=4, temperature=1.0, top_k=20, logprobs=3, ignore_eos=True))
case("400x1024 burst", [1024] * 400, greedy(8))
