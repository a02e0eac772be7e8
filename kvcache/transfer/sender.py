"""The sender's transfer stream: one background thread that runs KV writes in submission order.

The engine's forward pass computes layer L, enqueues its writes here and goes on with layer
L+1 while this thread copies layer L out. That overlap is real on CPU because the work here is
torch copies and socket sends, which release the GIL; a GPU backend would issue the same work
on a CUDA stream instead of a thread. (On CPU the copies also use torch's intra-op threads,
which the forward pass wants too: an engine that overlaps heavily may leave this thread a core.)

    engine thread                         transfer thread (this module)
    ─────────────                         ─────────────────────────────
    start(job, descriptor, window,        opens/reuses the Peer (on the engine thread)
          slots, digest)
    write(job, layer 0, src, dst)  ─────▶ peer.write(window, 0, src, dst)
    write(job, layer 1, src, dst)  ─────▶ peer.write(window, 1, src, dst)
    finish(job)                    ─────▶ peer.seal(window, digest); peer.flush(window);
                                          completed += (job, None | error); notify()
    completed()  ◀──────────────────────

A job writes only into its window's `slots` (the slots the receiver reserved and signed for
it): a destination outside them is refused before it is queued, so no bug upstream can make
this engine write another request's pages on the receiver.

The forward pass calls `layer_written` after each layer: that is `write` for a peer that copies on
the host (shm, tcp), and for a peer that only queues GPU copies (`Peer.whole_steps`: cuda_ipc) one
`write_layers` of every layer after the step's last, because there one Python call per layer costs
more host time than its copy costs the GPU (measured: docs/benchmarks.md, "GPU: KV page copy for
`cuda_ipc`"). With chunked prefill, a step's copy then runs beside the next step.

A job's source slots must keep their KV until the job is reported in `completed()` or
`cancel()` has returned: this thread reads them from the local pool when it gets to them.

A second thread renews the receiver's window of every job held here, from `start` until the job
completes or is cancelled, every RENEW_INTERVAL_S (kvcache/transfer/base.py): that keeps the
receiver's reservation alive while the job waits in this engine's queue or computes, however
long that takes. A renewal that fails (the receiver exited, or closed the window after an abort
or a lease expiry) fails the job at once, so the engine stops computing for a receiver that no
longer wants the KV, even before its first write.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

import numpy as np

from kvcache.transfer import open_peer
from kvcache.transfer.auth import TransferAuthError, verify
from kvcache.transfer.base import (RENEW_INTERVAL_S, KVLayout, Peer, TransferError, Window,
                                   slots_outside, window_slots)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    job_id: str
    peer: Peer
    peer_key: tuple
    window: Window
    slots: np.ndarray  # the window's slots, sorted: every destination must be one of them
    digest: bytes | None  # the seal left in the window before its flush (None: no seal)
    checked: torch.Tensor | None = None  # the last destinations found inside (by _enqueue)
    error: str | None = None  # set by the transfer thread at the first failed write or flush
    finished: bool = False  # set by finish()
    cancelled: bool = False  # set by cancel() and close()


class _Op(NamedTuple):
    job: _Job
    layers: range | None  # None: the job's flush
    src_slots: torch.Tensor | None = None
    dst_slots: torch.Tensor | None = None
    ready: "torch.cuda.Event | None" = None  # GPU pools: the source KV is written once it fires


class KVSender:
    """Runs writes to peers on one thread, in submission order.

    All methods but `close` may be called from any thread; `notify` is called on the transfer
    thread after a job's completion is added, so it must be thread-safe and quick (e.g.
    `loop.call_soon_threadsafe(event.set)`).
    """

    def __init__(
        self, local_kv: torch.Tensor, layout: KVLayout, notify: Callable[[], None] = lambda: None,
        key: bytes | None = None, local_ranks: list[torch.Tensor] | None = None,
    ):
        """`local_ranks`: a tensor-parallel engine's ranks' pools, rank 0's (`local_kv`)
        first, mapped into this process (kvcache/transfer/tp_peer.py)."""
        self.local_kv = local_kv
        self.local_ranks = local_ranks
        self.layout = layout
        self.key = key  # the deployment's transfer key: receivers' descriptors must be signed
        self._notify = notify
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()  # None stops the thread
        # Guards everything below. Peers are used only on the transfer thread, opened only in
        # start() (under _open_lock, so two starts never open the same peer twice).
        self._lock = threading.Condition()
        self._open_lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # started, not yet completed or cancelled
        self._peers: dict[tuple, Peer] = {}  # descriptor key -> open peer, shared by jobs
        self._retired: list[Peer] = []  # dropped from _peers after an error; closed when unused
        self._completed: list[tuple[str, str | None]] = []
        self._writing: _Job | None = None  # the job whose write runs now on the transfer thread
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()
        # Held while renewing, and while peers are closed: a peer is never closed under a renewal.
        self._renew_lock = threading.Lock()
        self._stop_renewing = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="kv-sender-renew",
                                         daemon=True)
        self._renewer.start()
        _open_senders.add(self)

    def warm_up(self) -> None:
        """Compile the GPU page copy a send launches (a GPU pool only), so that the first
        send of a run does not wait for it."""
        if not self.local_kv.is_cuda:
            return
        from kvcache.transfer.cuda_ipc import CudaIpcPeer
        from kvcache.transfer.page_copy import warm_up
        warm_up(self.local_kv, CudaIpcPeer.num_programs, CudaIpcPeer.rows_at_once)

    def start(self, job_id: str, descriptor: dict, window: Window, slots: torch.Tensor,
              digest: bytes | None = None) -> None:
        """Begin a job that writes into `window` of the receiver `descriptor` names, at no
        destination but `slots` (int64: the slots the receiver reserved for the window), and
        seals the window with `digest` (auth.kv_digest) before its flush. Opens the
        peer (or reuses the open one) on this thread; raises TransferError if the descriptor is
        not signed with the deployment's key or opening fails, and ValueError if `job_id` is
        already running."""
        allowed = window_slots(slots)
        try:
            verify(descriptor, self.key)  # before anything is looked up, opened or dialed
        except TransferAuthError as e:
            raise TransferError(str(e)) from None
        key = tuple(sorted(descriptor.items()))
        with self._open_lock:
            with self._lock:
                if job_id in self._jobs:
                    raise ValueError(f"KV transfer job {job_id!r} is already running")
                peer = self._peers.get(key)
                if peer is not None and not peer.alive():  # e.g. a tcp receiver restarted
                    self._retire(key, peer)
                    peer = None
            if peer is None:
                peer = open_peer(descriptor, self.local_kv, self.layout, self.key,
                                 self.local_ranks)
            with self._lock:
                self._peers[key] = peer
                self._jobs[job_id] = _Job(job_id, peer, key, window, allowed, digest)

    def check_destinations(self, job_id: str, host_slots: torch.Tensor,
                           device_slots: torch.Tensor) -> None:
        """Check a step's destinations against the job's window on the host copy, before the
        step: the writes that then name `device_slots` (the same slots, uploaded) skip the
        check, which on a GPU tensor would wait for the GPU to catch up with the host (a
        stall of the step pipeline, every step a send runs in). Raises ValueError as
        `write` does."""
        job = self._job(job_id)
        _check_inside(job, host_slots)
        job.checked = device_slots

    def write(
        self, job_id: str, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """Enqueue K and V of `layer` at local slots `src_slots` into the receiver's slots
        `dst_slots` (int64, equal lengths; not modified after this call). No-op if the job
        already failed. With a GPU pool, the KV to send is what the caller's current stream
        has written (or queued) so far: an event recorded here lets a peer copy on a stream of
        its own as soon as that work is done, while the caller's stream goes on."""
        self._enqueue(self._job(job_id), range(layer, layer + 1), src_slots, dst_slots)

    def write_all_layers(
        self, job_id: str, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """`write` for every layer (KV computed before this step, e.g. a cached prefix): one
        write of them all for a peer that takes whole steps."""
        job, num_layers = self._job(job_id), self.layout.num_layers
        runs = [range(num_layers)] if job.peer.whole_steps else [
            range(layer, layer + 1) for layer in range(num_layers)]
        for layers in runs:  # a cancel waits for the write running, not for the rest
            self._enqueue(job, layers, src_slots, dst_slots)

    def layer_written(
        self, job_id: str, layer: int, src_slots: torch.Tensor, dst_slots: torch.Tensor
    ) -> None:
        """The forward pass wrote `layer`'s KV at `src_slots`: `write` it, or, for a peer that
        takes whole steps, write every layer once `layer` is the last."""
        job = self._job(job_id)
        if not job.peer.whole_steps:
            self._enqueue(job, range(layer, layer + 1), src_slots, dst_slots)
        elif layer == self.layout.num_layers - 1:
            self._enqueue(job, range(self.layout.num_layers), src_slots, dst_slots)

    def _enqueue(self, job: _Job, layers: range, src_slots: torch.Tensor,
                 dst_slots: torch.Tensor) -> None:
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} destinations")
        if dst_slots is not job.checked:  # a step's layers share one tensor: checked once
            _check_inside(job, dst_slots)
            job.checked = dst_slots
        if job.error is None:
            ready = None
            if self.local_kv.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            self._queue.put(_Op(job, layers, src_slots, dst_slots, ready))

    def finish(self, job_id: str) -> None:
        """Enqueue the job's flush. Once it ran, `completed()` reports (job_id, None) or
        (job_id, error message) and `notify()` is called. The job takes no writes after this."""
        job = self._job(job_id)
        job.finished = True
        self._queue.put(_Op(job, None))

    def cancel(self, job_id: str) -> None:
        """Drop the job: its queued writes and flush are skipped and nothing is reported. Returns
        once no write of the job runs, so its source pages may be freed. Unknown ids are ignored
        (the job may have completed meanwhile)."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return
            job.cancelled = True
            while self._writing is job:
                self._lock.wait()

    def failed(self) -> list[tuple[str, str]]:
        """Running, unfinished jobs that already failed, with the error: their owner may stop
        producing KV for them early and cancel them."""
        with self._lock:
            return [(j.job_id, j.error) for j in self._jobs.values()
                    if j.error is not None and not j.finished]  # fmt: skip

    def completed(self) -> list[tuple[str, str | None]]:
        """Jobs whose flush ran since the last call: (job_id, None if every byte arrived, else
        the error message)."""
        with self._lock:
            done, self._completed = self._completed, []
        return done

    def wait_flushed(self, job_ids: list[str], timeout_s: float) -> None:
        """Wait up to `timeout_s` until no job of `job_ids` is running (each has completed,
        failed or been cancelled); their reports still come from `completed()`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(j in self._jobs for j in job_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._lock.wait(left)

    def close(self) -> None:
        """Drop every job, stop the transfer thread and close all peers."""
        _open_senders.discard(self)
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
            self._jobs.clear()
        self._stop_renewing.set()
        self._renewer.join()
        self._queue.put(None)
        self._thread.join()
        for peer in [*self._peers.values(), *self._retired]:
            peer.close()
        self._peers.clear()
        self._retired.clear()

    def _job(self, job_id: str) -> _Job:
        """The running job `job_id`, which still takes writes."""
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None or job.finished:
            state = "finished" if job else "not running (never started, or cancelled)"
            raise ValueError(f"KV transfer job {job_id!r} is {state}")
        return job

    # ---- transfer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            job, is_write = op.job, op.layers is not None
            with self._lock:
                if job.cancelled:
                    continue
                if is_write:
                    self._writing = job  # cancel() waits until this write is over
            if job.error is None:  # a failed job skips its later writes and its flush
                self._execute(op)
            if is_write:
                with self._lock:
                    self._writing = None
                    self._lock.notify_all()
            else:
                self._complete(job)

    def _execute(self, op: _Op) -> None:
        """Run one write or flush; a failure is recorded in the job, never raised."""
        job = op.job
        try:
            if op.layers is None:
                if job.digest is not None:
                    job.peer.seal(job.window, job.digest)
                job.peer.flush(job.window)
            else:
                job.peer.write_layers(job.window, op.layers, op.src_slots, op.dst_slots,
                                      op.ready)
        except TransferError as e:
            job.error = str(e)
        except Exception as e:  # a bug must fail the job, not kill the transfer thread
            log.exception("KV transfer job %s failed", job.job_id)
            job.error = f"{type(e).__name__}: {e}"
        else:
            return
        if op.layers is not None:
            self._notify()  # the owner can stop computing for this job (see failed())
        if not job.peer.alive():  # not just a closed window: later jobs open a fresh peer
            with self._lock:
                self._retire(job.peer_key, job.peer)

    def _retire(self, key: tuple, peer: Peer) -> None:
        """Drop `peer` from the cache (lock held); the transfer thread closes it once no running
        job uses it."""
        if self._peers.get(key) is peer:
            del self._peers[key]
            self._retired.append(peer)

    def _complete(self, job: _Job) -> None:
        with self._lock:
            if job.cancelled:
                return
            del self._jobs[job.job_id]
            self._completed.append((job.job_id, job.error))
            self._lock.notify_all()  # wait_flushed()
            for key, peer in list(self._peers.items()):
                if not peer.alive():
                    self._retire(key, peer)
            # Close the retired peers no running job uses (queued ops of cancelled jobs are
            # skipped, so they cannot touch them).
            in_use = {id(j.peer) for j in self._jobs.values()}
            unused = [p for p in self._retired if id(p) not in in_use]
            self._retired = [p for p in self._retired if id(p) in in_use]
        with self._renew_lock:
            for peer in unused:
                peer.close()
        self._notify()

    # ---- renewal thread ----------------------------------------------------------------------

    def _renew_loop(self) -> None:
        while not self._stop_renewing.wait(RENEW_INTERVAL_S):
            self.renew_all()

    def renew_all(self) -> None:
        """Renew the window of every job not yet completed, failed or cancelled (the renewal
        thread calls this; tests may too)."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.error is None]
        failed = False
        with self._renew_lock:
            for job in jobs:
                if job.cancelled:
                    continue
                try:
                    job.peer.renew(job.window)
                except TransferError as e:
                    error = str(e)
                except Exception as e:  # a bug must fail the job, not kill this thread
                    log.exception("renewing KV transfer job %s failed", job.job_id)
                    error = f"{type(e).__name__}: {e}"
                else:
                    continue
                with self._lock:
                    if job.error is None and not job.cancelled:
                        job.error, failed = error, True
        if failed:
            self._notify()  # the owner stops computing for it (see failed())


def _check_inside(job: _Job, dst_slots: torch.Tensor) -> None:
    """Raise ValueError unless every destination is one of the job's window's slots."""
    outside = slots_outside(dst_slots.cpu().numpy(), job.slots)
    if len(outside):
        raise ValueError(
            f"KV transfer job {job.job_id!r}: destination slots {outside[:4].tolist()} are "
            f"outside the {len(job.slots)} slots of its window {job.window.index}")


# A daemon thread still inside torch ops while the interpreter finalizes aborts the process
# ("terminate called without an active exception"), so senders left open are closed at exit.
_open_senders: weakref.WeakSet[KVSender] = weakref.WeakSet()


@atexit.register
def _close_open_senders() -> None:
    for sender in list(_open_senders):
        sender.close()
