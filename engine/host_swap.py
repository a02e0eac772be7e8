"""The host KV tier's memory and copies (`--kv-host-memory-gb`): where a preempted sequence's
KV goes instead of being dropped, and how it comes back. The bookkeeping (which host pages a
sequence holds, its state) is kvcache/host_tier.py's HostTier; this is the one module of the
tier that holds tensors.

Layouts. The GPU pool is layer-major, `kv[layer, K|V, page, slot, head, dim]`, so one page is
`layers x 2` fragments (64 of 32 KiB for an 8B model). The host pool is page-major,
`host[page, layer, K|V, slot, head, dim]`: a host page is one contiguous block, and pages the
host pool hands out together are mostly adjacent (its free list is LIFO). A swap's copy on a
GPU is one Triton kernel with a small grid that moves every fragment straight between the pool
and the pinned host pages (engine/kernels/host_pages.py): no staging buffer, no copy engine, and
at most `copy_programs` SMs taken from the step beside it. A copy that steps run beside (a
proactive copy out, a prefetch back) takes the narrower `beside_programs` grid: what slows a
decode step beside a copy is the copy's rate over PCIe while it runs (on an H200 the same bytes,
both ways in turn, cost a step 8-9% at 16 programs, 48 GB/s, or by DMA, against 2.5% at 4
programs; between two device buffers 0.6%: docs/benchmarks.md, "What slows a decode step
beside the host tier's copies"), and such a copy has steps' time to land in. A copy the GPU would otherwise wait for
(a page short, an admission's copy back, the start-up measurement) takes the wide grid. Where
that kernel does not apply (a tensor-parallel engine's several pools, `copy_programs=0`) and
for the prefix cache's demotions below, a copy is staged:

    GPU pages --gather (one index_select on the device)--> staging [n, layer, K|V, ...]
    staging --one DMA per run of adjacent host pages--> host pages

and the reverse on the way in (DMA into staging, then one index_copy_ into the pool): a
device-to-device pass (GB/s in the hundreds) turns 64 small DMAs a page into one large one.
Staged copies slowed a decode step beside them 9-10% on an H200 (docs/benchmarks.md, "A decode
step beside the host tier's copies"); `bench/host_copy.py` measures each way's rate. What that
costs depends on the way: one way at a time beside the same steps (docs/benchmarks.md, "The
host tier's copies one way at a time"), a DMA out cost nothing (-0.3%) and a DMA in 16%, where
the kernel cost 12% out and 3% in at 16 programs (1.7% and 2.8-3.4% at 4). So the demotions
below (a DMA out) need no narrow grid.

On CUDA the copies run on a stream of their own. A copy out first waits for the compute
stream (the step in flight may still be writing the pages); the GPU pages stay held until its
event completes (`poll`, or `settle_out` when the scheduler needs them now). A copy in waits
for the compute stream too (its pages may have been another sequence's a moment ago), and the
compute stream waits for it before the forward that runs the sequence (`before_forward`): the
host never blocks on a copy in. On CPU every copy is a plain, finished copy.

A tensor-parallel engine's pages are split over its ranks' pools (each its share of the KV
heads): rank 0's process maps them all (kvcache/transfer/tp_peer.py) and copies every rank's
share of a page, so a host page is `[rank, layer, K|V, slot, head, dim]`. The other ranks
compute on streams of their own, which wait for nothing of rank 0's: so on GPUs each copy of
such an engine is waited for on the host before the call that made it returns (no overlap),
and no rank's next step can read a page before it is loaded, or write one before it is saved.

The prefix cache's second level (kvcache/prefix_host.py) uses the same pool and layout through
`demote` and `load`, in the order the bookkeeping issues them. A demotion's gather runs on the
compute stream, so a page is read before the pool hands it to anyone else; its DMA to the host
runs on a stream of its own (after that gather), off the steps' path and apart from the swaps'
copies, its staging buffer held for that stream (`record_stream`); a swap's copy out, whose
host pages may have been a demotion's a moment ago, waits for the demotions before it. A load
runs on the compute stream, after the demotions in flight (it may read one of their pages), so
the forward that reads a loaded page comes after its load, without host waits. Where copies
are synchronous (CPU, tensor parallel), both are plain copies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from engine.device import to_device
from engine.kernels.host_pages import copy_host_pages
from kvcache.host_tier import HostState, HostTier, swap_or_recompute
from kvcache.integrity import IntegrityError


class HostSwap:
    """Args:
        gpu_kv: the GPU pool, `[layers, 2, pages, page_size, kv_heads, head_dim]`.
        memory_gb: host memory for the pool (rounded down to whole pages).
        copy_gbps: the copy rate to assume, one way; None: measured (`measure_copy_rate`).
        rank_pools: a tensor-parallel engine's ranks' pools, rank 0's (`gpu_kv`) first, mapped
            into this process; a host page then holds every rank's share.
        copy_programs: the grid of the swaps' copy kernel (engine/kernels/host_pages.py); 0:
            staged copies (a gather, then DMAs); None: COPY_PROGRAMS on a GPU, staged on CPU
            (where the kernel runs only under Triton's interpreter, for tests).
        dma_pages: a staged copy's DMAs move at most this many pages each (None: a whole run
            of adjacent host pages; 4 pages cost a step beside them as much as whole runs on
            an H200: a diagnosis, not a remedy).
        beside_programs: the copy kernel's grid for copies that steps run beside (`beside`
            in swap_out and swap_in); None: BESIDE_PROGRAMS, or copy_programs if smaller.
    """

    # the copy kernel's default grid: on an H200 (docs/benchmarks.md, "The host tier's copies by
    # kernel") 16 programs copied 48 GB/s each way and slowed a decode step beside them 8%,
    # against 9% at 32, 11% at 64 and 9-10% for the staged copies; 8 slowed it 6% but copied
    # in at 37 GB/s
    COPY_PROGRAMS = 16
    # the grid for copies beside steps: on an H200 4 programs slowed a decode step beside a loop
    # of 64-page copies 2.2-2.6% (2 programs: 1%, 8: 6.3%, 16: 6.7-8.8%) and moved as many bytes
    # in that loop as 16, each copy landing within a step or two (alone: 49 GB/s out, 21 in)
    BESIDE_PROGRAMS = 4

    def __init__(self, gpu_kv: torch.Tensor, memory_gb: float, copy_gbps: float | None = None,
                 rank_pools: list[torch.Tensor] | None = None,
                 copy_programs: int | None = None, dma_pages: int | None = None,
                 beside_programs: int | None = None):
        self.gpu_kv = gpu_kv
        # a tensor-parallel engine's ranks' pools, rank 0's (gpu_kv) first, mapped here
        self.pools = rank_pools if rank_pools and len(rank_pools) > 1 else [gpu_kv]
        layers, _, _, page_size, heads, dim = gpu_kv.shape
        self.page_shape = (layers, 2, page_size, heads, dim)
        if len(self.pools) > 1:
            self.page_shape = (len(self.pools), *self.page_shape)
        self.page_bytes = gpu_kv[:, :, 0].numel() * gpu_kv.element_size() * len(self.pools)
        num_pages = int(memory_gb * 2**30 // self.page_bytes)
        if num_pages < 1:
            raise ValueError(f"kv_host_memory_gb {memory_gb} holds no KV page "
                             f"({self.page_bytes} bytes each)")
        self.cuda = gpu_kv.device.type == "cuda"
        self.host = torch.empty((num_pages, *self.page_shape), dtype=gpu_kv.dtype,
                                pin_memory=self.cuda)
        self.tier = HostTier(num_pages, page_size)
        self.stream = torch.cuda.Stream(gpu_kv.device) if self.cuda else None
        if copy_programs is None:
            copy_programs = self.COPY_PROGRAMS if self.cuda else 0
        if copy_programs < 0:
            raise ValueError(f"copy_programs must be >= 0, got {copy_programs}")
        # the swaps' copies by kernel, straight between the pool and the pinned host pages
        self.copy_programs = copy_programs if len(self.pools) == 1 else 0
        if beside_programs is None:
            beside_programs = min(self.BESIDE_PROGRAMS, self.copy_programs)
        if self.copy_programs and not 1 <= beside_programs <= self.copy_programs:
            raise ValueError(f"beside_programs must be in [1, copy_programs {self.copy_programs}]"
                             f", got {beside_programs}")
        self.beside_programs = beside_programs if self.copy_programs else 0
        if self.cuda and self.copy_programs:
            self._warm_up()
        if dma_pages is not None and dma_pages < 1:
            raise ValueError(f"dma_pages must be >= 1, got {dma_pages}")
        self.dma_pages = dma_pages
        # the prefix cache's demotions' DMAs: apart from the swaps', so that a swap's copy back
        # (host to device) never waits behind a batch of demotions (device to host)
        self.demotion_stream = torch.cuda.Stream(gpu_kv.device) if self.cuda else None
        # every copy waited for on the host: the other ranks' streams wait for no event here
        self._wait_each = self.cuda and len(self.pools) > 1
        # a copy has landed when its call returns
        self.synchronous = not self.cuda or self._wait_each
        # seq id -> (the copy's event, the staging tensor it reads or writes)
        self._in_flight: dict[str, tuple[torch.cuda.Event, torch.Tensor]] = {}
        self.copy_bytes_per_s = copy_gbps * 1e9 if copy_gbps else None
        self.prefill_s: Callable[[int], float] | None = None  # set by the engine (its profile)
        # the last prefix-cache copy (demote, load) not waited for by `settle` (CUDA)
        self._last_prefix_copy: torch.cuda.Event | None = None
        # the last demotion's DMA on the demotion stream, until a load makes the compute
        # stream wait for it (CUDA, copies beside compute)
        self._last_demotion: torch.cuda.Event | None = None
        self.counters = {"kv_swap_outs": 0, "kv_swap_ins": 0, "kv_swap_out_bytes": 0,
                         "kv_swap_in_bytes": 0, "kv_swap_recomputes": 0,
                         "kv_swap_copies_beside": 0, "kv_host_prefix_demoted_pages": 0,
                         "kv_host_prefix_loaded_pages": 0}

    # ---- the scheduler's calls (engine/swap_scheduling.py, KVSwapper) -------------------------

    def state(self, seq_id: str) -> HostState | None:
        return self.tier.state(seq_id)

    def would_swap(self, num_tokens: int, recompute_tokens: int) -> bool:
        """Whether a sequence holding `num_tokens` of KV, of which recomputing would compute
        `recompute_tokens`, is cheaper to swap than to recompute (counts nothing)."""
        return (self.prefill_s is not None and self.copy_bytes_per_s is not None
                and swap_or_recompute(num_tokens, recompute_tokens,
                                      self.page_bytes // self.tier.page_size,
                                      self.copy_bytes_per_s, self.prefill_s,
                                      copy_out_overlapped=self.cuda) == "swap")

    def wants(self, num_tokens: int, recompute_tokens: int) -> bool:
        """`would_swap` for a sequence being preempted: counted as a recompute if not."""
        swap = self.would_swap(num_tokens, recompute_tokens)
        self.counters["kv_swap_recomputes"] += not swap
        return swap

    def swap_out(self, seq_id: str, gpu_pages: list[int], num_tokens: int,
                 beside: bool = False) -> bool:
        """Start copying `num_tokens` of KV from `gpu_pages` to the host; `beside`: steps run
        while it does (the narrow grid). False, copying nothing, if the host pool is short
        (the caller recomputes it instead)."""
        host_pages = self.tier.reserve(seq_id, num_tokens)
        if host_pages is None:
            self.counters["kv_swap_recomputes"] += 1
            return False
        assert len(host_pages) == len(gpu_pages), (host_pages, gpu_pages)
        with self._on_copy_stream(after_demotions=True):
            staging = self._copy_out(gpu_pages, host_pages, self._grid(beside))
        self._wait_if_ranks()
        self._finish_or_track(seq_id, staging)
        if self.synchronous:
            self.tier.copied_out(seq_id)
        self.counters["kv_swap_outs"] += 1
        self.counters["kv_swap_out_bytes"] += len(gpu_pages) * self.page_bytes
        return True

    def settle_out(self, seq_id: str) -> None:
        """Wait for a copy out to land (the scheduler needs its GPU pages now)."""
        if self.tier.state(seq_id) is HostState.COPYING_OUT:
            self._in_flight.pop(seq_id)[0].synchronize()
            self.tier.copied_out(seq_id)

    def swap_in(self, seq_id: str, gpu_pages: list[int], skip: int = 0,
                beside: bool = False) -> int:
        """Start copying a HELD sequence's KV into `gpu_pages` (as many as it held), but for
        the first `skip`, which the GPU pool holds already (the prefix cache kept them);
        `beside`: steps run while it does (the narrow grid).
        Returns the tokens restored; the next forward waits for the copy (`before_forward`).
        With nothing to copy it is back at once (its host pages freed)."""
        host_pages = self.tier.start_in(seq_id)
        assert len(host_pages) == len(gpu_pages) and 0 <= skip <= len(gpu_pages), (
            host_pages, gpu_pages, skip)
        num_tokens = self.tier.num_tokens(seq_id)
        if skip == len(gpu_pages):
            self.tier.copied_in(seq_id)
        else:
            with self._on_copy_stream():
                staging = self._copy_in(host_pages[skip:], gpu_pages[skip:],
                                        self._grid(beside))
            self._wait_if_ranks()
            self._finish_or_track(seq_id, staging)
            if self.synchronous:
                self.tier.copied_in(seq_id)
        self.counters["kv_swap_ins"] += 1
        self.counters["kv_swap_in_bytes"] += (len(gpu_pages) - skip) * self.page_bytes
        return num_tokens

    def copying_out(self) -> list[str]:
        """The sequences whose copy out is in flight (their GPU pages still held), oldest
        first."""
        return [seq_id for seq_id in self._in_flight
                if self.tier.state(seq_id) is HostState.COPYING_OUT]

    def poll(self) -> list[str]:
        """Settle the copies that landed. Returns the sequences whose copy out did (their GPU
        pages may be freed now)."""
        landed = []
        for seq_id, (event, _) in list(self._in_flight.items()):
            if not event.query():
                continue
            del self._in_flight[seq_id]
            if self.tier.state(seq_id) is HostState.COPYING_OUT:
                self.tier.copied_out(seq_id)
                landed.append(seq_id)
            else:
                self.tier.copied_in(seq_id)
        return landed

    def before_forward(self, seq_ids: list[str]) -> None:
        """Make the compute stream wait for the copies in flight into the GPU pool of the
        sequences a step runs (`seq_ids`; a prefetch for a later step goes on beside it)."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.gpu_kv.device)
        for seq_id in seq_ids:
            copy = self._in_flight.get(seq_id)
            if copy is not None and self.tier.state(seq_id) is HostState.COPYING_IN:
                current.wait_event(copy[0])

    def release(self, seq_id: str) -> int:
        """Free a sequence's host pages in any state (abort, expiry, finish, a copy out that
        admission overtook), first waiting out its copy in flight. Returns how many."""
        copy = self._in_flight.pop(seq_id, None)
        if copy is not None:
            copy[0].synchronize()
        return self.tier.release(seq_id)

    # ---- the prefix cache's (kvcache/prefix_host.py's KVMover) ---------------------------------

    # pages per staged copy of the prefix cache's: bounds the staging tensor (64 pages of an
    # 8B model: 128 MiB), which the compute stream frees and reuses chunk after chunk
    PREFIX_COPY_PAGES = 64

    def demote(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy evicted prefix-cache pages to the host. The gather runs on the compute stream
        (it reads the device pages before the pool hands them to a writer); where copies run
        beside compute, the DMA to the host runs on the demotion stream, off the steps' path."""
        beside = self.cuda and not self.synchronous
        for at in range(0, len(device_pages), self.PREFIX_COPY_PAGES):
            chunk = slice(at, at + self.PREFIX_COPY_PAGES)
            staging = self._gather(device_pages[chunk])
            if not beside:
                self._to_host(staging, host_pages[chunk])
                continue
            self.demotion_stream.wait_stream(torch.cuda.current_stream(self.gpu_kv.device))
            with torch.cuda.stream(self.demotion_stream):
                self._to_host(staging, host_pages[chunk])
            # its memory is not reused before the DMA ends
            staging.record_stream(self.demotion_stream)
        if beside:
            self._last_demotion = self._record(self.demotion_stream)
        self._wait_if_ranks()
        self._mark_prefix_copy()
        self.counters["kv_host_prefix_demoted_pages"] += len(device_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy prefix-cache pages back from the host, on the compute stream (after the
        demotions' DMAs in flight: a page loaded may be one of theirs)."""
        if self._last_demotion is not None:
            torch.cuda.current_stream(self.gpu_kv.device).wait_event(self._last_demotion)
            self._last_demotion = None  # what the compute stream runs next comes after it
        for at in range(0, len(device_pages), self.PREFIX_COPY_PAGES):
            chunk = slice(at, at + self.PREFIX_COPY_PAGES)
            self._copy_in(host_pages[chunk], device_pages[chunk], self.copy_programs)
        self._wait_if_ranks()
        self._mark_prefix_copy()
        self.counters["kv_host_prefix_loaded_pages"] += len(device_pages)

    def settle(self) -> None:
        """Wait for the last of those copies (and so for the steps before it): their device
        pages are about to be written or read outside the compute stream (a peer's transfer,
        the sender's thread)."""
        if self._last_prefix_copy is not None:
            self._last_prefix_copy.synchronize()
            self._last_prefix_copy = None

    def _mark_prefix_copy(self) -> None:
        if self.cuda:
            self._last_prefix_copy = torch.cuda.Event()
            self._last_prefix_copy.record()

    # ---- the engine's ---------------------------------------------------------------------------

    def measure_copy_rate(self, num_pages: int = 64) -> float:
        """Time copies of `num_pages` GPU pages out and back (pages 0.., at start-up while the
        pool is idle: what comes back is what was there) and keep the slower way's rate, in
        bytes per second, unless a rate was configured. Returns it."""
        if self.copy_bytes_per_s is not None:
            return self.copy_bytes_per_s
        n = min(num_pages, self.tier.pool.num_pages, self.gpu_kv.shape[2])
        pages, slowest = list(range(n)), 0.0
        for _ in range(2):  # the first round pays for allocations
            start = time.perf_counter()
            self.swap_out("measure", pages, n * self.tier.page_size)
            self.settle_out("measure")
            out_s = time.perf_counter() - start
            start = time.perf_counter()
            self.swap_in("measure", pages)
            self.release("measure")
            slowest = max(out_s, time.perf_counter() - start)
        for key in self.counters:
            self.counters[key] = 0
        self.copy_bytes_per_s = n * self.page_bytes / max(slowest, 1e-9)
        return self.copy_bytes_per_s

    def stats(self) -> dict[str, int]:
        return {**self.counters, "kv_host_pages_total": self.tier.pool.num_pages,
                "kv_host_pages_free": self.tier.pool.num_free}

    def check_integrity(self, scheduled: set[str], cached_pages: list[int] = ()) -> None:
        """The host pages (HostTier.check_integrity; `cached_pages`: the prefix cache's), and
        every sequence holding some is one the scheduler holds (`scheduled`: its running and
        waiting ids)."""
        self.tier.check_integrity(cached_pages)
        on_host = self.tier.seq_ids()
        stray = on_host - scheduled
        if stray or not self._in_flight.keys() <= on_host:
            raise IntegrityError(f"host pages of gone sequences: {stray}")

    # ---- copies ---------------------------------------------------------------------------------

    def _grid(self, beside: bool) -> int:
        """The copy kernel's grid for a copy steps run beside (`beside`) or not (0: staged)."""
        if beside and self.beside_programs:
            self.counters["kv_swap_copies_beside"] += 1
            return self.beside_programs
        return self.copy_programs

    def _copy_out(self, gpu_pages: list[int], host_pages: list[int],
                  programs: int) -> torch.Tensor:
        """Copy `gpu_pages` into `host_pages` (on the current stream): by kernel of `programs`
        programs, or (0) gathered into a page-major staging tensor and DMAed from there.
        Returns the device tensor the copy reads (it must outlive the copy)."""
        if programs:
            return self._by_kernel(gpu_pages, host_pages, True, programs)
        staging = self._gather(gpu_pages)
        self._to_host(staging, host_pages)
        return staging

    def _gather(self, gpu_pages: list[int]) -> torch.Tensor:
        """`gpu_pages` gathered into a page-major staging tensor (on the current stream)."""
        index = self._index(gpu_pages)
        if len(self.pools) == 1:
            return self.gpu_kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        # [n, rank, layer, K|V, ...]
        return torch.stack([pool.index_select(2, index).permute(2, 0, 1, 3, 4, 5)
                            for pool in self.pools], dim=1)

    def _to_host(self, staging: torch.Tensor, host_pages: list[int]) -> None:
        """DMA a staging tensor into `host_pages` (on the current stream), a run at a time."""
        for start, end, first in _runs(host_pages, self.dma_pages):
            self.host[first : first + end - start].copy_(staging[start:end],
                                                        non_blocking=self.cuda)

    def _copy_in(self, host_pages: list[int], gpu_pages: list[int],
                 programs: int) -> torch.Tensor:
        """Copy `host_pages` into `gpu_pages` (on the current stream): by kernel of `programs`
        programs, or (0) DMAed into a staging tensor and scattered from there. Returns the
        device tensor the copy reads."""
        if programs:
            return self._by_kernel(gpu_pages, host_pages, False, programs)
        staging = torch.empty((len(host_pages), *self.page_shape), dtype=self.host.dtype,
                              device=self.gpu_kv.device)
        for start, end, first in _runs(host_pages, self.dma_pages):
            staging[start:end].copy_(self.host[first : first + end - start],
                                     non_blocking=self.cuda)
        index = self._index(gpu_pages)
        if len(self.pools) == 1:
            self.gpu_kv.index_copy_(2, index, staging.permute(1, 2, 0, 3, 4, 5))
        else:
            for rank, pool in enumerate(self.pools):
                pool.index_copy_(2, index, staging[:, rank].permute(1, 2, 0, 3, 4, 5))
        return staging

    def _by_kernel(self, gpu_pages: list[int], host_pages: list[int], to_host: bool,
                   programs: int) -> torch.Tensor:
        """The copy kernel between the pool and the host pages; returns its page ids (on the
        device: they must outlive the copy)."""
        ids = to_device([gpu_pages, host_pages], torch.long, self.gpu_kv.device)
        copy_host_pages(self.gpu_kv, self.host, ids, to_host, programs)
        return ids

    def _warm_up(self) -> None:
        """Compile the copy kernel's variants (each way, each grid) now, not at the first swap
        (a compile stalls the step beside it ~0.1-1 s): GPU page 0 to host page 0 and back,
        its values unchanged, waited for."""
        ids = to_device([[0], [0]], torch.long, self.gpu_kv.device)
        for programs in {self.copy_programs, self.beside_programs}:
            for to_host in (True, False):
                copy_host_pages(self.gpu_kv, self.host, ids, to_host, programs)
        torch.cuda.synchronize(self.gpu_kv.device)

    def _wait_if_ranks(self) -> None:
        """A tensor-parallel engine on GPUs: wait until the copies queued on this device so far
        (every rank's share is copied from here) have landed."""
        if self._wait_each:
            torch.cuda.synchronize(self.gpu_kv.device)

    def _index(self, pages: list[int]) -> torch.Tensor:
        # through pinned memory (engine/device.py): from pageable memory the host would wait
        # for the copy stream, which waits for the compute stream's step in flight
        return to_device(pages, torch.long, self.gpu_kv.device)

    def _on_copy_stream(self, after_demotions: bool = False):
        """The copy stream, after the compute stream's work so far; `after_demotions` (a
        copy out, whose host pages may be ones a demotion in flight still writes): after the
        demotions' DMAs too."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.gpu_kv.device))
        if after_demotions and self._last_demotion is not None:
            self.stream.wait_event(self._last_demotion)
        return torch.cuda.stream(self.stream)

    def _finish_or_track(self, seq_id: str, staging: torch.Tensor) -> None:
        """Unless copies are synchronous, remember the copy's event (and keep its staging
        alive until it lands)."""
        if not self.synchronous:
            self._in_flight[seq_id] = (self._record(), staging)

    def _record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """An event at the end of the work queued on `stream` (the copy stream's)."""
        event = torch.cuda.Event()
        event.record(stream or self.stream)
        return event


def _runs(pages: list[int], longest: int | None = None) -> list[tuple[int, int, int]]:
    """Runs of adjacent ids in `pages`, each at most `longest` ids (None: unbounded): (start,
    end) in the list and the run's first id.

        [7, 8, 9, 3, 4] -> (0, 3, 7), (3, 5, 3);   longest 2: (0, 2, 7), (2, 3, 9), (3, 5, 3)
    """
    runs, start = [], 0
    for i in range(1, len(pages) + 1):
        if (i == len(pages) or pages[i] != pages[i - 1] + 1
                or (longest is not None and i - start == longest)):
            runs.append((start, i, pages[start]))
            start = i
    return runs
