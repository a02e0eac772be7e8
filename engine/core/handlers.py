"""The engine core's front door: the frames from the frontend in, the frames to send back out.

The core process's loop (engine/core_proc.py) does the I/O only: it hands each decoded frame
to `handle`, calls `tick` between steps (leases, queue times, waiting prep_recv calls, the
answers of deferred calls) and `step`, and sends whatever frames they return. The dispatch is
two tables: one by frame type, one by call name, built from the calls declared in
microserve/messages.CALLS (a call `name` is handled by the `on_{name}` method below).

    Generate  -> add_request               Outputs (a handed-over first token) | Rejected
    Invoke    -> CALLS[method], on_{name}  Reply | CallFailed, now or from a later tick
    Shutdown  -> shut_down = True
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec

from engine.core.adapters import load_key
from engine.frames import (CallFailed, Frame, Generate, Invoke, Outputs, Rejected, Reply,
                           Shutdown, ToCore)
from kvcache.integrity import IntegrityError
from microserve.backend import MicroservingError, RequestRejected
from microserve.messages import CALLS, AbortRequest, AbortResponse, LoadLoraRequest, PinResponse

log = logging.getLogger("microserve.core")
_encoder = msgspec.msgpack.Encoder()


class Tick(NamedTuple):
    """What `tick` did: the frames to send, and whether anything was freed or settled (a
    stalled engine may then schedule again)."""

    frames: list[Frame]
    progressed: bool


class MessageHandlers:
    """Mixed into EngineCore. `handle`, `tick` and `fail_step` return the frames to send, in
    order; a handler adds them to `_outbox`."""

    def _init_handlers(self) -> None:
        self.shut_down = False  # a Shutdown came: the loop ends
        self._outbox: list[Frame] = []
        # request id -> (call, id) of the remote_send (or waiting prep_recv) to answer
        self._deferred: dict[str, tuple] = {}
        self._frame_handlers = {Generate: self._on_generate, Invoke: self._on_invoke,
                                Shutdown: self._on_shutdown}
        # call name -> (its declaration, its handler): a handler returns the call's answer,
        # or None for one answered later (`poll`, from `tick`)
        self._call_handlers = {name: (call, getattr(self, f"on_{name}"))
                               for name, call in CALLS.items()}

    def handle(self, msg: ToCore) -> list[Frame]:
        """Act on one frame from the frontend. Returns the frames that answer it."""
        self._frame_handlers[type(msg)](msg)
        return self._take_outbox()

    def tick(self, now: float) -> Tick:
        """What is due between steps by `now` (time.monotonic()): expired leases free pages,
        generations past their queue time are refused, freed pages admit waiting prep_recv
        calls, every deferred call now settled is answered (a finished send frees pages
        too), and the generations failed meanwhile (past their queue time, or their LoRA
        adapter's read back from disk failed) are refused."""
        progressed = False
        deadline = self.next_deadline()
        if deadline is not None and deadline <= now and self.expire(now):
            progressed = True
        self.exchange.admit_waiting(now)
        if self._answer_deferred():
            progressed = True
        for request_id, e in self.take_rejected():
            self._outbox.append(Rejected(request_id, str(e), e.param, e.status, e.code))
            progressed = True
        return Tick(self._take_outbox(), progressed)

    def fail_step(self, error: Exception) -> list[Frame]:
        """After `step` raised: fail every request in the engine (which of them made the step
        raise is unknown) and answer the calls that failed with them. The caller then checks
        that nothing leaked (`check_integrity`)."""
        why = f"internal error in the engine step: {type(error).__name__}"
        for request_id in self.fail_requests(why):
            self._outbox.append(Rejected(request_id, why, None, 500))
        self._answer_deferred()
        return self._take_outbox()

    def _take_outbox(self) -> list[Frame]:
        frames, self._outbox = self._outbox, []
        return frames

    # ---- frames -------------------------------------------------------------------------------

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.shut_down = True

    def _on_generate(self, msg: Generate) -> None:
        try:
            first = self.add_request(msg.request_id, msg.prompt, msg.params, msg.begin,
                                     msg.first_token, msg.queue_s, msg.received_at,
                                     msg.priority, msg.first_token_delivered)
        except (RequestRejected, MicroservingError) as e:
            self._outbox.append(Rejected(msg.request_id, str(e), e.param,
                                         getattr(e, "status", 400), getattr(e, "code", None)))
        except Exception as e:  # our bug: it fails this request, never the engine
            log.exception("request %s failed to start", msg.request_id)
            self.abort_request(msg.request_id)
            self._outbox.append(Rejected(msg.request_id, f"internal error: {type(e).__name__}",
                                         None, 500))
        else:
            if first is not None:  # a first token handed over by the KV's sender: out now
                self._outbox.append(Outputs([first]))

    def _on_invoke(self, msg: Invoke) -> None:
        if msg.method not in self._call_handlers:
            self._reply(msg.id, MicroservingError(404, f"unknown call {msg.method!r}"))
            return
        call, handler = self._call_handlers[msg.method]
        try:
            request = call.decode_request(msg.request)
            answer = handler(request, msg.received_at or None)
        except (RequestRejected, MicroservingError) as e:
            self._reply(msg.id, e)
        except IntegrityError as e:
            self._reply(msg.id, RuntimeError(f"integrity check failed: {e}"))
        except Exception as e:  # our bug: it fails this call, never the engine
            log.exception("%s failed", msg.method)
            self._reply(msg.id, RuntimeError(f"internal error: {type(e).__name__}"))
        else:
            if answer is None:  # answered once settled (_answer_deferred)
                key = (load_key(request.lora_name) if isinstance(request, LoadLoraRequest)
                       else request.request_id)
                self._deferred[key] = (call, msg.id)
            else:
                self._reply(msg.id, answer)

    def _reply(self, call_id: int, answer) -> None:
        """Send `answer` (encoded as its call's answer type), or the failure it is an
        exception of."""
        if not isinstance(answer, Exception):
            self._outbox.append(Reply(call_id, msgspec.Raw(_encoder.encode(answer))))
            return
        ours = isinstance(answer, (RequestRejected, MicroservingError))
        self._outbox.append(CallFailed(call_id, str(answer),
                                       getattr(answer, "status", 400) if ours else 500,
                                       getattr(answer, "param", None),
                                       getattr(answer, "code", None)))

    def _answer_deferred(self) -> bool:
        """Answer the deferred calls now settled. True if there were any."""
        answers = self.poll()
        for rid, outcome in answers:
            waiting = self._deferred.pop(rid, None)
            if waiting is not None:
                self._reply(waiting[1], outcome)
        return bool(answers)

    # ---- the calls' handlers (messages.CALLS): (request, received_at) -> answer | None --------

    def on_stats(self, request, received_at):
        return self.stats()

    def on_check_integrity(self, request, received_at):
        self.check_integrity()
        return True

    def on_prep_recv(self, r, received_at):
        return self.exchange.prep_recv(r.request_id, r.prompt, r.end, r.lease_s, r.wait_s,
                                       self.adapter_id(r.lora_name), r.own or 0)

    def on_remote_send(self, r, received_at):
        self._check_sends()
        return self.remote_send(r.request_id, r.prompt, r.begin, r.end, r.kv_addr,
                                r.sampling, received_at, r.queue_s, r.priority, r.lora_name)

    def _check_sends(self) -> None:
        """A tensor-parallel engine sends KV only through the transfer its ranks' pools were
        exported for (kvcache/transfer/tp_peer.py)."""
        if self.config.tensor_parallel_size > 1 and self.transfer.kind == "none":
            raise MicroservingError(400, "this engine cannot send KV: it is tensor-parallel "
                                    f"(--tensor-parallel-size {self.config.tensor_parallel_size}"
                                    ") and runs with --kv-transfer none (or without an engine "
                                    "key), so its ranks' pools are not exported")

    def on_send_to(self, r, received_at):
        self._check_sends()
        return self.exchange.send_to(r.request_id, r.begin, r.kv_addr)

    def on_commit(self, r, received_at):
        return self.exchange.commit(r.request_id, r.pin)

    def on_abort(self, r: AbortRequest, received_at) -> AbortResponse:
        """Drop the request wherever it is; a generation gets its finishing output. An early
        send's abort that came first is kept for the send (`RequestLifecycle.abort_request`)."""
        aborted = r.request_id in self.requests
        out = self.abort_request(r.request_id, r.early_send)
        if out is not None:
            self._outbox.append(Outputs([out]))
        return AbortResponse(aborted or r.early_send)

    def on_load_lora_adapter(self, r, received_at):
        return self._lora("load").load_call(r.lora_name, r.lora_path)

    def on_unload_lora_adapter(self, r, received_at):
        return self._lora("unload").unload(r.lora_name)

    def _lora(self, what: str):
        if self.adapters is None:
            raise MicroservingError(400, f"cannot {what} LoRA adapters: LoRA is off on this "
                                    "engine (start it with --enable-lora and --lora-dir)",
                                    "lora_name")
        return self.adapters

    def on_pin(self, r, received_at) -> PinResponse:
        return _pinned(self.kv.pin, r.prompt)

    def on_unpin(self, r, received_at) -> PinResponse:
        return _pinned(self.kv.unpin, r.prompt)


def _pinned(pin, prompt: list[int]) -> PinResponse:
    try:
        return PinResponse(pin(prompt))
    except ValueError as e:  # unpin of a prefix that is not pinned
        raise MicroservingError(400, str(e), "prompt") from None
