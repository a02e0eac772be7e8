"""Joining a tensor-parallel engine's process group."""

from __future__ import annotations

import ctypes
import datetime
import signal
import socket

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import rank_device
from engine.models.parallel import TensorParallel
from engine.tp import allreduce, exchange


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(config: EngineConfig, rank: int, init_method: str, tp: TensorParallel,
         dtype: torch.dtype, hidden_size: int) -> None:
    """Join the group of config.tensor_parallel_size ranks as `rank`: NCCL when the engine is
    on CUDA (each rank's GPU made current first), gloo on the CPU. Every collective of the
    group, this one included, fails after config.tensor_parallel_timeout_s instead of
    hanging on a rank that stopped. One all-reduce follows, so the communicator exists
    before any CUDA graph is captured (a capture cannot create it); then the all-reduces of
    config.all_reduce are set up into `tp`: the one-shot for small messages
    (engine/tp/allreduce.py) and, where steps run eagerly, the copy-engine exchange for large
    ones (engine/tp/exchange.py). Messages are `dtype`, `hidden_size` values a token."""
    size = config.tensor_parallel_size
    device = rank_device(config.device, rank)
    cuda = device.type == "cuda"
    if cuda:
        if device.index is None:  # rank 0 of --device cuda: the current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=config.tensor_parallel_timeout_s),
        **({"device_id": device} if cuda else {}),
    )  # fmt: skip
    dist.all_reduce(torch.ones(1, device=device))
    small = allreduce.set_up(config.all_reduce, tp.group, device, dtype,
                             config.tensor_parallel_timeout_s)
    step = config.max_prefill_step_tokens  # the largest step
    eager = config.enforce_eager or step > config.max_piecewise_tokens
    large_bytes = step * hidden_size * dtype.itemsize if eager else 0
    tp.custom.install(small, exchange.set_up(config.all_reduce, tp.group, device, dtype,
                                             large_bytes))


def die_with_parent() -> None:
    """Have the kernel kill this process when the process that started it exits (Linux), so a
    worker never outlives its engine, however rank 0 ends."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: rank 0's watchdog and the pipe's EOF still end the worker
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def leave() -> None:
    """Leave the group so this process may join another (gloo: the in-process CPU tests).
    NCCL's group is left as it is, for the process's end to free: with CUDA graphs holding
    its kernels alive, both an orderly destroy and an abort waited on 2xH200 until a timeout
    killed the process (bench.allreduce, the engine's close). A process joins one NCCL group
    in its life (a CUDA engine core is one process per engine)."""
    if dist.is_initialized() and dist.get_backend() != "nccl":
        dist.destroy_process_group()
