"""What an engine's core did and where its time went.

`LoopCounters` are cumulative (the microserving stats and Prometheus on /metrics carry them);
`StatsLog` turns two snapshots of them into the line the core logs every few seconds while it
works, the line an operator of vLLM ("Avg prompt throughput ... Running: N reqs") or SGLang
("Decode batch. #running-req ...") reads to see whether the engine keeps its GPU busy:

    engine: 10.0 s: 612 steps (16.3 ms), prompt 40,120 tok/s, generation 3,210 tok/s;
    running 256, waiting 144, preempted 0; KV 91.2% used, 2.1% cached; prefix cache hits
    0.0% of prompt tokens (since start); core time: steps 97.8% (waiting for the device
    71.5%), outputs to frontend 1.1%, messages 0.9%, idle 0.2%; device busy 96.4% in steps,
    1.00 steps ahead at launch; decode-only steps 540 at 14.21 ms (batch 249.3)

(and, when a step had no decoding row, "; prompt-only steps N at X ms (T tokens)").

The core's time splits four ways: `step` (scheduling, launching a step and, with async
scheduling, waiting for the GPU to finish the step before it: `device_wait`), `send` (writing
outputs to the frontend: a frontend that cannot keep up shows here, as the socket fills),
`messages` (handling the frontend's requests and calls) and `idle` (waiting with nothing that
could run). A GPU-bound engine spends nearly all of it in `step`, most of that waiting for the device; a
host-bound one in `step` with little waiting (the GPU then waits for the host's launches).
The device's own share comes from CUDA events around each step (`DeviceTimeline`): the time
the GPU spent running steps, and how many steps were launched but not finished when the next
one was (1: the host prepares a step while the GPU runs the one before, as it should); then the
steps that only decoded: how many, their mean GPU time and mean batch (what a decode step
costs, apart from the steps that carried prompt tokens), and the steps in which nothing decoded
(prompt chunks under the prompt-only budget): how many, their mean GPU time and size; and,
with --launch-ahead-layers, the launches held until the step before neared its end: how many,
for how long, and the requests that arrived meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, fields, replace

import torch

log = logging.getLogger("microserve.core")


@dataclass
class LoopCounters:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens through the forward pass (cached ones not)
    tokens_sampled: int = 0  # tokens sampled, of running and finished requests alike
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0  # of step_seconds: waiting for the step before to run
    send_seconds: float = 0.0
    message_seconds: float = 0.0
    idle_seconds: float = 0.0
    # The device's side (DeviceTimeline; 0 on CPU): its time running steps, and the steps
    # launched but not finished on it, summed over launches (/ steps: how far ahead the host is)
    device_busy_seconds: float = 0.0
    device_steps_ahead: int = 0
    # ... of which steps that only decoded (one token a sequence): their GPU time, their
    # count and their sequences summed (/ steps: the mean batch), a decode step's cost apart
    # from the steps that carried prompt tokens
    device_decode_seconds: float = 0.0
    device_decode_steps: int = 0
    device_decode_seqs: int = 0
    # ... and steps in which nothing decoded (prompt chunks only, up to the prompt-only
    # budget): their GPU time, their count and their tokens summed
    device_prompt_seconds: float = 0.0
    device_prompt_steps: int = 0
    device_prompt_tokens: int = 0
    # Launches held until the step in flight had config.launch_ahead_layers left
    # (CoreLoop._hold_launch): how many, the core's time holding them (part of step_seconds),
    # and the requests that arrived while they were held (each made the held step)
    launch_holds: int = 0
    launch_hold_seconds: float = 0.0
    launch_hold_arrivals: int = 0

    def snapshot(self) -> "LoopCounters":
        return replace(self)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


class LoopClock:
    """Charges the time since its last charge to one of LoopCounters' *_seconds fields."""

    def __init__(self, counters: LoopCounters):
        self.counters = counters
        self._last = time.perf_counter()

    def charge(self, what: str) -> None:
        now = time.perf_counter()
        name = f"{what}_seconds"
        setattr(self.counters, name, getattr(self.counters, name) + now - self._last)
        self._last = now


class DeviceTimeline:
    """The device's time per step, from a pair of CUDA events around each launch.

    The host's time says little about a GPU whose steps it launches ahead: a prefill engine
    whose steps sample nothing never waits for one, so its core looks idle while the GPU is
    not. The events say what the GPU did: a step's GPU time is the span from its first
    event to its last (the stream runs steps in order, so the spans do not overlap), and the
    steps whose last event has not fired yet are the host's lead. Events are read only once
    they fired (`query`), so watching costs no synchronisation; `wait` is the one that does
    (the core's pipeline bound, engine/core/step.py). On CPU every call is a no-op.
    """

    def __init__(self, counters: LoopCounters, cuda: bool):
        self.counters = counters
        self.cuda = cuda
        # (start event, its sequences if the step only decodes else 0, its tokens if nothing in
        # it decodes else 0, end event) of the launched steps not yet counted, oldest first
        self._pending: deque = deque()

    def begin(self, decodes: int = 0, prompt_tokens: int = 0):
        """Mark a step's start on the current stream (before its first kernel); `decodes`:
        its sequences if it only decodes (one token each), else 0; `prompt_tokens`: its tokens
        if no sequence in it decodes (prompt chunks only), else 0."""
        if not self.cuda:
            return None
        self.collect()
        self.counters.device_steps_ahead += len(self._pending)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start, decodes, prompt_tokens

    def end(self, started):
        """Mark the step's end (after its last kernel); returns the event that fires then."""
        if started is None:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((*started, end))
        return end

    def wait(self, end) -> None:
        """Block until the step that `end` closes has run on the device."""
        if end is not None:
            end.synchronize()
            self.collect()

    def collect(self) -> None:
        """Count the steps whose end fired since the last call."""
        c = self.counters
        while self._pending and self._pending[0][3].query():
            start, decodes, prompt_tokens, end = self._pending.popleft()
            seconds = start.elapsed_time(end) / 1e3
            c.device_busy_seconds += seconds
            if decodes:
                c.device_decode_seconds += seconds
                c.device_decode_steps += 1
                c.device_decode_seqs += decodes
            if prompt_tokens:
                c.device_prompt_seconds += seconds
                c.device_prompt_steps += 1
                c.device_prompt_tokens += prompt_tokens


class StatsLog:
    """Logs the core's line every `interval_s` seconds in which it took a step (never if 0)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._since = time.monotonic()
        self._before = LoopCounters()

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self._since >= self.interval_s

    def wait_at_most(self, now: float, counters: LoopCounters) -> float | None:
        """How long an idle core may wait before the line of steps not yet logged is due."""
        if self.interval_s <= 0 or counters.steps == self._before.steps:
            return None
        return max(0.0, self._since + self.interval_s - now)

    def log(self, now: float, counters: LoopCounters, stats) -> str | None:
        """Log (and return) the line for the time since the last one, if the core took a step
        in it; `stats` is the core's EngineStats."""
        elapsed, self._since = now - self._since, now
        before, self._before = self._before, counters.snapshot()
        steps = counters.steps - before.steps
        if steps <= 0:
            return None
        line = format_line(elapsed, before, counters, stats)
        log.info("%s", line)
        return line


def format_line(elapsed: float, before: LoopCounters, after: LoopCounters, stats) -> str:
    def delta(name: str):
        return getattr(after, name) - getattr(before, name)

    steps = delta("steps")
    prompt, sampled = delta("prompt_tokens_computed"), delta("tokens_sampled")
    spent = {what: delta(f"{what}_seconds") for what in ("step", "send", "message", "idle")}
    total = sum(spent.values()) or 1.0
    pages = stats.kv_pages_total or 1
    prompts = stats.prompt_tokens or 1
    return (
        f"engine: {elapsed:.1f} s: {steps} steps ({1e3 * spent['step'] / steps:.1f} ms), "
        f"prompt {prompt / elapsed:,.0f} tok/s, generation {sampled / elapsed:,.0f} tok/s; "
        f"running {stats.running}, waiting {stats.waiting}, preempted {stats.preemptions}; "
        f"KV {100 * stats.kv_pages_used / pages:.1f}% used, "
        f"{100 * stats.kv_pages_cached / pages:.1f}% cached; prefix cache hits "
        f"{100 * stats.cached_prompt_tokens / prompts:.1f}% of prompt tokens (since start); "
        f"core time: steps {100 * spent['step'] / total:.1f}% (waiting for the device "
        f"{100 * delta('device_wait_seconds') / total:.1f}%), outputs to frontend "
        f"{100 * spent['send'] / total:.1f}%, messages {100 * spent['message'] / total:.1f}%, "
        f"idle {100 * spent['idle'] / total:.1f}%{_device_part(steps, elapsed, delta)}"
    )


def _device_part(steps: int, elapsed: float, delta) -> str:
    """The GPU's side of the line (nothing on CPU, where no step is timed on a device)."""
    busy = delta("device_busy_seconds")
    if busy <= 0:
        return ""
    line = (f"; device busy {100 * busy / elapsed:.1f}% in steps, "
            f"{delta('device_steps_ahead') / steps:.2f} steps ahead at launch")
    decode_steps = delta("device_decode_steps")
    if decode_steps:
        line += (f"; decode-only steps {decode_steps} at "
                 f"{1e3 * delta('device_decode_seconds') / decode_steps:.2f} ms "
                 f"(batch {delta('device_decode_seqs') / decode_steps:.1f})")
    prompt_steps = delta("device_prompt_steps")
    if prompt_steps:
        line += (f"; prompt-only steps {prompt_steps} at "
                 f"{1e3 * delta('device_prompt_seconds') / prompt_steps:.2f} ms "
                 f"({delta('device_prompt_tokens') / prompt_steps:,.0f} tokens)")
    holds = delta("launch_holds")
    if holds:
        line += (f"; launches held {holds} for {1e3 * delta('launch_hold_seconds') / holds:.2f}"
                 f" ms, {delta('launch_hold_arrivals')} requests arrived meanwhile")
    return line
