"""The all-reduce of small messages: a one-shot all-reduce over symmetric memory.

A tensor-parallel decode step sums two partial products per layer, each batch x hidden values:
8 KiB at batch 1 of an 8B model, 1 MiB at batch 128. At these sizes the sum is latency, not
bandwidth, and NCCL's ring/tree protocol pays for steps it does not need. A one-shot all-reduce
(vLLM's and SGLang's custom all-reduce) does it in one kernel: every rank copies its partial
sum into a buffer the others can read over NVLink (symmetric memory: CUDA IPC mappings set up
once, at the join), meets the others at a barrier of flags in that memory, then reads every
rank's buffer and adds them up in rank order itself. Every rank computes the same sum in the
same order, so the ranks hold bit-identical results, as they must. It needs no NVLink
multicast (which the lent machines keep off; `multimem_*` would), and CUDA graphs capture it.

Two kernels do it (`OneShotAllReduce(kernel=...)`):
- `triton` (the engine's): engine/kernels/one_shot.py. One barrier per call (buffers
  alternate halves), and programmatic dependent launch on both sides, so in a decode step the
  GEMV after it launches while it waits for the other ranks and fetches its first weights;
- `torch`: torch's own `symm_mem.one_shot_all_reduce_copy` (two barriers, no PDL), kept for
  `bench.allreduce`'s side by side.

Which is used when (`--all-reduce`, EngineConfig.all_reduce):
- `nccl`: NCCL through torch.distributed for every message;
- `one-shot`: messages up to ONE_SHOT_MAX_BYTES (512 KiB) one-shot, larger ones (large
  decode batches, prefill chunks) NCCL;
  the engine fails to start if symmetric memory cannot be set up;
- `auto` (default): `one-shot` where it can be set up (CUDA, torch built with symmetric
  memory), else `nccl` with a warning saying why; and with exactly two ranks, the large
  messages of eager prompt steps by copy engine (engine/tp/exchange.py).

The limit and the choice come from `bench.allreduce`, which times them side by side inside
CUDA graphs (docs/benchmarks.md, "Tensor parallelism": the figures and the machine).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from engine.kernels import pdl

log = logging.getLogger("microserve.tp")

# The largest message summed one-shot: a decode step at batch 64 of an 8B model (64 x 4,096
# bf16). On two H200s (2026-11-27) one-shot took 0.74x NCCL's time at 8-64 KiB and 0.88x at
# 512 KiB inside a CUDA graph alone (bench.allreduce), but the engine's batch-128 decode step
# (1 MiB messages) ran 1.4% slower with it than with NCCL (one run each): past 512 KiB, NCCL.
ONE_SHOT_MAX_BYTES = 512 << 10
_ALIGN = 16  # bytes: the kernel's vector width; messages of other sizes go to NCCL

MODES = ("auto", "nccl", "one-shot")


class OneShotAllReduce:
    """A symmetric buffer for messages of up to `max_bytes` on this rank's GPU, rendezvoused
    with the group's other ranks (a collective: every rank constructs it at the same point),
    and the sum of a message that fits, returned as a new tensor. `kernel`: `triton` (the
    engine's, engine/kernels/one_shot.py) or `torch` (symm_mem.one_shot_all_reduce_copy).
    The Triton kernel traps after `timeout_s` waiting for another rank (the engine then ends,
    as a timed-out NCCL collective ends it)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 dtype: torch.dtype, max_bytes: int = ONE_SHOT_MAX_BYTES,
                 kernel: str = "triton", timeout_s: float = 300.0):
        from torch.distributed import _symmetric_memory as symm_mem

        if kernel not in ("triton", "torch"):
            raise ValueError(f"kernel must be triton or torch, got {kernel!r}")
        self.group_name = (group or dist.group.WORLD).group_name
        if torch.__version__ < "2.11":  # later versions do it themselves (and warn)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.kernel = kernel
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        if kernel == "torch":
            self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
            self.handle = symm_mem.rendezvous(self.buffer, self.group_name)  # kept alive
            self._op = torch.ops.symm_mem.one_shot_all_reduce_copy  # set_up checked it exists
            return
        from engine.kernels import one_shot

        self.programs = one_shot.programs(self.max_numel)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        data_bytes = 2 * self.max_numel * dtype.itemsize  # two halves: calls alternate
        flag_bytes = self.programs * self.world * 8
        raw = symm_mem.empty(data_bytes + flag_bytes, dtype=torch.uint8, device=device)
        raw.zero_()  # the flags start at 0 on every rank before any rank can write them
        torch.cuda.synchronize(device)
        self.handle = symm_mem.rendezvous(raw, self.group_name)  # a collective
        self.raw = raw
        self.data = raw[:data_bytes].view(dtype)
        self.flags = raw[data_bytes:].view(torch.int64)
        base = self.handle.buffer_ptrs[self.rank]
        deltas = [ptr - base for ptr in self.handle.buffer_ptrs]
        if any(d % 16 for d in deltas):
            raise RuntimeError(f"symmetric buffers are not 16-byte aligned: {deltas}")
        self.data_deltas = torch.tensor([d // dtype.itemsize for d in deltas], device=device)
        self.flag_deltas = torch.tensor([d // 8 for d in deltas], device=device)
        self.counters = torch.zeros(self.programs, dtype=torch.int64, device=device)
        self.timeout_ns = int(timeout_s * 1e9)
        self._pdl = pdl.use_pdl(self.data)
        dist.barrier(group)  # no rank writes a flag before every rank's are zero

    def fits(self, x: torch.Tensor) -> bool:
        if not isinstance(x, torch.Tensor):  # an fp8 projection's output with its scales
            return False
        n = x.numel()
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous()
                and 0 < n <= self.max_numel and n * x.element_size() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if self.kernel == "torch":
            return self._op(self.buffer[:n], x.view(-1), "sum", self.group_name).view_as(x)
        from engine.kernels import one_shot

        out = torch.empty_like(x)
        one_shot._one_shot_kernel[(one_shot.programs(n),)](
            x, out, self.data, self.data_deltas, self.flags, self.flag_deltas, self.counters,
            n, self.max_numel, self.rank, self.timeout_ns, WORLD=self.world,
            BLOCK=one_shot.BLOCK, PDL=self._pdl, num_warps=one_shot.NUM_WARPS,
            **pdl.launch_options(self._pdl),
        )  # fmt: skip
        return out


def set_up(mode: str, group: dist.ProcessGroup | None, device: torch.device,
           dtype: torch.dtype, timeout_s: float = 300.0) -> OneShotAllReduce | None:
    """The one-shot all-reduce for `mode` on this rank, or None for NCCL alone. Every rank of
    the group calls it at the same point (the rendezvous is a collective), with the same mode:
    a failure on one rank under `auto` would leave the others waiting, so a rank that cannot
    set it up raises under `one-shot`, and under `auto` every rank agrees first. `timeout_s`:
    how long a rank waits for the others inside the kernel before it traps."""
    if mode not in MODES:
        raise ValueError(f"all_reduce must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "nccl" or device.type != "cuda":
        return None
    why = _cannot(dtype)
    if mode == "auto":  # all ranks go one-shot, or none does
        if not ranks_agree(why, group, device, "every message", "one-shot over symmetric memory"):
            return None
    elif why:
        raise RuntimeError(f"--all-reduce one-shot: {why}")
    try:
        one_shot = OneShotAllReduce(group, device, dtype, timeout_s=timeout_s)
    except Exception as e:  # a rank failing here after the agreement: the engine must end
        raise RuntimeError(f"all-reduce: setting up symmetric memory failed: {e}") from e
    log.info("all-reduce: one-shot over symmetric memory up to %d KiB, NCCL above",
             ONE_SHOT_MAX_BYTES // 1024)
    return one_shot


def ranks_agree(why: str | None, group: dist.ProcessGroup | None, device: torch.device,
                messages: str, what: str) -> bool:
    """Whether every rank of the group can use `what` (`why` is None on each): a collective,
    so that all ranks take it or none does. Where one cannot, each rank warns that NCCL sums
    `messages` instead, saying why (or that another rank cannot)."""
    able = torch.tensor([0 if why else 1], device=device)
    dist.all_reduce(able, op=dist.ReduceOp.MIN, group=group)
    if able.item():
        return True
    log.warning("all-reduce: NCCL for %s (%s is not available on %s: %s)", messages, what,
                "this rank" if why else "another rank", why or "see its log")
    return False


def _cannot(dtype: torch.dtype) -> str | None:
    """Why this process cannot sum messages of `dtype` one-shot, or None."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):  # the kernel's types
        return f"its kernel sums bfloat16, float16 and float32, not {dtype}"
    return no_symmetric_memory()


def no_symmetric_memory() -> str | None:
    """Why this process cannot map other ranks' buffers through torch's symmetric memory, or
    None."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch.distributed._symmetric_memory: {e}"
    if not hasattr(symm_mem, "rendezvous"):
        return f"torch {torch.__version__} has no symm_mem.rendezvous"
    if not torch.cuda.is_available():
        return "no CUDA"
    return None
