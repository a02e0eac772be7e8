"""What the KV manager's stats() costs with a GPU-sized pool (31,431 pages of 16: an H100's fp8
Llama-3.1-8B pool): 230 sequences of 1,100 tokens running, 200 more finished and cached.

    python bench/scripts/kv_stats.py
"""

import random
import time

from kvcache.manager import KVCacheManager


def main() -> None:
    m = KVCacheManager(31431, 16)
    rng = random.Random(0)
    for i in range(430):
        tokens = [rng.randrange(128000) for _ in range(1100)]
        m.open(f"s{i}", tokens)
        assert m.allocate(f"s{i}", len(tokens))
        m.cache_tokens(f"s{i}", tokens)
        if i < 200:
            m.free(f"s{i}")
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        stats = m.stats()
    print(stats, f"{(time.perf_counter() - start) / n * 1e6:.1f} us per stats()")


if __name__ == "__main__":
    main()
