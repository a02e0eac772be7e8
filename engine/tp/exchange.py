"""The all-reduce of two ranks' large messages by copy engine: each rank writes its partial sum
into the other's memory with cudaMemcpyAsync over NVLink and adds the one it receives.

A prompt step of an 8B model at TP 2 sums two 64-MiB messages per layer (8,192 tokens x 4,096
bf16). NCCL does it in ~290 µs at ~230 GB/s (2x H200, docs/benchmarks.md) on SMs the GEMMs
beside it need: overlapped with the other half of the step, it slowed them by 10.5%. The copy
engines move a 32-MiB message into the other GPU's memory in ~0.10 ms (325 GB/s) without an
SM, and slow a GEMM beside them far less. With two ranks each rank must receive the other's
whole partial either way (NCCL's ring moves the same bytes each way), so a plain copy each way
and an add on each rank is the whole all-reduce; the add rides in the norm kernel after it
(engine/kernels/fused.py `peer`), or is one elementwise add. Every rank adds the same two
values (a + b == b + a in IEEE arithmetic), so the ranks hold bit-identical sums.

Synchronisation is CUDA stream memory operations (cuStreamWriteValue64 / cuStreamWaitValue64,
NVSHMEM's signal-on-stream): no SM spins and no host waits. Each rank has a symmetric buffer
(torch symmetric memory: CUDA IPC mappings set up once) of SLOTS message slots and two flag
arrays, `ready` and `consumed`, each written only by the other rank. Call c (both ranks count
the same calls: they run the same plan) uses slot s = c % SLOTS:

    main stream:  wait for consumed[s] >= c - SLOTS + 1 (the other rank has read what call
                  c - SLOTS left in its slot s)
    copy stream:  after the main stream's work so far (the partial), copy the partial into the
                  other rank's slot s; write c + 1 into the other rank's ready[s]
    main stream, at wait(): wait for this rank's own copy (the kernel after may overwrite the
                  partial) and for ready[s] >= c + 1; the add (or the norm) reads slot s;
                  write c + 1 into the other rank's consumed[s]

At most SLOTS calls may be under way (started, not yet released) on a rank, and they are
released in the order they started (start raises otherwise): a rank starting call c + SLOTS
before releasing call c would wait for the other rank to release its call c, which waits
behind the same start there. The copy stream itself never waits on a flag: a stream wait
queued behind an event another stream waits on stalled both ranks on two H200s (the CUDA
scheduler does not see these dependencies, as the driver's documentation warns).

A stream wait has no timeout: a rank that stopped leaves the other's GPU waiting, and the
step's NCCL gather of the logits, queued behind it, fails after --tensor-parallel-timeout-s
(and a dead process ends the engine at once: engine/tp/runner.py's watchdog).

Used (`--all-reduce auto`) for messages of at least EXCHANGE_MIN_BYTES in steps that run
eagerly (a CUDA graph would replay the call counts it captured), with exactly two ranks: with
N ranks each would send its whole partial to N - 1 others, where a ring sends 2(N - 1)/N.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.distributed as dist

from engine.tp.allreduce import no_symmetric_memory, ranks_agree

log = logging.getLogger("microserve.tp")

SLOTS = 2  # call c + 2 reuses call c's slot once the other rank has consumed it
# Alone and eager the exchange is never faster than NCCL (~170 µs of host calls; 319 against
# 311 µs at 64 MiB, bench.allreduce, 2x H200); it pays beside the GEMMs of a prompt step, whose
# messages are 16 MiB and more at 4,096 hidden. Small eager messages (decode with
# --enforce-eager) stay with NCCL or the one-shot kernel.
EXCHANGE_MIN_BYTES = 1 << 20
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write


class _Driver:
    """cuStreamWaitValue64 / cuStreamWriteValue64 from the CUDA driver (torch exposes
    neither). Each call queues one operation on a stream; it returns at once."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = lib.cuStreamWaitValue64_v2
        self._write = lib.cuStreamWriteValue64_v2
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            fn.restype = ctypes.c_int

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """`stream` waits until the int64 at `addr` is >= value."""
        _check(self._wait(stream.cuda_stream, addr, value, _WAIT_GEQ), "cuStreamWaitValue64")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """`stream` writes value to the int64 at `addr` once what it queued before is done."""
        _check(self._write(stream.cuda_stream, addr, value, _WRITE_DEFAULT),
               "cuStreamWriteValue64")


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed: CUDA driver error {rc}")


class PeerExchange:
    """The exchange between this rank and the other of a two-rank group, for messages of
    EXCHANGE_MIN_BYTES to `max_bytes` of `dtype` (a collective: both ranks construct it at
    the same point)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 dtype: torch.dtype, max_bytes: int):
        from torch.distributed import _symmetric_memory as symm_mem

        if dist.get_world_size(group) != 2:
            raise ValueError(f"the copy-engine exchange is for two ranks, not "
                             f"{dist.get_world_size(group)}")
        self.driver = _Driver()
        self.dtype = dtype
        self.slot_numel = -(-max_bytes // 16) * 16 // dtype.itemsize  # 16-byte slots
        data_bytes = SLOTS * self.slot_numel * dtype.itemsize
        raw = symm_mem.empty(data_bytes + 2 * SLOTS * 8, dtype=torch.uint8, device=device)
        raw.zero_()  # the flags start at 0 on both ranks before either can write them
        torch.cuda.synchronize(device)
        group_name = (group or dist.group.WORLD).group_name
        self.handle = symm_mem.rendezvous(raw, group_name)  # a collective; kept alive
        self.raw = raw
        self.recv = raw[:data_bytes].view(dtype).view(SLOTS, self.slot_numel)
        rank = dist.get_rank(group)
        other = 1 - rank
        theirs = self.handle.get_buffer(other, (data_bytes,), torch.uint8)
        self.send = theirs.view(dtype).view(SLOTS, self.slot_numel)  # the other's slots
        ours, their_base = raw.data_ptr(), self.handle.buffer_ptrs[other]
        self._ready = ours + data_bytes  # + 8 s: written by the other rank
        self._consumed = self._ready + SLOTS * 8
        self._their_ready = their_base + data_bytes
        self._their_consumed = self._their_ready + SLOTS * 8
        self.stream = torch.cuda.Stream(device)
        self.calls = 0
        self.under_way: list[int] = []  # calls started and not yet released, in order
        dist.barrier(group)  # neither rank writes a flag before both are zero

    def fits(self, x) -> bool:
        if not isinstance(x, torch.Tensor):  # an fp8 projection's output with its scales
            return False
        nbytes = x.numel() * x.element_size()
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous()
                and EXCHANGE_MIN_BYTES <= nbytes <= self.slot_numel * x.element_size()
                and not torch.cuda.is_current_stream_capturing())

    def start(self, x: torch.Tensor) -> Exchanging:
        """Send x (this rank's partial) to the other rank; `.wait()` or `.parts()` on the
        result, on the stream that computed x, takes the other rank's."""
        if len(self.under_way) >= SLOTS:
            raise RuntimeError(f"the copy-engine exchange takes {SLOTS} calls under way at "
                               f"most; calls {self.under_way} are not released")
        c, s = self.calls, self.calls % SLOTS
        self.calls += 1
        self.under_way.append(c)
        main, side = torch.cuda.current_stream(), self.stream
        if c >= SLOTS:  # the other rank has read what call c - SLOTS left in its slot s
            self.driver.wait(main, self._consumed + 8 * s, c - SLOTS + 1)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.send[s, : x.numel()].copy_(x.view(-1), non_blocking=True)
        self.driver.write(side, self._their_ready + 8 * s, c + 1)
        sent = torch.cuda.Event()
        sent.record(side)
        x.record_stream(side)
        return Exchanging(self, x, c, sent)


class Exchanging:
    """A copy-engine exchange under way (PeerExchange.start); the same calls as
    engine/models/parallel.py's `Summing`."""

    def __init__(self, exchange: PeerExchange, x: torch.Tensor, call: int,
                 sent: torch.cuda.Event):
        self.exchange, self.x, self.call, self.sent = exchange, x, call, sent
        self._arrived = self._released = False

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's partial, the other rank's) once both copies are done, for the current
        stream; call `release()` after queuing the kernel that reads the second."""
        ex, s = self.exchange, self.call % SLOTS
        if not self._arrived:
            main = torch.cuda.current_stream()
            main.wait_event(self.sent)  # our partial stays as it is until it is sent
            ex.driver.wait(main, ex._ready + 8 * s, self.call + 1)
            self._arrived = True
        return self.x, ex.recv[s, : self.x.numel()].view_as(self.x)

    def release(self) -> None:
        """The other rank may overwrite its partial's slot here once the current stream has
        done what it queued so far."""
        if not self._released:
            ex = self.exchange
            if ex.under_way[0] != self.call:
                raise RuntimeError(f"copy-engine exchange call {self.call} released before "
                                   f"call {ex.under_way[0]}")
            ex.under_way.pop(0)
            ex.driver.write(torch.cuda.current_stream(),
                            ex._their_consumed + 8 * (self.call % SLOTS), self.call + 1)
            self._released = True

    def wait(self) -> torch.Tensor:
        """The sum, in this rank's partial's tensor."""
        x, theirs = self.parts()
        x.add_(theirs)
        self.release()
        return x


def set_up(mode: str, group: dist.ProcessGroup | None, device: torch.device,
           dtype: torch.dtype, max_bytes: int) -> PeerExchange | None:
    """The exchange for `mode` (`--all-reduce`) on this rank of a two-rank group whose eager
    messages reach `max_bytes`, or None: under `auto` only, with exactly two CUDA ranks, and
    when a message can reach EXCHANGE_MIN_BYTES. Both ranks call it at the same point; they
    agree first, so a rank that cannot set it up leaves both on NCCL (with a warning)."""
    if (mode != "auto" or device.type != "cuda" or dist.get_world_size(group) != 2
            or max_bytes < EXCHANGE_MIN_BYTES):
        return None
    why = no_symmetric_memory()
    try:
        _Driver()
    except (OSError, AttributeError) as e:  # no libcuda, or one without these calls
        why = why or f"the CUDA driver's stream memory operations: {e}"
    if not ranks_agree(why, group, device, "large messages", "the copy-engine exchange"):
        return None
    try:
        exchange = PeerExchange(group, device, dtype, max_bytes)
    except Exception as e:  # a rank failing here after the agreement: the engine must end
        raise RuntimeError(f"all-reduce: setting up the copy-engine exchange failed: {e}") from e
    log.info("all-reduce: eager messages of %d KiB to %d MiB by copy engine",
             EXCHANGE_MIN_BYTES >> 10, max_bytes >> 20)
    return exchange
