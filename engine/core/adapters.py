"""The engine core's LoRA adapters: registering them (start-up, /v1/load_lora_adapter), which
request uses which (a side table of the core), and which adapter sits in which of the model
runner's slots (the scheduler's `AdapterSlots`).

Registering reads and checks the adapter from disk once and keeps its weights in host memory,
laid out as a slot holds them (in the model's dtype, in a slab pinned ahead of time on CUDA:
rank 16 over every projection of Llama-3.1-8B is 84 MB; engine/lora/host.py). A runtime load
reads in a thread, so the step loop goes on meanwhile; the loop registers the adapter once it
is read (`poll`), and the thread then pins the next spare slab. A slot is filled when
a request of it is admitted and its adapter is not resident, evicting the least recently used
idle adapter if every slot is taken (S-LoRA's host-to-GPU scheme). A copy into a slot cannot
fail, so admission never has to undo one.

With `max_cpu_loras`, at most that many host copies are kept: past it the least recently used
one is dropped (its slab goes back for the next read), and an adapter whose copy is gone is
read back from disk by the loader thread when a request of it needs a slot; the request waits
meanwhile (holding no one up). A read back that fails (the files gone or changed) fails the
adapter's waiting requests with a 500 naming it; the adapter stays registered.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.config import EngineConfig
from engine.lora.adapter import read_adapter, resolve_path
from engine.lora.host import Slabs
from engine.lora.layers import PackedAdapter
from engine.lora.registry import Adapter, LoraRegistry
from engine.model_runner import ModelRunner
from engine.sequence import Sequence
from kvcache.integrity import IntegrityError
from microserve.backend import MicroservingError, RequestRejected
from microserve.messages import LoadLoraResponse, SamplingParams, UnloadLoraResponse

log = logging.getLogger("engine.core")


def load_key(name: str) -> str:
    """The key a deferred /v1/load_lora_adapter call is answered under (handlers' `poll`)."""
    return f"lora-load:{name}"


class EngineAdapters:
    """Args: config (lora_modules, max_loras, max_lora_rank, lora_dir), runner (whose `lora`
    holds the slots), notify (called from the loader thread when a load is done: wakes the
    core's loop). Raises ValueError at construction for a bad --lora-modules adapter."""

    what = "LoRA adapters"  # a RequestSideTable's

    def __init__(self, config: EngineConfig, runner: ModelRunner,
                 notify: Callable[[], None] = lambda: None):
        self.config, self.runner = config, runner
        self.registry = LoraRegistry(config.max_loras)
        self._packed: dict[int, PackedAdapter] = {}  # adapter id -> its host copy
        # the host copies' memory: adapter id -> its slab, and the last slot write's copies
        # from it (an event on CUDA), which must end before the slab is written again
        self._slabs = Slabs(runner.lora.layout, pin=runner.device.type == "cuda")
        self._slab_of: dict[int, list] = {}
        self._copied: dict[int, object] = {}
        self._of: dict[str, Adapter] = {}  # request id -> the adapter it uses
        # runtime loads read and check from disk in this thread, off the step loop; the
        # loop registers each when done (`poll`). name -> (its read, its path)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._loading: dict[str, tuple[Future, Path]] = {}
        # host copies, least recently used first (max_cpu_loras), the reads back from disk of
        # dropped ones (adapter id -> its read), and the adapters whose read back failed since
        # `take_failed` (id, why)
        self._host: OrderedDict[int, None] = OrderedDict()
        self._reading_back: dict[int, Future] = {}
        self._failed: list[tuple[int, str]] = []
        self._notify = notify
        self.counters = {"lora_loads": 0, "lora_load_seconds": 0.0, "lora_slot_writes": 0,
                         "lora_slot_write_seconds": 0.0, "lora_reads_back": 0}
        for name, path in config.lora_modules:
            self.load(name, resolve_path(path, None))
        if config.lora_dir is not None:  # runtime loads take this one
            self._slabs.reserve(1, pause_s=0.0)  # before serving: nothing to pause for

    # ---- registering --------------------------------------------------------------------------

    def load(self, name: str, path: Path) -> LoadLoraResponse:
        """Read, check and register the adapter at `path` as `name` now (start-up); it goes
        into a free slot if there is one. Raises ValueError naming the problem."""
        self._check_name(name)
        return self._register(name, path, *self._read(name, path))

    def load_call(self, name: str, path: str) -> None:
        """/v1/load_lora_adapter: `path` must be inside --lora-dir. Starts the read in the
        loader thread and returns None: `poll` answers the call (under `load_key(name)`)."""
        if self.config.lora_dir is None:
            raise MicroservingError(400, "loading adapters at runtime needs --lora-dir (the "
                                    "directory lora_path must be inside)", "lora_path")
        try:
            self._check_name(name)
            resolved = resolve_path(path, self.config.lora_dir)
        except ValueError as e:
            raise MicroservingError(400, str(e), "lora_path") from None
        future = self._loader.submit(self._read, name, resolved)
        future.add_done_callback(lambda _: self._notify())
        self._loading[name] = (future, resolved)
        self._loader.submit(self._slabs.reserve, 1)  # the next load's, pinned off its path

    def poll(self) -> list[tuple[str, LoadLoraResponse | MicroservingError]]:
        """(load_key(name), answer) of each runtime load the loader thread has finished,
        registered now (a refusal: the 400 naming the problem); and the host copies read back
        since, kept (or, for a read that failed, the adapter noted for `take_failed`)."""
        self._settle_reads_back()
        answers = []
        for name, (future, path) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            try:
                answer = self._register(name, path, *future.result())
            except (ValueError, OSError) as e:  # OSError: the disk, mid-read
                answer = MicroservingError(400, str(e), "lora_path")
            answers.append((load_key(name), answer))
        return answers

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    def _check_name(self, name: str) -> None:
        if name in self.registry.adapters or name in self._loading:
            raise ValueError(f"an adapter named {name!r} is already loaded; unload it first")

    def _read(self, name: str, path: Path) -> tuple[int, PackedAdapter, list, float, float]:
        """(rank, the adapter packed for the slots, the slab it is packed in, seconds checking
        it (its config and its file's header), seconds reading its data into the slab): no
        device work, any thread."""
        start = time.perf_counter()
        weights = read_adapter(name, path, self.runner.config, self.config.max_lora_rank)
        read_s = time.perf_counter() - start
        slab = self._slabs.take()
        try:
            packed = self.runner.lora.pack(weights, slab=slab)
        except BaseException:
            self._slabs.give(slab, None)
            raise
        return weights.rank, packed, slab, read_s, time.perf_counter() - start - read_s

    def _register(self, name: str, path: Path, rank: int, packed: PackedAdapter, slab: list,
                  read_s: float, pack_s: float) -> LoadLoraResponse:
        start = time.perf_counter()
        try:
            adapter = self.registry.register(name, str(path))
        except ValueError:
            self._slabs.give(slab, None)
            raise
        self._keep_host_copy(adapter.id, packed, slab)
        resident = self._fill_free_slot(adapter)
        register_s = time.perf_counter() - start
        elapsed = read_s + pack_s + register_s
        self.counters["lora_loads"] += 1
        self.counters["lora_load_seconds"] += elapsed
        log.info("LoRA adapter %r (rank %d) loaded from %s in %.1f ms (checking %.1f, reading "
                 "into host memory %.1f, registering and a slot write %.1f)", name, rank, path,
                 elapsed * 1e3, read_s * 1e3, pack_s * 1e3, register_s * 1e3)
        return LoadLoraResponse(name, rank, resident, elapsed)

    def _forget(self, adapter: Adapter) -> None:
        """An adapter is gone: its host copy's slab back for the next load (a read back still
        running gives its slab back when it ends: `_settle_reads_back`)."""
        self._drop_host_copy(adapter.id)

    # ---- host copies (max_cpu_loras) ----------------------------------------------------------

    def _keep_host_copy(self, adapter_id: int, packed: PackedAdapter, slab: list) -> None:
        """Keep an adapter's host copy as the most recently used, dropping the least recently
        used ones past max_cpu_loras."""
        self._packed[adapter_id], self._slab_of[adapter_id] = packed, slab
        self._host[adapter_id] = None
        cap = self.config.max_cpu_loras
        while cap is not None and len(self._host) > cap:
            self._drop_host_copy(next(iter(self._host)))

    def _drop_host_copy(self, adapter_id: int) -> None:
        """The slab goes back once its last slot write has copied it (Slabs.take waits)."""
        if self._host.pop(adapter_id, False) is not False:
            self._packed.pop(adapter_id)
            self._slabs.give(self._slab_of.pop(adapter_id), self._copied.pop(adapter_id, None))

    def _read_back(self, adapter: Adapter) -> None:
        """Read a dropped host copy back from disk, in the loader thread (once at a time)."""
        if adapter.id in self._reading_back:
            return
        future = self._loader.submit(self._read, adapter.name, Path(adapter.path))
        future.add_done_callback(lambda _: self._notify())
        self._reading_back[adapter.id] = future
        self.counters["lora_reads_back"] += 1

    def _settle_reads_back(self) -> None:
        for adapter_id, future in list(self._reading_back.items()):
            if not future.done():
                continue
            del self._reading_back[adapter_id]
            adapter = self.registry.get(adapter_id)
            try:
                _, packed, slab, _, _ = future.result()
            except (ValueError, OSError) as e:
                if adapter is not None:
                    log.warning("LoRA adapter %r could not be read back from %s: %s",
                                adapter.name, adapter.path, e)
                    self._failed.append((adapter_id, str(e)))
                continue
            if adapter is None:  # unloaded meanwhile
                self._slabs.give(slab, None)
            else:
                self._keep_host_copy(adapter_id, packed, slab)

    def take_failed(self) -> list[tuple[int, str]]:
        """The adapters (id, why) whose read back failed since the last call: the core fails
        their waiting requests."""
        failed, self._failed = self._failed, []
        return failed

    def unload(self, name: str) -> UnloadLoraResponse:
        try:
            gone = self.registry.unregister(name)
        except KeyError:
            raise MicroservingError(404, f"no LoRA adapter named {name!r} is loaded (loaded: "
                                    f"{', '.join(self.registry.registered()) or 'none'})",
                                    "lora_name") from None
        if gone is not None:
            self._forget(gone)
        return UnloadLoraResponse(name, pending=gone is None)

    # ---- the side table: which request uses which adapter -------------------------------------

    def admit(self, request_id: str, params: SamplingParams) -> None:
        if params.lora_name is None:
            return
        adapter = self.registry.lookup(params.lora_name)
        if adapter is None:
            raise RequestRejected(
                f"The model '{params.lora_name}' does not exist: no LoRA adapter of that name "
                f"is loaded (loaded: {', '.join(self.registry.registered()) or 'none'})",
                "model")
        self.registry.add_user(adapter)
        self._of[request_id] = adapter

    def remove(self, request_id: str) -> None:
        adapter = self._of.pop(request_id, None)
        if adapter is not None:
            self._drop_user(adapter)

    def _drop_user(self, adapter: Adapter) -> None:
        if (gone := self.registry.remove_user(adapter)) is not None:
            self._forget(gone)  # unloaded while in use: its last request left

    def request_ids(self):
        return self._of.keys()

    def id_of(self, name: str) -> int:
        """The id of the adapter registered as `name`, for a KV exchange call naming it (its
        lora_name). Raises a 404 naming the adapter and those loaded."""
        adapter = self.registry.lookup(name)
        if adapter is None:
            raise MicroservingError(
                404, f"no LoRA adapter named {name!r} is loaded on this engine (loaded: "
                f"{', '.join(self.registry.registered()) or 'none'}): load it here first "
                "(/v1/load_lora_adapter) or route the request to an engine that has it",
                "lora_name", code="model_not_found")
        return adapter.id

    def lora_id(self, request_id: str) -> int:
        """The id of the adapter the request uses (its sequence's lora_id); 0: the base."""
        adapter = self._of.get(request_id)
        return 0 if adapter is None else adapter.id

    # ---- slots (the scheduler's AdapterSlots) -------------------------------------------------

    def acquire(self, seq: Sequence) -> bool:
        adapter = self.registry.by_id(seq.lora_id)
        if adapter.slot is None:
            if adapter.id not in self._host:  # dropped (max_cpu_loras): read it back first
                self._read_back(adapter)
                return False
            claimed = self.registry.claim_slot(adapter)
            if claimed is None:
                return False
            self._write(claimed[0], adapter)
        self.registry.start_running(adapter)
        if adapter.id in self._host:
            self._host.move_to_end(adapter.id)
        return True

    def release(self, seq: Sequence) -> None:
        self.registry.stop_running(self.registry.by_id(seq.lora_id))

    def hold(self, seq: Sequence) -> None:
        self.registry.add_user(self.registry.by_id(seq.lora_id))

    def let_go(self, seq: Sequence) -> None:
        self._drop_user(self.registry.by_id(seq.lora_id))

    def slot_of(self, seq: Sequence) -> int:
        """The slot a running sequence's tokens use (-1: the base model)."""
        return -1 if not seq.lora_id else self.registry.by_id(seq.lora_id).slot

    def _fill_free_slot(self, adapter: Adapter) -> bool:
        if not self.registry.has_free_slot():
            return False
        slot, _ = self.registry.claim_slot(adapter)
        self._write(slot, adapter)
        return True

    def _write(self, slot: int, adapter: Adapter) -> None:
        start = time.perf_counter()
        self._copied[adapter.id] = self.runner.lora.write_slot(
            slot, self._packed[adapter.id], self._slab_of[adapter.id])
        self.counters["lora_slot_writes"] += 1
        self.counters["lora_slot_write_seconds"] += time.perf_counter() - start

    def stats(self) -> dict:
        return {"lora_registered": self.registry.registered(),
                "lora_resident": self.registry.resident(), "lora_loading": list(self._loading),
                "lora_host_slabs": self._slabs.allocated, "lora_host_copies": len(self._host),
                **self.counters}

    def check_integrity(self) -> None:
        self.registry.check_integrity()
        ids = {a.id for a in self.registry.adapters.values()}
        kept = set(self._host)
        if self._packed.keys() != kept or self._slab_of.keys() != kept or not kept <= ids:
            raise IntegrityError("host weights kept for other adapters than the registered")
        cap = self.config.max_cpu_loras
        if (cap is None and kept != ids) or (cap is not None and len(kept) > cap):
            raise IntegrityError(f"{len(kept)} host copies kept for {len(ids)} adapters "
                                 f"(max_cpu_loras {cap})")
