"""The engine side of the microserving calls that move KV between engines (paper §3.4–3.5).

Receiver (engine D, engine/kv_receiver.py): prep_recv reserves pages and a transfer window for
prompt[matched:end]; start_generate or commit adopts what was written there; a lease frees a
reservation whose sender stopped renewing it. Sender (engine P, engine/kv_sender.py):
remote_send computes or copies the KV of prompt[begin:end] and writes it into the receiver's
window; send_to names the destination of a remote_send that started without one.

A request's place is its entry in the core's request table (engine/requests.py): RECV_WAITING
or RESERVED on the receiver, SENDING (a send-only sequence computing) or FLUSHING (computed, its
pages held until the transfer thread flushed) on the sender. The exchange moves requests
through these states and gives their pages and windows back; it never touches the scheduler.
Where a request enters or leaves the scheduler, it returns the sequence (remote_send,
drop_failed_sends, abort, fail_send) and the core adds or removes it. What the scheduler must
keep for its own work it learns through `headroom`, a callable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_receiver import _NEVER_TRIED, Receiving
from engine.kv_sender import COMPUTED, Sending
from engine.requests import (IllegalTransition, RequestState, RequestTable, Reservation, SendJob,
                             WaitingRecv)
from engine.sequence import Sequence
from kvcache.manager import KVCacheManager
from kvcache.transfer import TransferBackend
from kvcache.transfer.base import slot_tensor
from kvcache.transfer.sender import KVSender
from microserve.backend import MicroservingError
from microserve.messages import KVAddr, PrepRecvResponse, RemoteSendResponse

__all__ = ["Answer", "ExchangeLimits", "KVExchange", "Reservation", "SendJob", "WaitingRecv", "slot_tensor"]

log = logging.getLogger(__name__)

# What poll() answers a deferred call with: its response, or its error.
Answer = PrepRecvResponse | RemoteSendResponse | MicroservingError


@dataclass(frozen=True)
class ExchangeLimits:
    """How long reservations live and prep_recv calls wait (EngineConfig's kv_lease_s,
    kv_lease_max_s, kv_recv_wait_s, kv_recv_wait_max_s)."""

    lease_s: float  # a reservation's lease when prep_recv names none
    max_lease_s: float  # the longest lease prep_recv may name
    wait_s: float = 0.0  # how long prep_recv waits for pages when it names no wait_s
    max_wait_s: float = 0.0  # the longest wait prep_recv may name

    @classmethod
    def from_config(cls, config) -> ExchangeLimits:
        return cls(config.kv_lease_s, config.kv_lease_max_s, config.kv_recv_wait_s,
                   config.kv_recv_wait_max_s)


class KVExchange(Receiving, Sending):
    """Args:
        kv: the engine's KV pages; the exchange holds and frees those of its states.
        requests: the core's request table; the exchange moves only the transfer states.
        headroom: pages the scheduler's own work needs first (`Scheduler.headroom`).
        vocab_size: prompt token ids must be below it.
        backend, sender: this engine's receiving and sending sides (kvcache/transfer/); the
            sender's layout is the engine's.
        limits: leases and waits.
    """

    def __init__(self, kv: KVCacheManager, requests: RequestTable, headroom: Callable[[], int],
                 vocab_size: int, backend: TransferBackend, sender: KVSender,
                 limits: ExchangeLimits):
        self.kv = kv
        self.requests = requests
        self.headroom = headroom
        self.vocab_size = vocab_size
        self.backend = backend
        self.sender = sender
        self.layout = sender.layout
        self.lease_s, self.max_lease_s = limits.lease_s, limits.max_lease_s
        self.wait_s, self.max_wait_s = limits.wait_s, limits.max_wait_s
        self._room_when_tried = _NEVER_TRIED  # _room() when the head last did not fit (Receiving)
        self.host_loaded = 0  # set by adopt_for_generate (Receiving)
        self._answers: list[tuple[str, Answer]] = []  # given by the next poll(); both halves add
        # sampling sends whose transfer completed before their token was resolved (Sending)
        self._flushed: set[str] = set()
        # send_to calls that overtook their remote_send on the way: (begin, kv_addr, deadline)
        # (Sending)
        self._addresses: dict[str, tuple[int, KVAddr, float]] = {}
        # aborts that overtook their early remote_send on the way: request_id -> deadline
        # (Sending)
        self._refused: dict[str, float] = {}
        self.counters = {"kv_leases_expired": 0, "kv_tokens_sent": 0, "kv_tokens_received": 0,
                         "kv_recv_waited": 0, "kv_recv_wait_timeouts": 0,
                         "kv_send_queue_timeouts": 0}

    def poll(self) -> list[tuple[str, Answer]]:
        """Answers for remote_send calls whose transfer has completed, failed or was aborted,
        and for prep_recv calls that waited and were granted, gave up or were aborted."""
        self._settle_completed()
        out: list[tuple[str, Answer]] = list(self._answers)
        self._answers.clear()
        return out

    def expire_leases(self, now: float) -> int:
        """Free reservations whose sender has not renewed them for `lease_s` (nor has one
        since the grant), and drop parked sends whose send_to did not come in time. Returns
        how many."""
        return self._expire_reservations(now) + self._expire_parked(now)

    def next_deadline(self) -> float | None:
        """When a lease is next due, a parked send's send_to is late, a send not started is
        past its queue time, or a waiting prep_recv gives up."""
        reserved = self.requests.in_state(RequestState.RESERVED)
        parked = self.requests.in_state(RequestState.PARKED)
        lease = min([*(e.reservation.deadline for e in reserved.values()),
                     *(e.job.address_by for e in parked.values()),
                     *(deadline for _, _, deadline in self._addresses.values()),
                     *self._refused.values(),
                     *self._start_deadlines()], default=None)
        waiting = self.requests.in_state(RequestState.RECV_WAITING)
        if not waiting:
            return lease
        wait = min(e.waiting.deadline for e in waiting.values())
        return wait if lease is None else min(lease, wait)

    def _check_free(self, request_id: str) -> None:
        if request_id in self.requests:
            raise MicroservingError(409, f"request_id {request_id!r} is already in use",
                                    "request_id")  # fmt: skip

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a waiting prep_recv, a reservation or a send under request_id (GENERATING is
        the core's to abort). Returns the sequence of a send still computing, for the caller
        to take out of the scheduler."""
        entry = self.requests.get(request_id)
        state = None if entry is None else entry.state
        if state is RequestState.RESERVED:
            self._close(request_id, entry.reservation)
            self.kv.free(request_id)
            return None
        if state is RequestState.RECV_WAITING:
            self.requests.finish(request_id)
            self._room_when_tried = _NEVER_TRIED  # the head may have changed
            seq = None
        elif state in (RequestState.SENDING, *COMPUTED):
            seq = self._drop_send(request_id)
        else:
            raise IllegalTransition(f"request {request_id!r} ({state}) is not the exchange's")
        self._answers.append(
            (request_id, MicroservingError(409, f"request {request_id!r} was aborted"))
        )
        return seq

    def stats(self) -> dict:
        return {
            "kv_reservations": self.requests.count(RequestState.RESERVED),
            "kv_recv_waiting": self.requests.count(RequestState.RECV_WAITING),
            "kv_send_jobs": sum(self.requests.count(s) for s in (RequestState.SENDING,
                                                                 *COMPUTED)),
            **self.counters,
        }
