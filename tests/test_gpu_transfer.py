"""P/D on one GPU: two engine daemons share it and move KV by CUDA IPC (`--kv-transfer
cuda_ipc`). Every split of a request gives exactly Hugging Face's greedy tokens (the tiny Llama
in fp32), and aborts and a dead receiver leave nothing held on either engine."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from conftest import hf_greedy
from daemons import ENGINE_KEY, Daemon, serve
from deployments import assert_quiet

from microserve.backend import MicroservingError
from microserve.microserving import Sampling
from microserve.microserving_client import EngineClient

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

N_NEW = 12
GREEDY = Sampling(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
ARGS = ("--device", "cuda", "--dtype", "float32", "--num-pages", "256", "--page-size", "16",
        "--gpu-memory-utilization", "0.2", "--api-key", ENGINE_KEY)
PROMPTS = [[(7 * i + k * 13) % 256 for k in range(n)] for i, n in enumerate((40, 97, 200))]


def start(model_dir, tmp_path_factory, name, *args):
    log = tmp_path_factory.mktemp(name) / "daemon.log"
    return Daemon(model_dir, log, name, *ARGS, *args)


@pytest.fixture(scope="module")
def p(tiny_served_dir, tmp_path_factory):
    yield from serve(start(tiny_served_dir, tmp_path_factory, "gpu-p"))


@pytest.fixture(scope="module")
def d(tiny_served_dir, tmp_path_factory):
    yield from serve(start(tiny_served_dir, tmp_path_factory, "gpu-d", "--kv-transfer",
                           "cuda_ipc"))


@pytest.fixture(autouse=True)
def both_quiet(p, d):
    yield
    for engine in (p, d):
        assert engine.proc.poll() is None, f"{engine.name} died:\n{engine.log()}"
        assert_quiet(engine.name, engine.url)


async def collect(engine: EngineClient, rid: str, prompt: list[int], begin: int):
    tokens = []
    async for chunk in engine.start_generate(rid, prompt, begin, GREEDY):
        tokens += chunk.token_ids
    return tokens


async def test_pd_and_balanced_splits_give_hf_greedy_tokens(p, d, tiny_served_dir):
    want = hf_greedy(tiny_served_dir, PROMPTS, N_NEW)
    P, D = EngineClient(p.url, api_key=ENGINE_KEY), EngineClient(d.url, api_key=ENGINE_KEY)
    try:
        assert (await D.stats())["info"]["kv_transfer"] == "cuda_ipc"
        for i, prompt in enumerate(PROMPTS):
            n = len(prompt)
            for split, end in (("pd", n - 1), ("balanced", n - 1 - n // 5)):
                rid = f"{split}-{i}"
                r = await D.prep_recv(rid, prompt, end=end)
                sent = await P.remote_send(rid, prompt, r.matched, end, r.kv_addr)
                assert sent.sent == end - r.matched
                assert await collect(D, rid, prompt, begin=end) == want[i], (split, i)
    finally:
        await P.aclose()
        await D.aclose()


async def test_abort_mid_send_and_a_dead_receiver_leave_nothing_held(p, tiny_served_dir,
                                                                     tmp_path_factory):
    victim = start(tiny_served_dir, tmp_path_factory, "gpu-victim", "--kv-transfer", "cuda_ipc")
    P = EngineClient(p.url, api_key=ENGINE_KEY)
    V = EngineClient(victim.url, api_key=ENGINE_KEY)
    try:
        victim.wait_ready()
        prompt = [(3 * k) % 256 for k in range(480)]
        r = await V.prep_recv("gone", prompt)
        send = asyncio.create_task(P.remote_send("gone", prompt, 0, -1, r.kv_addr))
        await asyncio.sleep(0.05)
        os.kill(victim.core_pid(), signal.SIGKILL)
        try:
            await asyncio.wait_for(send, 60)  # it may have finished before the kill
        except MicroservingError as e:
            assert e.status == 502 and "KV transfer failed" in str(e)
    finally:
        await P.aclose()
        await V.aclose()
        victim.stop()
