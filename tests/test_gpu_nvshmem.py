"""The nvshmem backend on a GPU, below the engine: two processes form a group (two PEs on one
GPU, as on the lent H100), each allocates its KV pool in the symmetric heap, and each writes
the other's pool through the peer view, byte for byte; a closed window refuses writes; a killed
receiver fails the sender's next write and leaves the sender running; a group whose second
member never comes ends its first within the timeout instead of hanging. Every child is bounded
by a timeout (a dead PE leaves its peer waiting for ever)."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvcache.transfer import KVLayout
from kvcache.transfer.auth import transfer_key

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout("test-model", "bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
PAGES = 16  # 64 slots
KEY = transfer_key("test-engine-key")
SRC = [3, 17, 5, 22, 9, 40]
DST = [12, 1, 27, 6, 20, 63]
ROWS = (2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)

MEMBER = """
import json, sys, time, torch
from kvcache.transfer import KVLayout, Window, open_peer
from kvcache.transfer.nvshmem import NvshmemBackend
from kvcache.transfer.nvshmem_group import GroupSpec

layout, pages = KVLayout.from_dict(json.loads(sys.argv[1])), int(sys.argv[2])
key, group, timeout_s = bytes.fromhex(sys.argv[3]), GroupSpec.parse(sys.argv[4]), float(sys.argv[5])
t0 = time.perf_counter()
backend = NvshmemBackend(layout, pages, "cuda", key=key, group=group, timeout_s=timeout_s)
print(json.dumps({"descriptor": backend.descriptor(), "join_s": time.perf_counter() - t0,
                  "pages": backend.kv.shape[2]}), flush=True)
peers = {}
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    reply = "ok"
    try:
        if cmd == "open":
            w = backend.open_window()
            reply = [w.index, w.tag]
        elif cmd == "close":
            backend.close_window(Window(*json.loads(arg)))
        elif cmd == "fill":
            g = torch.Generator().manual_seed(int(arg))
            backend.kv.copy_(torch.randn(backend.kv.shape, generator=g).to(backend.kv.dtype))
        elif cmd == "dump":
            torch.save(backend.kv.cpu(), arg)
        elif cmd == "send":  # layers: a list (one write each) or "all" (one write_layers)
            m = json.loads(arg)
            pe = m["descriptor"]["pe"]
            if pe not in peers:
                peers[pe] = open_peer(m["descriptor"], backend.kv, layout, key)
            w, src, dst = Window(*m["window"]), torch.tensor(m["src"]), torch.tensor(m["dst"])
            if m["layers"] == "all":
                peers[pe].write_layers(w, range(layout.num_layers), src, dst)
            else:
                for layer in m["layers"]:
                    peers[pe].write(w, layer, src, dst)
            peers[pe].flush(w)
    except Exception as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(reply), flush=True)
"""


class Member:
    """One PE in a child process, driven over stdin and stdout."""

    def __init__(self, rank: int, size: int, rendezvous: Path, timeout_s: float = 120):
        self.log_path = rendezvous.parent / f"{rendezvous.name}-pe{rank}.log"
        with open(self.log_path, "w") as log:  # a file: a full pipe would stall the child
            self.proc = subprocess.Popen(
                [sys.executable, "-c", MEMBER, json.dumps(LAYOUT.to_dict()), str(PAGES),
                 KEY.hex(), f"{rank}/{size}@{rendezvous}", str(timeout_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        self.hello = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def reply(self, timeout_s: float = 120):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, f"PE did not answer within {timeout_s} s"
        line = self.proc.stdout.readline()
        assert line, f"PE exited ({self.proc.wait()}):\n{self.log()}"
        return json.loads(line)

    def ready(self) -> dict:
        self.hello = self.reply()
        return self.hello

    def call(self, cmd: str, arg=None):
        self.proc.stdin.write(cmd + ("" if arg is None else " " + (
            arg if isinstance(arg, str) else json.dumps(arg))) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def send(self, to: Member, window, layers, src=SRC, dst=DST):
        return self.call("send", {"descriptor": to.hello["descriptor"], "window": window,
                                  "layers": layers, "src": src, "dst": dst})

    def pool(self, tmp_path: Path) -> torch.Tensor:
        path = tmp_path / f"pool-{self.proc.pid}.pt"
        assert self.call("dump", str(path)) == "ok"
        return torch.load(path)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def filled(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.pool_shape(PAGES), generator=g).to(torch.bfloat16)


def expected(before: torch.Tensor, sender: torch.Tensor, layers) -> torch.Tensor:
    out = before.clone()
    for layer in layers:
        out[layer].view(ROWS)[:, DST] = sender[layer].view(ROWS)[:, SRC]
    return out


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    rendezvous = tmp_path_factory.mktemp("nvshmem-group")
    members = [Member(rank, 2, rendezvous) for rank in (0, 1)]
    try:
        for m in members:
            m.ready()
        yield members
    finally:
        for m in members:
            m.stop()


def test_members_write_each_others_pools_exactly(group, tmp_path):
    p, d = group
    print(f"group formed: join {p.hello['join_s']:.2f} s / {d.hello['join_s']:.2f} s")
    assert p.hello["pages"] == d.hello["pages"] == PAGES
    da, pa = d.hello["descriptor"], p.hello["descriptor"]
    assert (da["kind"], da["pe"], da["npes"]) == ("nvshmem", 1, 2)
    assert pa["group"] == da["group"] and pa["pe"] == 0
    assert p.call("fill", "1") == "ok" and d.call("fill", "2") == "ok"
    window = d.call("open")
    assert p.send(d, window, [0, 2]) == "ok"  # one layer per write
    assert torch.equal(d.pool(tmp_path), expected(filled(2), filled(1), [0, 2]))
    assert p.call("fill", "3") == "ok"
    assert p.send(d, window, "all") == "ok"  # a whole step: one kernel for every layer
    assert torch.equal(d.pool(tmp_path), expected(filled(2), filled(3), [0, 1, 2]))
    back = p.call("open")  # and the other way round
    assert d.send(p, back, "all") == "ok"
    want = expected(filled(3), d.pool(tmp_path), [0, 1, 2])
    assert torch.equal(p.pool(tmp_path), want)
    for member, w in ((d, window), (p, back)):
        assert member.call("close", w) == "ok"


def test_a_closed_window_refuses_writes(group, tmp_path):
    p, d = group
    assert d.call("fill", "4") == "ok"
    window = d.call("open")
    assert d.call("close", window) == "ok"
    reply = p.send(d, window, "all")
    assert f"closed window {window[0]} (tag {window[1]})" in reply["error"]
    assert torch.equal(d.pool(tmp_path), filled(4))


def test_a_killed_receiver_fails_the_next_write_and_the_sender_lives_on(group):
    p, d = group
    window = d.call("open")
    d.proc.kill()
    d.proc.wait()
    reply = p.send(d, window, "all")
    assert f"receiver pid {d.proc.pid} exited" in reply["error"]
    assert p.call("fill", "5") == "ok"  # the surviving PE still answers


def test_a_group_whose_other_member_never_comes_ends_within_the_timeout(tmp_path):
    (tmp_path / "group").mkdir()
    lone = Member(0, 2, tmp_path / "group", timeout_s=5)
    t0 = time.monotonic()
    try:
        code = lone.proc.wait(60)
    finally:
        if lone.proc.poll() is None:
            lone.proc.kill()
    assert code == 3, lone.log()
    assert "did not finish within 5 s: a member of the NVSHMEM group did not join" in lone.log()
    assert time.monotonic() - t0 < 60
