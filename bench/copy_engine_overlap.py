"""What a large all-reduce costs the GEMM it runs beside, on two GPUs: the question behind a
tensor-parallel prefill step's overlapped halves (LlamaModel._forward_overlapped).

Per rank, one run, three ways to move a prefill half's partial sums (`--mib`, default 32: 4,096
rows x 4,096 hidden x bf16) while a GEMM of a prefill half runs on the compute stream:
  gemm            the GEMM alone (4,096 x 4,096 @ 4,096 x 14,336: gate_up of an 8B model at
                  TP 2 for half of an 8,192-token step);
  nccl            NCCL's all-reduce of the message alone, then beside the GEMM (another stream);
  copy-engine     a copy of the whole message into the other rank's symmetric buffer
                  (cudaMemcpyAsync over NVLink: the copy engines, no SMs) alone, then beside the
                  GEMM.
Each figure is the median of `--iters` on rank 0 (CUDA events); "beside" times the pair from
the first launch to the last end, with the GEMM's own time inside it.

    python -m bench.copy_engine_overlap [--mib 32] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.allreduce import time_ms


def _rank(rank: int, port: int, mib: int, iters: int, out: str | None) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    numel = mib * (1 << 20) // 2
    msg = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    buf = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    theirs = handle.get_buffer(1 - rank, (numel,), torch.bfloat16)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def gemm():
        torch.mm(a, w.t())

    def nccl():
        dist.all_reduce(msg)

    def copy():
        theirs.copy_(msg)

    def beside(move):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                move()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return run

    for fn in (gemm, nccl, copy, beside(nccl), beside(copy)):  # warm up
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    row = {"mib": mib}
    for name, fn in (("gemm", gemm), ("nccl", nccl), ("copy_engine", copy),
                     ("gemm_beside_nccl", beside(nccl)),
                     ("gemm_beside_copy_engine", beside(copy))):
        row[f"{name}_ms"] = time_ms(fn, iters, meet=True)
    row["copy_engine_gb_per_s"] = mib * (1 << 20) / row["copy_engine_ms"] / 1e6
    row["nccl_algbw_gb_per_s"] = mib * (1 << 20) / row["nccl_ms"] / 1e6
    if rank == 0:
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime(
                    "%Y-%m-%d"), "torch": torch.__version__, **row}, f, indent=1)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from engine.tp.group import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(_rank, args=(free_port(), args.mib, args.iters, args.json), nprocs=2)


if __name__ == "__main__":
    main()
