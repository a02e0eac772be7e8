"""Rank 0's model runner of a tensor-parallel engine."""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from multiprocessing.connection import Connection

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, rank_device
from engine.models.parallel import TensorParallel
from engine.sampler import PendingSample
from engine.tp import worker
from engine.tp.group import free_port, join, leave
from kvcache.transfer.tp_peer import MappedPool

log = logging.getLogger("microserve.tp")

# exit status of the core process when a worker rank died: the frontend then exits, and `up`
# restarts the engine like any other that died
RANK_DIED_EXIT = 70


class TensorParallelRunner:
    """The ModelRunner the engine core sees, over config.tensor_parallel_size ranks: it starts
    the workers, holds rank 0's share itself (`local`) and sends each call that runs a
    collective to every worker before making it here. Everything else — attributes, the KV
    cache the core's KV sender writes into — is rank 0's runner's.

    A worker that dies ends the engine at once (a watchdog thread): the other ranks would
    otherwise wait on its next collective, and a rank cannot rejoin a group mid-run.
    Raises RuntimeError at start when a worker cannot start, with its reason.
    """

    def __init__(self, config: EngineConfig, dtype: torch.dtype):
        size = config.tensor_parallel_size
        _check_devices(config.device, size)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._closing = False
        self.rank_exports: list[dict] = []  # ranks 1.. pools' exports, when the engine moves KV
        self.rank_pools: list[torch.Tensor] = []  # every rank's pool, mapped here
        self._mapped: list[MappedPool] = []
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, size):
            # a fresh interpreter (CUDA cannot be forked; spawn would re-import our __main__),
            # given one end of a socket pair for rank 0's calls
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.tp.worker", "--rank", str(rank),
                 "--fd", str(theirs.fileno()), "--init-method", init_method,
                 "--config", json.dumps(asdict(config))],
                pass_fds=(theirs.fileno(),))  # fmt: skip
            theirs.close()
            self._conns.append(Connection(ours.detach()))
            self._procs.append(proc)
        try:
            # every rank loads its share at once, then they join: a rank that cannot load
            # says why before anyone waits on the group
            self.tp = TensorParallel(size, 0)
            self.local = ModelRunner(config, dtype, self.tp)
            for rank in range(1, size):
                self._wait_ready(rank)
            join(config, 0, init_method, self.tp, dtype, self.local.config.hidden_size)
        except BaseException:
            self.close()
            raise
        if self.local.lora is not None:
            self.lora = TensorParallelLora(self)
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}",
                             daemon=True).start()
        log.info("tensor parallel: %d ranks on %s", size,
                 ", ".join(str(d) for d in _rank_devices(config.device, size)))

    def _wait_ready(self, rank: int) -> None:
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        while not conn.poll(0.1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (status "
                                   f"{proc.returncode})")
        try:
            status, why = conn.recv()
        except EOFError:
            raise RuntimeError(f"tensor-parallel rank {rank} exited while starting (status "
                               f"{proc.wait()})") from None
        if status != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} did not start: {why}")

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def send_to(self, rank: int, name: str, *args, **kwargs) -> None:
        """A call for worker `rank` alone (data that differs per rank)."""
        assert name in worker.CALLS, name
        self._conns[rank - 1].send_bytes(_pickled(name, args, kwargs))

    def _send(self, name: str, *args, **kwargs) -> None:
        assert name in worker.CALLS, name
        data = _pickled(name, args, kwargs)
        for conn in self._conns:  # pickled once for all the workers
            conn.send_bytes(data)

    # ---- the calls with collectives -------------------------------------------------------

    def num_pages_for(self, max_model_len: int) -> int:
        self._send("num_pages_for", max_model_len)
        return worker.agreed_num_pages(self.tp, self.local.num_pages_for(max_model_len),
                                       self.local.device)

    def allocate_kv(self, num_pages: int, max_model_len: int, capture_graphs: bool = True,
                    pool: torch.Tensor | None = None, export: bool = False) -> None:
        """Every rank's pool (rank 0's on `pool`). With `export` (the engine moves KV), the
        workers' pools are in memory this process maps: `rank_pools` and `rank_exports`
        (kvcache/transfer/tp_peer.py)."""
        self._send("allocate_kv", num_pages, max_model_len, capture_graphs, export)
        self.local.allocate_kv(num_pages, max_model_len, capture_graphs, pool)
        self.local.kv.send_after_step = True
        if not export:
            return
        shape, dtype = self.local.kv_shape(num_pages), self.local.kv_dtype
        for rank in range(1, self.tp.size):
            status, export_info = self._conns[rank - 1].recv()
            assert status == "pool", status
            self.rank_exports.append(export_info)
            self._mapped.append(MappedPool(export_info, shape, dtype, self.local.device))
        self.rank_pools = [self.local.kv.kv] + [m.kv for m in self._mapped]

    def forward(self, *args, **kwargs) -> torch.Tensor | None:
        self._send("forward", *args, **kwargs)
        return self.local.forward(*args, **kwargs)

    def sample(self, logits: torch.Tensor, *args, **kwargs) -> PendingSample:
        pending = self.local.sample(logits, *args, **kwargs)
        self._send("take_sampled", pending.token_ids.shape[0])
        self.tp.broadcast(pending.token_ids)
        return pending

    def score(self, rows: list[int], token_ids: list[int], num_top: list[int]
              ) -> list[PendingSample]:
        self._send("score", rows)
        return self.local.score(rows, token_ids, num_top)

    # ---- life ---------------------------------------------------------------------------

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """End the engine when worker `rank` exits while it runs."""
        status = proc.wait()
        if self._closing:
            return
        log.error("tensor-parallel rank %d exited (status %s): the engine stops", rank, status)
        os._exit(RANK_DIED_EXIT)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to stop and wait for them (killed after `timeout_s`)."""
        self._closing = True
        for conn in self._conns:
            try:
                conn.send_bytes(_pickled("close", (), {}))
            except OSError:  # already gone
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        leave()


class TensorParallelLora:
    """Rank 0's LoRA slots over the ranks (the adapters' side of `runner.lora`): an adapter
    is packed once per rank by rank 0's loader thread (each rank its share, sliced as its
    projections are), and a slot write sends each worker its share before rank 0 writes its
    own, so a worker has the slot filled before the step that first reads it."""

    def __init__(self, runner: TensorParallelRunner):
        self._runner, self._local = runner, runner.local.lora

    def __getattr__(self, name: str):
        return getattr(self._local, name)

    def pack(self, adapter, slab=None) -> list:
        """Rank 0's share in `slab` (its slot writes copy from it), the workers' in new
        host tensors (they go pickled)."""
        return [self._local.pack(adapter, rank, slab if rank == 0 else None)
                for rank in range(self._runner.tp.size)]

    def write_slot(self, slot: int, packed: list | None, slab=None):
        for rank in range(1, self._runner.tp.size):
            self._runner.send_to(rank, "lora_write_slot", slot,
                                 None if packed is None else packed[rank])
        return self._local.write_slot(slot, None if packed is None else packed[0], slab)


def _pickled(name: str, args: tuple, kwargs: dict) -> bytes:
    """A call as the worker reads it. Plain pickle, not Connection.send's: that one passes
    tensors as handles to shared memory, which only a process of multiprocessing's own
    family may open; these go by value."""
    return pickle.dumps((name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def _rank_devices(device: str, size: int) -> list[torch.device]:
    return [rank_device(device, rank) for rank in range(size)]


def _check_devices(device: str, size: int) -> None:
    """Refuse a CUDA engine whose ranks would need GPUs the machine does not have."""
    last = _rank_devices(device, size)[-1]
    if last.type == "cuda" and last.index >= torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} on {device} needs GPUs up to cuda:"
                         f"{last.index}; this machine has {torch.cuda.device_count()}")
