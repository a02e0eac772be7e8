"""Where a request's time to first token goes: the handover between engines, per request.

The router stamps each request's path (engine handles stamp their calls, the backend the
first token to the client); the sending engine reports how its part of a `remote_send` split
(its answer's `timing`). At the end of a request the stages go into one Prometheus histogram,
`microserve_router_stage_seconds{strategy, stage}`:

    arrived ─┬─ prep_recv (when it is on the path) ──────────────────────────────┐
             └─ remote_send on P ─────────────────────────────────────────────────┤
                 ├ p_queue        from P's HTTP frontend taking the call to its   │
                 │                first step (the step in progress, work before)  │
                 ├ p_prefill      P's steps, to its token read back / KV landed   │
                 │  ├ p_chunks    its first step to the launch of its last chunk's│
                 │  └ p_last_step that step's run and the read-back after it      │
                 ├ transfer_tail  from then to the answer                         │
                 └ send_hops      the round trip beyond P's own time: HTTP hops   │
             start_generate on D ── d_first_chunk: D's admission, first step     ─┤
    first token to the client ─── ttft                                           ─┘

    handover = ttft - p_queue - p_prefill: what P/D adds to the time a single engine would
               take for the same prompt (the transfer's tail, D's part, every hop)

A stage is observed only where the request went through it (a data-parallel request has a
`ttft` and a `d_first_chunk`, no `p_*`). `bench.strategies` reads these histograms before and
after each run and records their quantiles.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from microserve.metrics import Registry

# Upper bounds in seconds: 0.25 ms to 60 s, fine where handovers are (milliseconds).
BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
           0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
           10.0, 20.0, 30.0, 60.0)
STAGE_METRIC = "microserve_router_stage_seconds"


@dataclass(slots=True)
class Timeline:
    """One request's stamps (time.perf_counter()), each written once by the part named."""

    arrived: float  # set when the router makes the request
    prep_recv_s: float | None = None  # engine handle: a prep_recv's round trip
    send_s: float | None = None  # engine handle: remote_send's round trip
    p_queue_s: float | None = None  # the sender's report (RemoteSendResponse.timing)
    p_prefill_s: float | None = None
    p_chunks_s: float | None = None  # within p_prefill: its chunks' span (None: not reported)
    transfer_tail_s: float | None = None
    generate_started: float | None = None  # engine handle: start_generate called
    first_chunk: float | None = None  # engine handle: that engine's first chunk
    first_token: float | None = None  # backend: the first token went to the client

    def sent(self, round_trip_s: float, timing) -> None:
        """A remote_send answered after `round_trip_s`; `timing`: the sender's SendTiming
        (None from an engine that does not report one)."""
        self.send_s = round_trip_s
        if timing is not None:
            self.p_queue_s, self.p_prefill_s = timing.queued_s, timing.prefill_s
            self.transfer_tail_s, self.p_chunks_s = timing.tail_s, timing.chunks_s

    def stages(self) -> dict[str, float]:
        """The stages this request went through, in seconds."""
        out: dict[str, float] = {}
        if self.first_token is not None:
            out["ttft"] = self.first_token - self.arrived
        if self.prep_recv_s is not None:
            out["prep_recv"] = self.prep_recv_s
        if self.send_s is not None:
            out["remote_send"] = self.send_s
        if self.p_queue_s is not None:
            out["p_queue"] = self.p_queue_s
            out["p_prefill"] = self.p_prefill_s
            out["transfer_tail"] = self.transfer_tail_s
            if self.p_chunks_s is not None:
                out["p_chunks"] = self.p_chunks_s
                out["p_last_step"] = max(0.0, self.p_prefill_s - self.p_chunks_s)
            engine = self.p_queue_s + self.p_prefill_s + self.transfer_tail_s
            out["send_hops"] = max(0.0, self.send_s - engine)
            if "ttft" in out:
                out["handover"] = max(0.0, out["ttft"] - self.p_queue_s - self.p_prefill_s)
        if self.first_chunk is not None and self.generate_started is not None:
            out["d_first_chunk"] = self.first_chunk - self.generate_started
        return out


def now() -> float:
    return time.perf_counter()


class StageMetrics:
    """The histogram of every stage, by strategy."""

    def __init__(self, registry: Registry):
        self.histogram = registry.histogram(
            STAGE_METRIC, "Where requests' time to first token went, by stage (router/"
            "handover.py): ttft, prep_recv, remote_send (p_queue, p_prefill (p_chunks, "
            "p_last_step), transfer_tail, send_hops), d_first_chunk, and handover = ttft - "
            "p_queue - p_prefill.",
            BUCKETS, ["strategy", "stage"])

    def observe(self, strategy: str, timeline: Timeline) -> None:
        for stage, seconds in timeline.stages().items():
            self.histogram.observe(seconds, strategy=strategy, stage=stage)
