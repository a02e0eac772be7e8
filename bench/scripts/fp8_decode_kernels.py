"""Kernel table of fp8 decode steps at batch B with o/down scales deferred or not.
usage: python bench/scripts/fp8_decode_kernels.py DEFER_MAX_TOKENS BATCH

DEFER_MAX_TOKENS 0 runs o and down through the rowwise GEMM at every size (the code before
engine/models/fp8.py deferred their scales to the norms); docs/benchmarks.md has the tables."""
import sys

from engine.models import fp8

fp8.DEFER_MAX_TOKENS = int(sys.argv[1])
from bench.engine_gpu import drain, generating, params, prompts, steady_step_ms  # noqa: E402
from bench.scripts.profile_steps import kernel_table  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from microserve.model_files import resolve_model  # noqa: E402

core = EngineCore(EngineConfig(model=str(resolve_model("random:llama-3.1-8b")), device="cuda",
                               quantization="fp8", max_num_seqs=256))
vocab = core.info.vocab_size
batch = int(sys.argv[2])
for i, p in enumerate(prompts(batch, 128, vocab, 8)):
    core.add_request(f"s{i}", p, params(160))
while any(s.num_computed_tokens < len(s.prompt_token_ids) + 4 for s in generating(core)):
    core.step()
ms, _ = steady_step_ms(core, 30, lambda: len(core.requests) == batch)
print(f"defer<={fp8.DEFER_MAX_TOKENS} batch {batch}: step {ms:.3f} ms", flush=True)
print(kernel_table(core, lambda: [core.step() for _ in range(5)], rows=14).split("-- by host")[0])
drain(core)
