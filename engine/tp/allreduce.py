"""The all-reduce of small messages: torch's one-shot all-reduce over symmetric memory.

A tensor-parallel decode step sums two partial products per layer, each batch x hidden values:
8 KiB at batch 1 of an 8B model, 1 MiB at batch 128. At these sizes the sum is latency, not
bandwidth, and NCCL's ring/tree protocol pays for steps it does not need. The one-shot
all-reduce (vLLM's and SGLang's custom all-reduce; here torch's own,
`torch.ops.symm_mem.one_shot_all_reduce_copy`) does it in one kernel: every rank copies its
partial sum into a buffer the others can read over NVLink (CUDA IPC mappings set up once, at
the join), meets the others at a barrier of flags in that memory, then reads every rank's
buffer and adds them up in rank order itself. Every rank computes the same sum in the same
order, so the ranks hold bit-identical results, as they must. It needs no NVLink multicast
(which the lent machines keep off; `multimem_*` would), and CUDA graphs capture it.

Which is used when (`--all-reduce`, EngineConfig.all_reduce):
- `nccl`: NCCL through torch.distributed for every message;
- `one-shot`: messages up to ONE_SHOT_MAX_BYTES (512 KiB) one-shot, larger ones (large
  decode batches, prefill chunks) NCCL;
  the engine fails to start if symmetric memory cannot be set up;
- `auto` (default): `one-shot` where it can be set up (CUDA, torch built with symmetric
  memory), else `nccl` with a warning saying why.

The limit and the choice come from `bench.allreduce`, which times both side by side inside CUDA
graphs (docs/benchmarks.md, "Tensor parallelism": the figures and the machine).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("microserve.tp")

# The largest message summed one-shot: a decode step at batch 64 of an 8B model (64 x 4,096
# bf16). On two H200s (2026-11-27) one-shot took 0.74x NCCL's time at 8-64 KiB and 0.88x at
# 512 KiB inside a CUDA graph alone (bench.allreduce), but the engine's batch-128 decode step
# (1 MiB messages) ran 1.4% slower with it than with NCCL (one run each): past 512 KiB, NCCL.
ONE_SHOT_MAX_BYTES = 512 << 10
_ALIGN = 16  # bytes: the kernel's vector width; messages of other sizes go to NCCL

MODES = ("auto", "nccl", "one-shot")


class OneShotAllReduce:
    """A symmetric buffer of `max_bytes` on this rank's GPU, rendezvoused with the group's
    other ranks (a collective: every rank constructs it at the same point), and the sum of a
    message that fits, returned as a new tensor."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = (group or dist.group.WORLD).group_name
        if torch.__version__ < "2.11":  # later versions do it themselves (and warn)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)  # kept alive with it
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy  # set_up checked it exists

    def fits(self, x: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor):  # an fp8 projection's output with its scales
            return False
        n = x.numel()
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous()
                and 0 < n <= self.max_numel and n * x.element_size() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        return self._op(self.buffer[:n], x.view(-1), "sum", self.group_name).view_as(x)


def set_up(mode: str, group: dist.ProcessGroup | None, device: torch.device,
           dtype: torch.dtype) -> OneShotAllReduce | None:
    """The one-shot all-reduce for `mode` on this rank, or None for NCCL alone. Every rank of
    the group calls it at the same point (the rendezvous is a collective), with the same mode:
    a failure on one rank under `auto` would leave the others waiting, so a rank that cannot
    set it up raises under `one-shot`, and under `auto` every rank agrees first."""
    if mode not in MODES:
        raise ValueError(f"all_reduce must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "nccl" or device.type != "cuda":
        return None
    why = _cannot(dtype)
    if mode == "auto":  # all ranks go one-shot, or none does
        able = torch.tensor([0 if why else 1], device=device)
        dist.all_reduce(able, op=dist.ReduceOp.MIN, group=group)
        if not able.item():
            log.warning("all-reduce: NCCL for every message (one-shot over symmetric memory "
                        "is not available on %s: %s)", "this rank" if why else "another rank",
                        why or "see its log")
            return None
    elif why:
        raise RuntimeError(f"--all-reduce one-shot: {why}")
    try:
        one_shot = OneShotAllReduce(group, device, dtype)
    except Exception as e:  # a rank failing here after the agreement: the engine must end
        raise RuntimeError(f"all-reduce: setting up symmetric memory failed: {e}") from e
    log.info("all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
             ONE_SHOT_MAX_BYTES // 1024)
    return one_shot


def _cannot(dtype: torch.dtype) -> str | None:
    """Why this process cannot sum messages of `dtype` one-shot, or None."""
    if dtype not in (torch.bfloat16, torch.float32):  # the kernel's types
        return f"its kernel sums bfloat16 and float32, not {dtype}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch.distributed._symmetric_memory: {e}"
    if getattr(getattr(torch.ops, "symm_mem", None), "one_shot_all_reduce_copy", None) is None:
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy"
    if not torch.cuda.is_available():
        return "no CUDA"
    return None
