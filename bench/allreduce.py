"""All-reduce latency at the sizes a tensor-parallel step sums, side by side in one run: NCCL
through torch.distributed, the engine's one-shot all-reduce over symmetric memory
(engine/tp/allreduce.py: its Triton kernel, `one-shot`) and torch's (`torch-one-shot`,
symm_mem.one_shot_all_reduce_copy), torch's two-shot, and the engine's copy-engine exchange of
two ranks' large messages (engine/tp/exchange.py, `copy-engine`: eager only, as the engine uses
it), each launched one by one (eager) and replayed from a CUDA graph (how decode steps run),
per size.

A decode step of an 8B model at batch B all-reduces B x 4,096 bf16 values twice per layer:
8 KiB at batch 1, 1 MiB at batch 128. The figure per size is the median time of one
all-reduce over `--iters`, measured with CUDA events on rank 0 (the ranks are in step after
the first barrier).

    python -m bench.allreduce --ranks 2 --sizes-kib 8,32,128,512,1024
        [--impls nccl,one-shot,torch-one-shot] [--json out.json]
    python -m bench.allreduce --sizes-kib 2048,8192,32768,65536 --impls nccl,copy-engine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


IMPLS = ("nccl", "one-shot", "torch-one-shot", "torch-two-shot", "copy-engine")
EAGER_ONLY = ("copy-engine",)  # its call counts cannot be replayed from a graph


def time_ms(fn, iters: int, meet: bool = False) -> float:
    """Median ms of `fn` over `iters` calls, each between two CUDA events; `meet`: the ranks
    meet (a barrier, the GPU idle) before each call."""
    times = []
    for _ in range(iters):
        if meet:
            dist.barrier()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class _TwoShot:
    """torch's two-shot all-reduce over symmetric memory (each rank sums 1/ranks of the
    message from every rank's buffer, then writes it to all), for large messages: the message
    copied into a symmetric buffer, summed there in place."""

    def __init__(self, max_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device="cuda")
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer[: x.numel()]
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
        return buf


def _rank(rank: int, ranks: int, port: int, sizes_kib: list[int], iters: int, out: str | None,
          impls: list[str]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks, device_id=torch.device("cuda", rank))
    dist.all_reduce(torch.ones(1, device="cuda"))
    from engine.tp.allreduce import OneShotAllReduce

    ops = {"nccl": dist.all_reduce}
    if "copy-engine" in impls:
        from engine.tp.exchange import PeerExchange

        exchange = PeerExchange(None, torch.device("cuda", rank), torch.bfloat16,
                                max(sizes_kib) * 1024)
        ops["copy-engine"] = lambda x: exchange.start(x).wait()
    if "torch-two-shot" in impls:
        ops["torch-two-shot"] = _TwoShot(max(sizes_kib) * 1024)
    for impl, kernel in (("one-shot", "triton"), ("torch-one-shot", "torch")):
        if impl in impls:
            ops[impl] = OneShotAllReduce(None, torch.device("cuda", rank), torch.bfloat16,
                                         max(sizes_kib) * 1024, kernel=kernel)
    rows = []
    per_graph = 20  # all-reduces captured in one graph: its replay time / 20 is one's
    for kib in sizes_kib:
        x = torch.randn(kib * 1024 // 2, dtype=torch.bfloat16, device="cuda")
        row = {"kib": kib}
        for impl in impls:
            op = ops[impl]
            for _ in range(10):
                op(x)
            torch.cuda.synchronize()
            dist.barrier()
            eager = time_ms(lambda: op(x), iters)
            prefix = "" if impl == "nccl" else impl.replace("-", "_") + "_"
            row[f"{prefix}eager_us"] = eager * 1e3
            if impl in EAGER_ONLY:
                continue
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for _ in range(per_graph):
                    op(x)
            torch.cuda.synchronize()
            dist.barrier()
            graphed = time_ms(graph.replay, max(1, iters // per_graph)) / per_graph
            row[f"{prefix}graph_us"] = graphed * 1e3  # unprefixed: NCCL's (earlier JSON files)
        if "graph_us" in row and "one_shot_graph_us" in row:
            row["one_shot_over_nccl_graph"] = row["one_shot_graph_us"] / row["graph_us"]
        if "torch_one_shot_graph_us" in row and "one_shot_graph_us" in row:
            row["one_shot_over_torch_graph"] = (row["one_shot_graph_us"]
                                                / row["torch_one_shot_graph_us"])
        rows.append(row)
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0 and out:
        with open(out, "w") as f:
            json.dump({"ranks": ranks, "device": torch.cuda.get_device_name(),
                       "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows},
                      f, indent=1)  # fmt: skip
    # no destroy_process_group: with captured graphs alive it waited past a 2-minute timeout
    # (2xH200); the process's exit frees the communicator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes-kib", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--impls", default="nccl,one-shot,torch-one-shot",
                    help="any of nccl, one-shot (the engine's), torch-one-shot, "
                         "torch-two-shot, copy-engine (two ranks)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    impls = args.impls.split(",")
    if not set(impls) <= set(IMPLS):
        ap.error(f"--impls: {', '.join(IMPLS)} only, got {args.impls}")
    from engine.tp.group import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (lent machines)
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    mp.spawn(_rank, args=(args.ranks, free_port(), sizes, args.iters, args.json, impls),
             nprocs=args.ranks)


if __name__ == "__main__":
    main()
