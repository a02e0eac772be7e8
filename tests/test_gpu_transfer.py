"""P/D on one GPU: two engine daemons share it and move KV by CUDA IPC (`--kv-transfer
cuda_ipc`) or through NVSHMEM (`--kv-transfer nvshmem`, both engines in one group). Every split
of a request gives exactly Hugging Face's greedy tokens (the tiny Llama in fp32), through the
microserving API and through `microserve up`'s router with each built-in strategy; a dead
receiver leaves nothing held on the sender, a sender or receiver killed mid-send behind the
router leaves the other serving. Each test runs with both backends."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal

import pytest
from conftest import hf_greedy
import httpx
import torch
from daemons import ENGINE_KEY, Daemon, serve
from deployments import RouterProcess, Up, assert_quiet, engine_stats, stop_and_check, write_config
from pd_faults import check_killing_decode, check_killing_prefill

from microserve.backend import MicroservingError
from microserve.messages import PrepRecvRequest, RemoteSendRequest, SamplingParams
from microserve.microserving_client import EngineClient

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

N_NEW = 12
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
ARGS = ("--device", "cuda", "--dtype", "float32", "--num-pages", "256", "--page-size", "16",
        "--gpu-memory-utilization", "0.2", "--api-key", ENGINE_KEY)
PROMPTS = [[(7 * i + k * 13) % 256 for k in range(n)] for i, n in enumerate((40, 97, 200))]
KINDS = ["cuda_ipc", "nvshmem"]


def start(model_dir, tmp_path_factory, name, *args):
    log = tmp_path_factory.mktemp(name) / "daemon.log"
    return Daemon(model_dir, log, name, *ARGS, *args)  # a later --device overrides ARGS' cuda


def start_pair(kind, model_dir, tmp_path_factory, names, args=((), ())):
    """A sender and a receiver of `kind`: with nvshmem both are the two members of a fresh
    group (the receiver PE 1), started together as `microserve up` would."""
    if kind == "cuda_ipc":
        return (start(model_dir, tmp_path_factory, names[0], *args[0]),
                start(model_dir, tmp_path_factory, names[1], *args[1], "--kv-transfer", kind))
    group = tmp_path_factory.mktemp(f"{names[0]}-group")
    return tuple(start(model_dir, tmp_path_factory, name, *extra, "--kv-transfer", "nvshmem",
                       "--nvshmem-group", f"{rank}/2@{group}")
                 for rank, (name, extra) in enumerate(zip(names, args)))


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def engines(kind, tiny_served_dir, tmp_path_factory):
    """P and D (which receives with `kind`) for the module."""
    gens = [serve(e) for e in start_pair(kind, tiny_served_dir, tmp_path_factory,
                                         (f"gpu-p-{kind}", f"gpu-d-{kind}"))]
    yield tuple(next(g) for g in gens)
    for g in gens:
        next(g, None)


@pytest.fixture(scope="module")
def p(engines):
    return engines[0]


@pytest.fixture(scope="module")
def d(engines):
    return engines[1]


@pytest.fixture(autouse=True)
def engines_quiet(request):
    """After a test that used the module's engines: alive, idle, nothing held."""
    yield
    for name in ("p", "d"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            assert engine.proc.poll() is None, f"{engine.name} died:\n{engine.log()}"
            assert_quiet(engine.name, engine.url)


async def collect(engine: EngineClient, rid: str, prompt: list[int], begin: int,
                  first_token: int | None = None):
    tokens = []
    async for chunk in engine.start_generate(rid, prompt, begin, GREEDY, first_token):
        tokens += chunk.token_ids
    return tokens


def text_ids(text: str) -> list[int]:
    """The token ids of the tiny tokenizer's text (token i reads `<i>`)."""
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


async def test_pd_and_balanced_splits_give_hf_greedy_tokens(kind, p, d, tiny_served_dir):
    want = hf_greedy(tiny_served_dir, PROMPTS, N_NEW)
    P, D = EngineClient(p.url, api_key=ENGINE_KEY), EngineClient(d.url, api_key=ENGINE_KEY)
    try:
        assert (await D.stats()).info.kv_transfer == kind
        for i, prompt in enumerate(PROMPTS):
            n = len(prompt)
            for split, end in (("pd", n - 1), ("balanced", n - 1 - n // 5), ("p-samples", n)):
                rid = f"{split}-{i}"
                r = await D.call(PrepRecvRequest(rid, prompt, end=end))
                sampling = GREEDY if end == n else None  # P also samples the first token
                sent = await P.call(RemoteSendRequest(rid, prompt, r.matched, end, r.kv_addr, sampling))
                assert sent.sent == end - r.matched
                assert sent.first_token == (want[i][0] if sampling else None)
                got = await collect(D, rid, prompt, end, sent.first_token)
                assert got == want[i], (split, i)
    finally:
        await P.aclose()
        await D.aclose()


async def test_pd_between_fp8_kv_engines_gives_hf_greedy_tokens_over_fp8_kv(
        kind, tiny_served_dir, tmp_path_factory):
    """--kv-cache-dtype fp8 on both: P's e4m3 pages land in D's pool (copied as bytes), and D
    continues with the tokens of Hugging Face's model reading K and V rounded to e4m3."""
    from bench.fp8_quality import hf_fp8_kv
    from conftest import _hf_model

    with hf_fp8_kv(_hf_model(tiny_served_dir)):
        want = hf_greedy(tiny_served_dir, PROMPTS, N_NEW)
    fp8 = ("--kv-cache-dtype", "fp8")
    pair = start_pair(kind, tiny_served_dir, tmp_path_factory,
                      (f"gpu-p8-{kind}", f"gpu-d8-{kind}"), (fp8, fp8))
    P = EngineClient(pair[0].url, api_key=ENGINE_KEY)
    D = EngineClient(pair[1].url, api_key=ENGINE_KEY)
    try:
        for engine in pair:
            engine.wait_ready()
        assert (await D.stats()).info.kv_cache_dtype == "float8_e4m3fn"
        for i, prompt in enumerate(PROMPTS):
            r = await D.call(PrepRecvRequest(f"fp8-{i}", prompt))
            assert r.kv_addr.layout.dtype == "float8_e4m3fn"
            sent = await P.call(RemoteSendRequest(f"fp8-{i}", prompt, r.matched, -1, r.kv_addr))
            assert sent.sent == len(prompt) - 1 - r.matched
            assert await collect(D, f"fp8-{i}", prompt, len(prompt) - 1) == want[i], i
        for engine in pair:
            assert_quiet(engine.name, engine.url)
    finally:
        await P.aclose()
        await D.aclose()
        for engine in pair:
            engine.stop()


async def test_abort_mid_send_and_a_dead_receiver_leave_nothing_held(kind, p, tiny_served_dir,
                                                                     tmp_path_factory):
    """The receiver is killed mid-send: the sender answers (502 or done), holds nothing and
    serves on; with nvshmem the sender is the other member of the victim's group, which must
    outlive its peer PE."""
    if kind == "cuda_ipc":
        sender, victim = p, start(tiny_served_dir, tmp_path_factory, "gpu-victim",
                                  "--kv-transfer", kind)
    else:
        sender, victim = start_pair(kind, tiny_served_dir, tmp_path_factory,
                                    ("gpu-sender", "gpu-victim"))
    P = EngineClient(sender.url, api_key=ENGINE_KEY)
    V = EngineClient(victim.url, api_key=ENGINE_KEY)
    try:
        sender.wait_ready()
        victim.wait_ready()
        prompt = [(3 * k) % 256 for k in range(480)]
        r = await V.call(PrepRecvRequest("gone", prompt))
        send = asyncio.create_task(P.call(RemoteSendRequest("gone", prompt, 0, -1, r.kv_addr)))
        await asyncio.sleep(0.05)
        os.kill(victim.core_pid(), signal.SIGKILL)
        try:
            await asyncio.wait_for(send, 60)  # it may have finished before the kill
        except MicroservingError as e:
            assert e.status == 502 and "KV transfer failed" in str(e)
        assert sender.proc.poll() is None, f"the sender died with its receiver:\n{sender.log()}"
        assert_quiet(sender.name, sender.url)
        prompt = PROMPTS[0]  # and it still serves
        assert await collect(P, "after", prompt, 0) == hf_greedy(tiny_served_dir, [prompt],
                                                                 N_NEW)[0]
    finally:
        await P.aclose()
        await V.aclose()
        victim.stop()
        if sender is not p:
            assert sender.stop() == 0, sender.log()


@pytest.mark.parametrize("victim_role", ["prefill", "decode"])
def test_an_engine_killed_mid_send_through_the_router(kind, victim_role, tiny_served_dir,
                                                      tmp_path_factory):
    """tests/pd_faults.py's checks with P and D on the GPU, D receiving by `kind`: P killed
    while it sends leaves D serving every request whole (HF's greedy tokens) and D frees the
    dead sender's reservations; D killed ends P's sends to it at once and P serves the
    requests whole. Nothing stays held on the survivor."""
    def pair(names, args):
        return start_pair(kind, tiny_served_dir, tmp_path_factory, names, args)

    check = check_killing_prefill if victim_role == "prefill" else check_killing_decode
    check(tiny_served_dir, tmp_path_factory, pair)


async def stream_tokens(http: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                        leave_after: int | None = None, logprobs: bool = True
                        ) -> list[int] | str:
    """Stream a greedy completion through the router; with `leave_after`, disconnect after
    that many chunks (0: as soon as the response starts) and return "left". Without
    `logprobs` the tokens are read from the text (P/D then hands P's first token to D)."""
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **({"logprobs": 0} if logprobs else {})}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if leave_after is not None and len(tokens) >= leave_after:
                return "left"  # closing the stream disconnects: the router aborts it
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += ([int(t[1:-1]) for t in choice["logprobs"]["tokens"]] if logprobs
                           else text_ids(choice["text"]))
    return tokens


def test_200_pd_requests_with_30_percent_aborted_leave_nothing(p, d, tiny_served_dir,
                                                               tmp_path_factory):
    """Through the router's pd strategy: 200 requests, 30% of them abandoned by their client
    at a random point (while P prefills and sends, or mid-decode on D). The others get HF's
    greedy tokens; afterwards neither engine holds a page, reservation, window or send job.
    Half ask for logprobs (D samples the first token), half not (P samples it)."""
    rng = random.Random(19)
    batch = [[rng.randrange(256) for _ in range(rng.randrange(30, 300))] for _ in range(200)]
    leave = {i: rng.choice([0, 1, rng.randrange(2, 24)]) for i in rng.sample(range(200), 60)}
    kept = [i for i in range(200) if i not in leave]
    want = dict(zip(kept, hf_greedy(tiny_served_dir, [batch[i] for i in kept], 24)))
    log = tmp_path_factory.mktemp("gpu-router") / "router.log"
    router = RouterProcess(tiny_served_dir, {"p": p.url + ",prefill", "d": d.url + ",decode"},
                           log, "--strategy", "pd", "--admin-token", ADMIN)
    sent_before = engine_stats(p.url)["stats"]["kv_tokens_sent"]

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=router.url, timeout=120, limits=limits) as http:
            gate = asyncio.Semaphore(48)

            async def one(i):
                async with gate:
                    return await stream_tokens(http, batch[i], 24, leave.get(i), i % 2 == 0)

            return await asyncio.gather(*(one(i) for i in range(200)))

    try:
        router.wait_ready()
        outcomes = asyncio.run(run())
        assert {i: outcomes[i] for i in kept} == want
        assert all(outcomes[i] == "left" for i in leave)
        for engine in (p, d):
            stats = assert_quiet(engine.name, engine.url)
            assert stats["kv_leases_expired"] == 0, stats  # freed by the aborts, not by time
        assert engine_stats(p.url)["stats"]["kv_tokens_sent"] > sent_before
    finally:
        router.stop()


ADMIN = "gpu-admin"
STRATEGIES = [("pd", {}), ("balanced_pd", {"ratio": 0.2}), ("context_migration", {}),
              ("data_parallel", {})]


def test_every_strategy_through_the_router_on_one_gpu(kind, tiny_served_dir, tmp_path):
    """deploy/gpu-1p1d-shared.toml's layout with the tiny model (-nvshmem.toml's: both engines
    in the group `microserve up` forms): the router's answers are HF's greedy tokens whatever
    the strategy, swapped while the deployment runs."""
    gpu = ["--device", "cuda", "--dtype", "float32", "--num-pages", "256",
           "--gpu-memory-utilization", "0.2"]
    p_args = [*gpu, "--kv-transfer", "nvshmem"] if kind == "nvshmem" else gpu
    config, port, urls = write_config(tmp_path / "deploy.toml", tiny_served_dir, "pd", [
        ("p", "prefill", p_args), ("d", "decode", [*gpu, "--kv-transfer", kind])])
    up = Up(config, port, urls, tmp_path / "up.log", env={**os.environ,
                                                          "MICROSERVE_ADMIN_TOKEN": ADMIN})
    want = hf_greedy(tiny_served_dir, PROMPTS, N_NEW)
    try:
        up.wait_ready()
        for name, args in STRATEGIES:
            r = httpx.put(up.url + "/admin/strategy", json={"builtin": name, "args": args},
                          headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200, r.text
            for prompt, expected in zip(PROMPTS, want):
                r = httpx.post(up.url + "/v1/completions", timeout=120, json={
                    "prompt": prompt, "max_tokens": N_NEW, "temperature": 0,
                    "ignore_eos": True, "logprobs": 0})
                assert r.status_code == 200, r.text
                tokens = r.json()["choices"][0]["logprobs"]["tokens"]
                assert tokens == [f"<{t}>" for t in expected], name
                r = httpx.post(up.url + "/v1/completions", timeout=120, json={  # P samples
                    "prompt": prompt, "max_tokens": N_NEW, "temperature": 0,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert text_ids(r.json()["choices"][0]["text"]) == expected, name
            for engine, url in urls.items():
                assert_quiet(engine, url)
        sent = httpx.get(urls["p"] + "/microserving/stats", headers={
            "Authorization": f"Bearer {ENGINE_KEY}"}).json()["stats"]["kv_tokens_sent"]
        assert sent > 0  # the P/D strategies did move KV
        stop_and_check(up)
    finally:
        if up.proc.poll() is None:
            up.proc.kill()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_pd_across_two_gpus(kind, tiny_served_dir, tmp_path_factory):
    """P on GPU 0, D on GPU 1 (both see both: --device cuda:N): the copy crosses GPUs."""
    want = hf_greedy(tiny_served_dir, PROMPTS, N_NEW)
    gens = [serve(e) for e in start_pair(kind, tiny_served_dir, tmp_path_factory,
                                         (f"gpu0-p-{kind}", f"gpu1-d-{kind}"),
                                         (("--device", "cuda:0"), ("--device", "cuda:1")))]
    p0, d1 = (next(g) for g in gens)
    P, D = EngineClient(p0.url, api_key=ENGINE_KEY), EngineClient(d1.url, api_key=ENGINE_KEY)
    try:
        for i, prompt in enumerate(PROMPTS):
            n = len(prompt)
            r = await D.call(PrepRecvRequest(f"x-{i}", prompt, end=n - 1))
            await P.call(RemoteSendRequest(f"x-{i}", prompt, r.matched, n - 1, r.kv_addr))
            assert await collect(D, f"x-{i}", prompt, begin=n - 1) == want[i]
        for engine in (p0, d1):
            assert_quiet(engine.name, engine.url)
    finally:
        await P.aclose()
        await D.aclose()
        for g in gens:
            next(g, None)
