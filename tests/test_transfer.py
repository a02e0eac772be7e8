"""KV transfer backends (shm, tcp) and the sender's transfer thread.

Receivers run in their own process, as engines do: a small script (RECEIVER below) owns the
backend and answers commands on stdin, so the sender here writes across a process boundary.
One receiver per kind serves the module (reset between tests: windows closed, pool zeroed);
tests that kill theirs start their own.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvcache.transfer import (
    KVLayout,
    Peer,
    TransferError,
    Window,
    make_backend,
    open_peer,
)
from kvcache.transfer.sender import KVSender
from kvcache.transfer.shm import ShmBackend, ShmPeer
from kvcache.transfer import tcp_wire
from kvcache.transfer.tcp import TcpBackend, TcpPeer
from kvcache.transfer.auth import kv_digest, sign, transfer_key

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout("test-model", "bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
RECV_PAGES = 8  # 32 slots on the receiver
SEND_PAGES = 6  # 24 slots on the sender
ROWS = (2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)  # a layer as [K/V, slot, head, dim]
# Scattered, unsorted slots across pages, with page-internal offsets that differ on each side.
SRC = torch.tensor([3, 17, 5, 22, 9])
DST = torch.tensor([12, 1, 27, 6, 20])
KEY = transfer_key("test-engine-key")  # the deployment's transfer key, shared by both sides
FAKE = sign({"kind": "fake"}, KEY)  # a receiver descriptor for the sender's fake peers

RECEIVER = """
import json, sys, torch
from kvcache.transfer import KVLayout, Window, make_backend

kind, layout, num_pages = sys.argv[1], KVLayout.from_dict(json.loads(sys.argv[2])), sys.argv[3]
device = "cuda" if kind == "cuda_ipc" else "cpu"
backend = make_backend(kind, layout, int(num_pages), device, key=bytes.fromhex(sys.argv[4]))
print(json.dumps(backend.descriptor()), flush=True)
windows = []
for line in sys.stdin:
    cmd, *args = line.split()
    reply = "ok"
    if cmd == "open":
        windows.append(backend.open_window())
        reply = [windows[-1].index, windows[-1].tag]
    elif cmd == "close":  # answers the window's seal
        seal = backend.close_window(Window(int(args[0]), int(args[1])))
        reply = None if seal is None else seal.hex()
    elif cmd == "dump":
        torch.save(backend.kv.cpu(), args[0])
    elif cmd == "reset":
        for w in windows:
            backend.close_window(w)
        windows.clear()
        backend.kv.zero_()
    print(json.dumps(reply), flush=True)
backend.close()
"""


class Receiver:
    """A receiving engine's backend in a child process, driven over its stdin and stdout."""

    def __init__(self, kind: str):
        args = [kind, json.dumps(LAYOUT.to_dict()), str(RECV_PAGES), KEY.hex()]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.descriptor = self._reply()

    def _reply(self):
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "the receiver process did not answer within 60 s"
        return json.loads(self.proc.stdout.readline())

    def _call(self, *cmd):
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def open_window(self) -> Window:
        return Window(*self._call("open"))

    def close_window(self, w: Window) -> str | None:
        """Close `w`; its seal (hex), or None."""
        return self._call("close", w.index, w.tag)

    def reset(self) -> None:
        assert self._call("reset") == "ok"

    def pool(self, tmp_path: Path) -> torch.Tensor:
        path = tmp_path / "pool.pt"
        assert self._call("dump", path) == "ok"
        return torch.load(path)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """End the receiver; unless killed, it must exit cleanly (backend.close() included)."""
        self.proc.stdin.close()  # EOF ends the receiver's command loop
        returncode = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        assert returncode in (0, -signal.SIGKILL), f"receiver exited with {returncode}"


@pytest.fixture(scope="module")
def shared_receivers():
    receivers: dict[str, Receiver] = {}
    yield receivers
    for r in receivers.values():
        r.stop()


@pytest.fixture
def receiver(shared_receivers):
    """receiver(kind): the module's receiver of that kind, reset."""

    def get(kind: str) -> Receiver:
        if kind not in shared_receivers:
            shared_receivers[kind] = Receiver(kind)
        shared_receivers[kind].reset()
        return shared_receivers[kind]

    return get


@pytest.fixture
def start_receiver():
    """start_receiver(kind): a receiver of this test's own, stopped after it."""
    receivers = []

    def start(kind: str) -> Receiver:
        receivers.append(Receiver(kind))
        return receivers[-1]

    yield start
    for r in receivers:
        r.stop()


def sender_pool(seed: int = 0, kind: str = "shm") -> torch.Tensor:
    """The sender's pool: on the GPU for cuda_ipc (GPU to GPU), in CPU memory otherwise."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(LAYOUT.pool_shape(SEND_PAGES), generator=g).to(torch.bfloat16)
    return pool.cuda() if kind == "cuda_ipc" else pool


# Receivers in another process; cuda_ipc needs a GPU (two processes sharing it).
KINDS = ["shm", "tcp", pytest.param("cuda_ipc", marks=pytest.mark.gpu)]
ONE_SIDED = ("shm", "cuda_ipc")  # the sender writes the pool itself: a closed window refuses


def expected_pool(local: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """The receiver's pool after writing SRC -> DST of `layers` from `local` into zeros."""
    out = torch.zeros(LAYOUT.pool_shape(RECV_PAGES), dtype=torch.bfloat16)
    for layer in layers:
        out[layer].view(ROWS)[:, DST] = local[layer].view(ROWS)[:, SRC]
    return out


# ---- backends, receiver in another process ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_writes_land_exactly_at_destination_slots(kind, receiver, tmp_path):
    rx = receiver(kind)
    local = sender_pool(kind=kind)
    peer = open_peer(rx.descriptor, local, LAYOUT, KEY)
    w = rx.open_window()
    for layer in (0, 2):
        peer.write(w, layer, SRC, DST)
    peer.flush(w)
    assert torch.equal(rx.pool(tmp_path), expected_pool(local.cpu(), [0, 2]))  # byte-equal
    peer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_closed_window_refuses_writes_and_flush(kind, receiver, tmp_path):
    rx = receiver(kind)
    peer = open_peer(rx.descriptor, sender_pool(kind=kind), LAYOUT, KEY)
    w = rx.open_window()
    rx.close_window(w)
    if kind in ONE_SIDED:
        with pytest.raises(
            TransferError, match=re.escape(f"closed window {w.index} (tag {w.tag})")
        ):
            peer.write(w, 0, SRC, DST)
    else:  # tcp writes are one-way: the receiver drops it, the flush reports it
        peer.write(w, 0, SRC, DST)
    with pytest.raises(TransferError, match=re.escape(f"window {w.index} (tag {w.tag})")):
        peer.flush(w)
    assert torch.equal(rx.pool(tmp_path), expected_pool(sender_pool(), []))
    peer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_seal_reaches_the_receiver_behind_the_writes(kind, receiver):
    """What the sender says its KV is of (the seal, sent after the writes) is what the
    receiver's close_window hands back; an unsealed window hands back nothing, and a window
    reopened at the same index starts unsealed."""
    rx = receiver(kind)
    peer = open_peer(rx.descriptor, sender_pool(kind=kind), LAYOUT, KEY)
    sealed, unsealed = rx.open_window(), rx.open_window()
    digest = kv_digest([5, 6, 7], 1)
    peer.write(sealed, 0, SRC, DST)
    peer.seal(sealed, digest)
    peer.flush(sealed)
    assert rx.close_window(sealed) == digest.hex()
    assert rx.close_window(sealed) is None  # closed before
    reopened = rx.open_window()
    assert reopened.index == sealed.index and rx.close_window(reopened) is None
    peer.write(unsealed, 0, SRC, DST)
    peer.flush(unsealed)
    assert rx.close_window(unsealed) is None
    peer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_killed_receiver_fails_fast(kind, start_receiver):
    rx = start_receiver(kind)
    local = sender_pool(kind=kind)
    peer = open_peer(rx.descriptor, local, LAYOUT, KEY)
    w = rx.open_window()
    peer.write(w, 0, SRC, DST)
    peer.flush(w)
    assert peer.alive()
    rx.kill()

    start = time.monotonic()
    while peer.alive() and time.monotonic() - start < 5:  # tcp: until the FIN arrives
        time.sleep(0.01)
    assert not peer.alive()
    lost = f"pid {rx.proc.pid} exited" if kind in ONE_SIDED else "connection to receiver .* lost"
    with pytest.raises(TransferError, match=lost):
        peer.write(w, 1, SRC, DST)  # tcp: may still land in the socket buffer
        peer.flush(w)
    assert time.monotonic() - start < 5
    with pytest.raises(TransferError,
                       match="not running" if kind in ONE_SIDED else "cannot connect"):
        open_peer(rx.descriptor, local, LAYOUT, KEY)
    peer.close()


def test_tcp_handshake_refuses_another_layout(receiver):
    rx = receiver("tcp")
    other = dataclasses.replace(LAYOUT, head_dim=16)
    with pytest.raises(TransferError, match="head_dim") as e:
        open_peer(rx.descriptor, torch.zeros(other.pool_shape(2), dtype=torch.bfloat16), other,
                  KEY)
    assert str(LAYOUT.to_dict()) in str(e.value) and str(other.to_dict()) in str(e.value)
    open_peer(rx.descriptor, sender_pool(), LAYOUT, KEY).close()  # the listener still serves


# ---- backends in this process ----------------------------------------------------------------


def test_tcp_close_ends_live_connections():
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY)
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    w = backend.open_window()
    peer.write(w, 0, SRC, DST)
    peer.flush(w)
    backend.close()
    assert [t.name for t in threading.enumerate() if t.name.startswith("kv-tcp")] == []
    with pytest.raises(TransferError, match="connection to receiver .* lost"):
        peer.flush(w)
    peer.close()


def test_tcp_receiver_reports_out_of_range_writes_at_flush():
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY)
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    w = backend.open_window()
    peer.write(w, 0, SRC[:2], torch.tensor([1, 32]))
    with pytest.raises(TransferError, match="slots 1..32 out of range for 32 slots"):
        peer.flush(w)
    peer.flush(w)  # reported once; the window and the connection stay usable
    assert torch.equal(backend.kv, expected_pool(sender_pool(), []))
    peer.close()
    backend.close()


def test_tcp_receiver_drops_writes_outside_the_window_and_never_seals_it():
    """The tcp receiver applies writes itself, so it keeps each window inside the slots it was
    opened with: a write naming any other slot is dropped whole, reported at the flush, and
    the window's seal is not kept."""
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY)
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    w = backend.open_window(DST)
    peer.write(w, 0, SRC, torch.tensor([12, 1, 0, 6, 21]))  # 0 and 21: not the window's
    peer.seal(w, kv_digest([1], 0))
    with pytest.raises(TransferError, match=re.escape(
            f"slots [0, 21] are outside the 5 slots reserved for window {w.index}; the write "
            "was dropped")):
        peer.flush(w)
    assert torch.count_nonzero(backend.kv) == 0
    assert backend.close_window(w) is None
    w = backend.open_window(DST)  # inside it: written and sealed
    peer.write(w, 0, SRC, DST.flip(0))
    peer.seal(w, kv_digest([1], 0))
    peer.flush(w)
    assert backend.close_window(w) == kv_digest([1], 0)
    assert torch.count_nonzero(backend.kv) > 0
    peer.close()
    backend.close()


@pytest.mark.parametrize("backend_cls", [ShmBackend, TcpBackend])
def test_window_table_fills_and_tags_are_secret_and_fresh(backend_cls):
    backend = backend_cls(LAYOUT, 2, num_windows=4, key=KEY)
    windows = [backend.open_window() for _ in range(4)]
    assert [w.index for w in windows] == [0, 1, 2, 3]
    # Tags are random 63-bit secrets (odd, so never the shm table's 0 = free): not a counter.
    tags = [w.tag for w in windows]
    assert all(0 < t < 2**63 and t % 2 == 1 for t in tags) and len(set(tags)) == 4
    assert max(tags) > 2**40
    assert backend.open_window() is None
    backend.close_window(windows[2])
    backend.close_window(windows[2])  # closing twice is a no-op
    backend.close_window(windows[0])
    reopened = [backend.open_window(), backend.open_window()]
    assert [w.index for w in reopened] == [0, 2]
    assert not {w.tag for w in reopened} & set(tags)
    backend.close_window(windows[2])  # a stale window must not close its index's new tenant
    assert backend.open_window() is None
    backend.close()


def test_shm_close_window_waits_for_a_write_in_progress():
    backend = ShmBackend(LAYOUT, RECV_PAGES, key=KEY)
    peer = ShmPeer(backend.descriptor(), sender_pool(), LAYOUT)
    w = backend.open_window()
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (backend.close_window(w), closed.set()))
    with peer._window_open(w):  # what write() holds while it copies
        closer.start()
        assert not closed.wait(0.2)
    assert closed.wait(5)
    closer.join()
    with pytest.raises(TransferError, match="closed window"):
        peer.write(w, 0, SRC, DST)
    peer.close()
    backend.close()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("boot_id", "another-boot", "shm needs both engines on one host"),
        ("inode", -1, "is not the KV pool of shm receiver pid"),
    ],
)
def test_shm_refuses_a_pool_it_cannot_trust(field, value, message):
    backend = ShmBackend(LAYOUT, RECV_PAGES, key=KEY)
    descriptor = {**backend.descriptor(), field: value}
    with pytest.raises(TransferError, match=message):
        ShmPeer(descriptor, sender_pool(), LAYOUT)
    backend.close()


def test_shm_backend_close_refuses_later_writes_and_peers():
    backend = ShmBackend(LAYOUT, RECV_PAGES, key=KEY)
    peer = ShmPeer(backend.descriptor(), sender_pool(), LAYOUT)
    w = backend.open_window()
    backend.close()
    with pytest.raises(TransferError, match="closed window"):
        peer.write(w, 0, SRC, DST)
    assert backend.open_window() is None
    # Its memfd is closed: /proc/PID/fd/N is gone, or already another file of that process.
    with pytest.raises(TransferError, match="cannot open the KV pool of shm receiver pid|"
                                            "is not a microserve KV pool"):
        ShmPeer(backend.descriptor(), sender_pool(), LAYOUT)
    assert torch.equal(backend.kv, expected_pool(sender_pool(), []))  # still mapped
    peer.close()


def test_shm_peer_prefaults_the_receivers_pool():
    """The peer maps the pool's pages on its own thread, so the copies do not fault them in."""
    backend = ShmBackend(LAYOUT, 4096, key=KEY)  # 3 MB: 768 pages of 4 KB
    peer = ShmPeer(backend.descriptor(), sender_pool(), LAYOUT)
    peer._prefault._thread.join(10)
    if not peer._prefault.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    size = backend.descriptor()["nbytes"]
    assert peer._prefault.done == size
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    peer._remote.view(-1)[:: mmap.PAGESIZE // 4].fill_(1.0)  # one write into every page
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < 16
    peer.close()
    again = ShmPeer(backend.descriptor(), sender_pool(), LAYOUT)
    again.close()  # at once: stops the prefault thread before unmapping
    assert not again._prefault._thread.is_alive()
    backend.close()


def test_factories_name_the_choices():
    with pytest.raises(ValueError, match="choose one of shm, tcp, cuda_ipc, nvshmem, none"):
        make_backend("rdma", LAYOUT, 2, "cpu")
    with pytest.raises(ValueError, match="shm needs the KV pool in CPU memory"):
        make_backend("shm", LAYOUT, 2, "cuda", key=KEY)
    with pytest.raises(ValueError, match="cuda_ipc needs the KV pool on a CUDA device, not cpu"):
        make_backend("cuda_ipc", LAYOUT, 2, "cpu", key=KEY)
    with pytest.raises(ValueError, match="--kv-transfer cuda_ipc needs an engine key"):
        make_backend("cuda_ipc", LAYOUT, 2, "cuda")
    with pytest.raises(TransferError, match="--kv-transfer none"):
        open_peer(make_backend("none", LAYOUT, 2, "cpu").descriptor(), sender_pool(), LAYOUT,
                  KEY)


# ---- KVSender ---------------------------------------------------------------------------------


class FakePeer(Peer):
    """Records calls. A write signals `entered`, then blocks while `gate` is clear; at
    `fail_layer` the receiver is gone: that write raises TransferError and alive() turns False.
    A flush raises TransferError(`flush_error`) if set (the receiver closed the window)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_layer: int | None = None
        self.receiver_alive = True
        self.flush_error: str | None = None
        self.closed = False

    def write(self, window, layer, src_slots, dst_slots, ready=None):
        self.calls.append(("write", window, layer, src_slots.tolist(), dst_slots.tolist()))
        self.entered.set()
        assert self.gate.wait(10)
        if layer == self.fail_layer:
            self.receiver_alive = False
            raise TransferError(f"receiver gone at layer {layer}")

    def seal(self, window, digest):
        self.calls.append(("seal", window, digest))

    def flush(self, window):
        self.calls.append(("flush", window))
        if self.flush_error is not None:
            raise TransferError(self.flush_error)

    def alive(self):
        return self.receiver_alive

    def close(self):
        self.closed = True


@pytest.fixture
def fake_peers(monkeypatch):
    """Every peer KVSender opens, in order."""
    peers: list[FakePeer] = []

    def open_fake(descriptor, local_kv, layout, key, local_ranks=None):
        peers.append(FakePeer())
        return peers[-1]

    monkeypatch.setattr("kvcache.transfer.sender.open_peer", open_fake)
    return peers


def write_call(window: Window, layer: int) -> tuple:
    return ("write", window, layer, SRC.tolist(), DST.tolist())


def test_sender_runs_writes_behind_the_caller_and_reports_completion(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    w = Window(0, 1)
    sender.start("a", FAKE, w, DST)
    peer = fake_peers[0]
    peer.gate.clear()
    sender.write_all_layers("a", SRC, DST)
    sender.finish("a")  # both returned while the transfer thread is stuck in layer 0
    assert peer.entered.wait(5)
    assert peer.calls == [write_call(w, 0)]
    assert sender.completed() == [] and not done.is_set()

    peer.gate.set()
    assert done.wait(5)
    assert sender.completed() == [("a", None)]
    assert peer.calls == [write_call(w, 0), write_call(w, 1), write_call(w, 2), ("flush", w)]
    sender.close()
    assert peer.closed


def test_wait_flushed_returns_once_the_jobs_landed_or_at_its_timeout(fake_peers):
    sender = KVSender(sender_pool(), LAYOUT, notify=lambda: None, key=KEY)
    w = Window(0, 1)
    sender.start("a", FAKE, w, DST)
    peer = fake_peers[0]
    peer.gate.clear()
    sender.write_all_layers("a", SRC, DST)
    sender.finish("a")
    assert peer.entered.wait(5)
    t0 = time.monotonic()
    sender.wait_flushed(["a"], 0.05)  # stuck in layer 0: gives up after 50 ms
    assert 0.05 <= time.monotonic() - t0 < 1.0 and sender.completed() == []
    threading.Timer(0.05, peer.gate.set).start()
    sender.wait_flushed(["a", "never-started"], 5.0)  # returns as "a" completes
    assert time.monotonic() - t0 < 2.0
    assert sender.completed() == [("a", None)]
    sender.close()


def test_sender_cancel_waits_for_the_running_write_and_skips_the_rest(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    wa, wb = Window(0, 1), Window(1, 2)
    sender.start("a", FAKE, wa, DST)
    peer = fake_peers[0]
    peer.gate.clear()
    sender.write_all_layers("a", SRC, DST)
    sender.finish("a")
    assert peer.entered.wait(5)

    cancelled = threading.Event()
    canceller = threading.Thread(target=lambda: (sender.cancel("a"), cancelled.set()))
    canceller.start()
    assert not cancelled.wait(0.2)  # layer 0's write still reads the source slots
    peer.gate.set()
    assert cancelled.wait(5)
    canceller.join()

    sender.start("b", FAKE, wb, DST)  # the same receiver: the open peer is reused
    sender.finish("b")
    assert done.wait(5)
    assert sender.completed() == [("b", None)]
    assert peer.calls == [write_call(wa, 0), ("flush", wb)]
    assert len(fake_peers) == 1
    sender.close()


def test_sender_failed_job_reports_its_error_and_the_next_job_reconnects(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    w = Window(0, 1)
    sender.start("a", FAKE, w, DST)
    fake_peers[0].fail_layer = 1
    sender.write_all_layers("a", SRC, DST)
    sender.finish("a")
    assert done.wait(5)
    assert sender.completed() == [("a", "receiver gone at layer 1")]
    assert fake_peers[0].calls == [write_call(w, 0), write_call(w, 1)]  # no layer 2, no flush
    assert fake_peers[0].closed

    sender.start("b", FAKE, w, DST)
    assert len(fake_peers) == 2
    sender.close()


def test_sender_keeps_the_peer_when_only_the_window_was_closed(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    sender.start("a", FAKE, Window(0, 1), DST)
    peer = fake_peers[0]
    peer.flush_error = "receiver closed window 0"
    sender.finish("a")
    assert done.wait(5)
    assert sender.completed() == [("a", "receiver closed window 0")]
    sender.start("b", FAKE, Window(1, 2), DST)
    assert len(fake_peers) == 1 and not peer.closed
    sender.close()


def test_sender_drops_a_cached_peer_whose_receiver_is_gone(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    sender.start("a", FAKE, Window(0, 1), DST)
    sender.finish("a")
    assert done.wait(5)
    done.clear()
    fake_peers[0].receiver_alive = False  # e.g. the receiver restarted on the same port
    sender.start("b", FAKE, Window(0, 1), DST)
    assert len(fake_peers) == 2
    sender.finish("b")
    assert done.wait(5)
    assert sender.completed() == [("a", None), ("b", None)]
    assert fake_peers[0].closed and not fake_peers[1].closed
    sender.close()


def test_sender_seals_the_window_after_its_writes_and_before_its_flush(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    w, digest = Window(0, 1), kv_digest([3, 4], 0)
    sender.start("a", FAKE, w, DST, digest)
    sender.write("a", 2, SRC, DST)
    sender.finish("a")
    assert done.wait(5)
    assert fake_peers[0].calls == [write_call(w, 2), ("seal", w, digest), ("flush", w)]
    sender.close()


class WholeStepPeer(FakePeer):
    whole_steps = True

    def write_layers(self, window, layers, src_slots, dst_slots, ready=None):
        self.calls.append(("write_layers", window, layers, src_slots.tolist()))


def test_sender_hands_a_whole_step_peer_each_step_once(monkeypatch):
    peer = WholeStepPeer()
    monkeypatch.setattr("kvcache.transfer.sender.open_peer", lambda *args: peer)
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    w = Window(0, 1)
    sender.start("a", FAKE, w, DST)
    sender.write_all_layers("a", SRC, DST)  # a cached prefix: one write of all layers
    for step_slots in (SRC[:2], SRC[2:]):  # two forward steps
        for layer in range(LAYOUT.num_layers):
            sender.layer_written("a", layer, step_slots, DST[: len(step_slots)])
    sender.finish("a")
    assert done.wait(5)
    everything = range(LAYOUT.num_layers)
    assert peer.calls == [("write_layers", w, everything, SRC.tolist()),
                          ("write_layers", w, everything, SRC[:2].tolist()),
                          ("write_layers", w, everything, SRC[2:].tolist()), ("flush", w)]
    sender.close()


def test_sender_hands_a_host_peer_each_layer_as_it_is_written(fake_peers):
    done = threading.Event()
    sender = KVSender(sender_pool(), LAYOUT, notify=done.set, key=KEY)
    w = Window(0, 1)
    sender.start("a", FAKE, w, DST)
    for layer in range(LAYOUT.num_layers):
        sender.layer_written("a", layer, SRC, DST)
    sender.finish("a")
    assert done.wait(5)
    assert fake_peers[0].calls == [write_call(w, 0), write_call(w, 1), write_call(w, 2),
                                   ("flush", w)]
    sender.close()


def test_sender_refuses_misuse(fake_peers):
    sender = KVSender(sender_pool(), LAYOUT, key=KEY)
    sender.start("a", FAKE, Window(0, 1), DST)
    with pytest.raises(ValueError, match="'a' is already running"):
        sender.start("a", FAKE, Window(1, 2), DST)
    with pytest.raises(ValueError, match="5 source slots but 2 destinations"):
        sender.write("a", 0, SRC, DST[:2])
    for write in (sender.write, sender.layer_written):  # nothing queued outside the window
        with pytest.raises(ValueError, match=re.escape(
                "KV transfer job 'a': destination slots [0, 2, 3] are outside the 5 slots of "
                "its window 0")):
            write("a", 1, SRC, torch.tensor([12, 0, 27, 2, 3]))
    with pytest.raises(ValueError, match=re.escape("destination slots [13]")):
        sender.write_all_layers("a", SRC[:1], torch.tensor([13]))
    assert fake_peers[0].calls == []
    sender.finish("a")
    with pytest.raises(ValueError, match="'a' is finished"):
        sender.write("a", 0, SRC, DST)
    with pytest.raises(ValueError, match="'b' is not running"):
        sender.finish("b")
    sender.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_sender_moves_every_layer_to_a_receiver_process(kind, receiver, tmp_path):
    rx = receiver(kind)
    local = sender_pool()
    done = threading.Event()
    sender = KVSender(local, LAYOUT, notify=done.set, key=KEY)
    sender.start("a", rx.descriptor, rx.open_window(), DST)
    sender.write_all_layers("a", SRC, DST)
    sender.finish("a")
    assert done.wait(10)
    assert sender.completed() == [("a", None)]
    assert torch.equal(rx.pool(tmp_path), expected_pool(local, [0, 1, 2]))
    sender.close()


EXIT_MID_TRANSFER = """
import time, torch
from kvcache.transfer import KVLayout
from kvcache.transfer.sender import KVSender
from kvcache.transfer.tcp import TcpBackend

layout = KVLayout("m", "float32", 16, 4, 3, 64)
backend = TcpBackend(layout, 256, key=b"k")
sender = KVSender(torch.zeros(layout.pool_shape(256)), layout, key=b"k")
slots = torch.arange(256 * 16)
for job in map(str, range(50)):
    sender.start(job, backend.descriptor(), backend.open_window(), slots)
    sender.write_all_layers(job, slots, slots)
    sender.finish(job)
time.sleep(0.1)  # exit mid-transfer with both still open
"""


def test_exit_mid_transfer_is_clean():
    """The exit hooks close a sender and a tcp backend left open: a daemon thread still inside
    torch ops when the interpreter finalizes aborts the process (without the hooks this fails
    about half the time on 2 cores)."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_MID_TRANSFER],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# ---- who may transfer (kvcache/transfer/auth.py) -------------------------------------------


def _counting_listener() -> tuple[socket.socket, list]:
    """A plain TCP listener that records every connection made to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return listener, accepted


def test_a_sender_dials_nothing_from_a_descriptor_it_cannot_verify():
    listener, accepted = _counting_listener()
    port = listener.getsockname()[1]
    crafted = {"kind": "tcp", "host": "127.0.0.1", "port": port, "num_pages": 8}
    cases = [
        (crafted, "not signed"),
        ({**crafted, "mac": "00" * 32}, "not signed by an engine of this deployment"),
        (sign(crafted, transfer_key("another deployment")), "not signed by an engine of this"),
    ]
    for descriptor, message in cases:
        with pytest.raises(TransferError, match=message):
            open_peer(descriptor, sender_pool(), LAYOUT, KEY)
    with pytest.raises(TransferError, match="no engine key"):
        open_peer(sign(crafted, KEY), sender_pool(), LAYOUT, None)
    time.sleep(0.2)
    assert accepted == []  # not even a connect: no port scanning through remote_send
    listener.close()


def test_a_signed_descriptor_altered_in_one_field_is_refused():
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY)
    descriptor = backend.descriptor()
    for field, value in [("port", descriptor["port"] + 1), ("host", "10.0.0.1"),
                         ("num_pages", 10**6)]:
        with pytest.raises(TransferError, match="not signed by an engine of this deployment"):
            open_peer({**descriptor, field: value}, sender_pool(), LAYOUT, KEY)
    open_peer(descriptor, sender_pool(), LAYOUT, KEY).close()  # the real one opens
    backend.close()


def test_shm_sender_refuses_a_file_that_is_not_a_kv_pool(tmp_path):
    """The probe's attack: a descriptor naming an ordinary file another process holds open. Even
    signed with the right key (which a caller does not have), it is not a microserve memfd."""
    target = tmp_path / "victim.txt"
    target.write_bytes(b"precious" * 1000)
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import sys, time; f = open({str(target)!r}, 'r+b'); "
                               "print(f.fileno(), flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    fd = int(holder.stdout.readline())
    backend = ShmBackend(LAYOUT, RECV_PAGES, key=KEY)
    real = backend.descriptor()
    crafted = {**{k: v for k, v in real.items() if k != "mac"}, "pid": holder.pid, "fd": fd,
               "inode": target.stat().st_ino, "nbytes": target.stat().st_size, "kv_offset": 0,
               "num_pages": 1}
    with pytest.raises(TransferError, match="not signed"):
        open_peer(crafted, sender_pool(), LAYOUT, KEY)
    with pytest.raises(TransferError, match="is not a microserve KV pool"):
        open_peer(sign(crafted, KEY), sender_pool(), LAYOUT, KEY)
    holder.kill()
    holder.wait()
    assert target.read_bytes() == b"precious" * 1000
    backend.close()


def _hung_up(sock: socket.socket) -> bool:
    """Whether the other side closed the connection (FIN, or RST when bytes were left unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _raw_hello(port: int) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    challenge = tcp_wire.recv_message(sock)["nonce"]
    return sock, challenge


def test_tcp_listener_refuses_a_sender_without_the_key_before_any_frame():
    backend = TcpBackend(LAYOUT, RECV_PAGES, key=KEY)
    port = backend.port
    # A peer holding another key: refused with a reason, at the handshake.
    with pytest.raises(TransferError, match="not authenticated"):
        TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, transfer_key("not ours"))
    # A stranger that skips the handshake and sends a WRITE frame: the listener takes its first
    # bytes for a hello, finds no proof in it and hangs up without reading the payload.
    sock, _ = _raw_hello(port)
    w = backend.open_window()
    frame = tcp_wire.HEADER.pack(tcp_wire.WRITE, w.index, w.tag, 0, len(DST))
    frame += bytes(8 * len(DST))
    sock.sendall(frame)
    assert _hung_up(sock)
    # A stranger with a forged proof: told why, then hung up on.
    sock, challenge = _raw_hello(port)
    tcp_wire.send_message(sock, {"nonce": b"x" * 16, "proof": b"y" * 32,
                                 "layout": LAYOUT.to_dict()})
    assert "not authenticated" in tcp_wire.recv_message(sock)["error"]
    assert _hung_up(sock)
    assert torch.count_nonzero(backend.kv) == 0  # nothing was written
    # The deployment's own sender still gets in, and writes.
    peer = TcpPeer(backend.descriptor(), sender_pool(), LAYOUT, KEY)
    peer.write(w, 0, SRC, DST)
    peer.flush(w)
    assert torch.count_nonzero(backend.kv) > 0
    peer.close()
    backend.close()


def test_tcp_peer_refuses_a_listener_that_cannot_prove_the_key():
    """The sender authenticates the receiver too: something else listening on the advertised
    port (a restarted engine of another deployment, say) gets no KV."""
    impostor = TcpBackend(LAYOUT, RECV_PAGES, key=transfer_key("another deployment"))
    descriptor = sign({k: v for k, v in impostor.descriptor().items() if k != "mac"}, KEY)
    with pytest.raises(TransferError, match="not authenticated|did not prove"):
        TcpPeer(descriptor, sender_pool(), LAYOUT, KEY)
    impostor.close()
