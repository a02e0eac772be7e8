"""A worker rank of a tensor-parallel engine: replays rank 0's runner calls on its share.

It reads (call, args, kwargs) from its pipe to rank 0 and makes the same call on its own
ModelRunner. What rank 0 alone does (sampling, penalties, grammars) does not reach it; what
it must mirror is every call that runs a collective, in rank 0's order: `CALLS`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, resolve_dtype
from engine.models.parallel import TensorParallel
from engine.tp.group import die_with_parent, join
from kvcache.transfer.tp_peer import export_pool

log = logging.getLogger("microserve.tp")


def agreed_num_pages(tp: TensorParallel, num_pages: int, device: torch.device) -> int:
    """The KV pool every rank can hold: the smallest of the ranks' `num_pages` (collective)."""
    n = torch.tensor([num_pages], dtype=torch.long, device=device)
    if tp.size > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp.group)
    return int(n.item())


class WorkerCalls:
    """The calls rank 0 sends, each the worker's half of a TensorParallelRunner method."""

    def __init__(self, runner: ModelRunner, conn: Connection):
        self.runner, self._conn = runner, conn

    def forward(self, *args, sends=(), **kwargs) -> None:
        # the logits' gather included; rank 0 samples, and rank 0 sends every rank's KV
        self.runner.forward(*args, **kwargs)

    def take_sampled(self, rows: int) -> None:
        """Rank 0's sampled tokens of the last step: the next step's `from_last` inputs."""
        r = self.runner
        r.use_sampled(r.tp.broadcast(torch.empty(rows, dtype=torch.long, device=r.device)))

    def score(self, rows: list[int]) -> None:
        for _ in self.runner.score_logits(rows):  # the gathers; rank 0 scores
            pass

    def allocate_kv(self, num_pages: int, max_model_len: int, capture_graphs: bool = True,
                    export: bool = False) -> None:
        """Allocate the rank's pool; with `export`, in memory rank 0 can map (its KV moves
        through rank 0's transfers), and answer rank 0 with the export."""
        pool = None
        if export:
            r = self.runner
            pool, info = export_pool(r.kv_shape(num_pages), r.kv_dtype, r.device)
            self._conn.send(("pool", info))
        self.runner.allocate_kv(num_pages, max_model_len, capture_graphs, pool)

    def lora_write_slot(self, slot: int, packed) -> None:
        """This rank's share of an adapter (packed by rank 0) into `slot` (None: empty it)."""
        self.runner.lora.write_slot(slot, packed)

    def num_pages_for(self, max_model_len: int) -> None:
        r = self.runner
        agreed_num_pages(r.tp, r.num_pages_for(max_model_len), r.device)


CALLS = frozenset(name for name in vars(WorkerCalls) if not name.startswith("_"))


def main(argv: list[str] | None = None) -> None:
    """The worker process: build the rank's runner, report ready (or why not) to rank 0,
    join the group, then replay calls until rank 0 says close or goes away. Any error in a
    call ends the process (rank 0's watchdog then ends the engine: a rank that missed a
    collective cannot rejoin the others)."""
    ap = argparse.ArgumentParser(description="a worker rank of a tensor-parallel engine "
                                             "(started by its engine core)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--fd", type=int, required=True, help="socket to rank 0")
    ap.add_argument("--init-method", required=True, help="the group's rendezvous address")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    rank, init_method, conn = args.rank, args.init_method, Connection(args.fd)
    config = json.loads(args.config)
    die_with_parent()
    logging.basicConfig(level=os.environ.get("MICROSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s core[rank {rank}]: %(message)s")
    try:
        engine_config = EngineConfig(**config)
        if engine_config.cpu_threads is not None:
            torch.set_num_threads(engine_config.cpu_threads)
        runner = ModelRunner(engine_config,
                             resolve_dtype(engine_config.dtype, engine_config.device),
                             TensorParallel(engine_config.tensor_parallel_size, rank))
    except Exception as e:
        traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", None))
    join(engine_config, rank, init_method, runner.tp, runner.dtype,
         runner.config.hidden_size)
    calls = WorkerCalls(runner, conn)
    with torch.inference_mode():
        while True:
            try:
                name, args, kwargs = conn.recv()
            except EOFError:  # rank 0 is gone
                break
            if name == "close":
                break
            getattr(calls, name)(*args, **kwargs)  # raises: the process exits non-zero
    # no teardown of the group: rank 0 is leaving it too, and the process's end frees the
    # device (an orderly NCCL destroy can wait on the other ranks forever)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
