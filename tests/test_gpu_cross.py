"""cuda_ipc between two GPUs of one host: the sender maps the receiver's pool into its own GPU's
context and its copy kernel stores across the link; the pages land byte-equal, and nothing of
the copy runs on the receiver's GPU (the peer's view of the pool lives on the sender's device).

The receiver is another process (a CUDA IPC handle cannot be opened by the process that made
it), on GPU 1; the sender is this test, on GPU 0."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache.transfer import KVLayout, Window, open_peer
from kvcache.transfer.auth import transfer_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout("test-model", "bfloat16", page_size=16, num_layers=4, num_kv_heads=8,
                  head_dim=128)
RECV_PAGES, SEND_PAGES = 64, 48
KEY = transfer_key("test-engine-key")
RECEIVER = """
import json, sys, torch
from kvcache.transfer import KVLayout, make_backend

layout = KVLayout.from_dict(json.loads(sys.argv[1]))
backend = make_backend("cuda_ipc", layout, int(sys.argv[2]), "cuda:1", key=bytes.fromhex(sys.argv[3]))
window = backend.open_window()
print(json.dumps([backend.descriptor(), window.index, window.tag]), flush=True)
sys.stdin.readline()  # the sender has flushed
torch.save(backend.kv.cpu(), sys.argv[4])
backend.close_window(window)
backend.close()
print(json.dumps("ok"), flush=True)
"""


def _line(proc: subprocess.Popen):
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready, "the receiver did not answer within 120 s"
    return json.loads(proc.stdout.readline())


def test_cross_gpu_pages_land_byte_equal_from_the_senders_gpu(tmp_path):
    dump = tmp_path / "pool.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, json.dumps(LAYOUT.to_dict()), str(RECV_PAGES),
         KEY.hex(), str(dump)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        descriptor, *window = _line(proc)  # one line: select sees only what is unread
        assert descriptor["cuda_device"] == 1
        window = Window(*window)
        g = torch.Generator().manual_seed(0)
        local = torch.randn(LAYOUT.pool_shape(SEND_PAGES), generator=g).to(torch.bfloat16)
        local = local.to("cuda:0")
        slots = LAYOUT.page_size * SEND_PAGES
        src = torch.randperm(slots, generator=g)[:500]
        dst = torch.randperm(LAYOUT.page_size * RECV_PAGES, generator=g)[:500]
        peer = open_peer(descriptor, local, LAYOUT, KEY)
        assert peer._remote.device == local.device  # mapped here: the kernel runs on GPU 0
        peer.write_layers(window, range(0, LAYOUT.num_layers), src, dst)
        peer.flush(window)
        peer.close()
        proc.stdin.write("flushed\n")
        proc.stdin.flush()
        assert _line(proc) == "ok"
        rows = (2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
        want = torch.zeros(LAYOUT.pool_shape(RECV_PAGES), dtype=torch.bfloat16)
        host = local.cpu()
        for layer in range(LAYOUT.num_layers):
            want[layer].view(rows)[:, dst] = host[layer].view(rows)[:, src]
        assert torch.equal(torch.load(dump), want)  # byte-equal, every layer, K and V
    finally:
        proc.kill()
        proc.wait()
