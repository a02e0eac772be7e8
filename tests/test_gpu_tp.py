"""Tensor parallelism on two GPUs (NCCL, CUDA graphs over the all-reduces): in fp32 a TP 2
engine gives the greedy tokens of a TP 1 engine (and, for the tiny model, of Hugging Face),
with graphs and eagerly. Each engine runs in a process of its own: a process joins one NCCL
group in its life (engine/tp/group.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hf_greedy
from test_engine_core import random_prompts

pytestmark = pytest.mark.gpu

_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from test_engine_core import greedy, run_all
from engine.config import EngineConfig
from engine.core import EngineCore
prompts = json.loads(sys.argv[1])
core = EngineCore(EngineConfig(model={model!r}, device="cuda", dtype="float32", page_size=16,
                               num_pages=256, max_num_seqs=16, **json.loads(sys.argv[2])))
got = run_all(core, {{f"r{{i}}": p for i, p in enumerate(prompts)}}, greedy(32))
core.close()
print(json.dumps([got[f"r{{i}}"][0] for i in range(len(prompts))]))
"""


@pytest.fixture(autouse=True)
def two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def tokens(model: str, prompts: list[list[int]], **config) -> list[list[int]]:
    """Greedy tokens of an engine with `config`, run in a process of its own."""
    code = _RUN.format(tests=str(Path(__file__).parent), model=model)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(prompts), json.dumps(config)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("eager,all_reduce", [(False, "one-shot"), (False, "nccl"),
                                               (True, "one-shot")],
                         ids=["graphs-one-shot", "graphs-nccl", "eager-one-shot"])
def test_fp32_tiny_tp2_equals_hf(tiny_model_dir, eager, all_reduce):
    prompts = random_prompts([1, 5, 17, 40, 64, 90, 33])
    ref = hf_greedy(tiny_model_dir, prompts, 32)
    assert tokens(tiny_model_dir, prompts, tensor_parallel_size=2, enforce_eager=eager,
                  max_num_batched_tokens=40, max_prefill_step_tokens=40,
                  all_reduce=all_reduce) == ref


# What each two-rank script starts with (a template, as the scripts are): `join` makes rank r's
# GPU current and joins the NCCL group of two.
_RANKS = """
import sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def join(r, port):
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{port}}", rank=r,
                            world_size=2, device_id=torch.device("cuda", r))
"""


def rank_reports(out: subprocess.CompletedProcess) -> list[str]:
    """The OK / BAD lines the ranks of a `run_ranks` script printed, in order."""
    assert out.returncode == 0, out.stderr[-3000:]
    return sorted(line for line in out.stdout.splitlines() if line.startswith(("OK", "BAD")))


def run_ranks(script: Path, source: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `source` (a template whose braces are doubled) as the file `script` with a free
    port as its argument, from the repository root: spawned ranks import its functions from
    the file."""
    from engine.tp.group import free_port

    script.write_text(source.format())
    root = Path(__file__).parent.parent
    return subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True,
                          text=True, timeout=timeout, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(root), os.environ.get("PYTHONPATH")]))})


_SUMS = _RANKS + """
from engine.tp.allreduce import OneShotAllReduce

def rank(r, port):
    join(r, port)
    bad = []
    for kernel in ("triton", "torch"):
        one = OneShotAllReduce(None, torch.device("cuda", r), torch.bfloat16, kernel=kernel)
        for n in (8, 4096, 32 * 4096, one.max_numel):
            def parts(seed):
                return [torch.randn(n, generator=torch.Generator().manual_seed(seed + i))
                        .to(torch.bfloat16) for i in range(2)]
            def want(p):
                return (p[0].float() + p[1].float()).to(torch.bfloat16).cuda()
            p = parts(100 * n)
            x = p[r].cuda()
            assert one.fits(x)
            got = one(x)
            nccl = x.clone(); dist.all_reduce(nccl)
            # in a CUDA graph too, replayed over new values, twenty times back to back
            g, static = torch.cuda.CUDAGraph(), x.clone()
            one(static); torch.cuda.synchronize()
            with torch.cuda.graph(g):
                out = one(static)
            checks = [("eager", got, want(p)), ("nccl", nccl, want(p))]
            for i in range(20):
                q = parts(100 * n + 10 * i + 3)
                static.copy_(q[r].cuda()); g.replay()
                checks.append((f"graph {{i}}", out.clone(), want(q)))
            for name, t, w in checks:
                if not torch.equal(t.view(torch.int16), w.view(torch.int16)):
                    bad.append((kernel, name, n))
    print("BAD" if bad else "OK", r, bad[:8], flush=True)

if __name__ == "__main__":
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_one_shot_sums_are_bit_equal_to_nccls_and_the_rounded_sum(tmp_path):
    """Two ranks' bf16 messages from 16 B to the limit (512 KiB): the one-shot sum (the
    engine's Triton kernel and torch's), eager and replayed from a CUDA graph twenty times
    over new values, is bit-equal to NCCL's and to the float32 sum rounded once, on both
    ranks."""
    out = run_ranks(tmp_path / "sums.py", _SUMS, timeout=240)
    assert rank_reports(out) == ["OK 0 []", "OK 1 []"], out.stdout


_EXCHANGE = _RANKS + """
from engine.tp.exchange import PeerExchange, SLOTS

def rank(r, port):
    join(r, port)
    ex = PeerExchange(None, torch.device("cuda", r), torch.bfloat16, 16 << 20)
    bad = []
    def parts(seed, n):
        return [torch.randn(n, generator=torch.Generator().manual_seed(seed + i))
                .to(torch.bfloat16) for i in range(2)]
    for n in (1 << 19, 3 * (1 << 20) + 8, 8 << 20):  # 1 MiB, 6 MiB + 16 B, 16 MiB
        for rnd in range(3):
            # calls under way as the engine's overlapped halves make them: SLOTS started,
            # then each wait followed by the next start (which reuses the slot just read)
            ps = [parts(1000 * n + 10 * rnd + k, n) for k in range(SLOTS + 2)]
            xs = [p[r].cuda() for p in ps]
            nccl = [x.clone() for x in xs]
            for t in nccl:
                dist.all_reduce(t)
            going = [ex.start(x) for x in xs[:SLOTS]]
            mine, theirs = going[0].parts()
            got = [theirs.clone()]
            for k in range(SLOTS + 2):
                got.append(going[k].wait())
                if k + SLOTS < len(xs):
                    going.append(ex.start(xs[k + SLOTS]))
            if rnd == 0:  # one more than SLOTS under way is refused, on the host
                going = [ex.start(x.clone()) for x in xs[:SLOTS]]
                try:
                    ex.start(xs[0])
                    bad.append(("not refused", n))
                except RuntimeError:
                    pass
                for g in going:
                    g.wait()
            checks = [("theirs", got[0], ps[0][1 - r].cuda())]
            for k, p in enumerate(ps):
                want = (p[0].float() + p[1].float()).to(torch.bfloat16).cuda()
                checks += [(f"sum {{k}}", got[k + 1], want), (f"nccl {{k}}", nccl[k], want)]
            for name, t, w in checks:
                if not torch.equal(t.view(torch.int16), w.view(torch.int16)):
                    bad.append((name, n, rnd))
    print("BAD" if bad else "OK", r, ex.calls, bad[:8], flush=True)

if __name__ == "__main__":
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2)
"""


def test_copy_engine_exchange_sums_are_bit_equal_to_nccls_and_the_rounded_sum(tmp_path):
    """Two ranks' bf16 messages of 1 to 16 MiB summed by the copy-engine exchange
    (engine/tp/exchange.py), two calls under way at once over its two slots, nine rounds:
    every sum is bit-equal to NCCL's and to the float32 sum rounded once, on both ranks, and
    `parts()` gives the other rank's partial as it sent it."""
    out = run_ranks(tmp_path / "exchange.py", _EXCHANGE, timeout=240)
    assert rank_reports(out) == ["OK 0 42 []", "OK 1 42 []"], out.stdout


_ALONE = _RANKS + """
import time
from engine.tp.allreduce import OneShotAllReduce

def rank(r, port):
    join(r, port)
    one = OneShotAllReduce(None, torch.device("cuda", r), torch.bfloat16, timeout_s=2.0)
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    if r == 1:  # never arrives; stays alive past rank 0's timeout
        time.sleep(20)
        return
    start = time.monotonic()
    try:
        one(x)
        torch.cuda.synchronize()
        print("NO ERROR", flush=True)
    except RuntimeError as e:
        print(f"TRAPPED after {{time.monotonic() - start:.1f}} s: {{str(e)[:80]}}", flush=True)
    sys.stdout.flush()
    import os; os._exit(0)

if __name__ == "__main__":
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2, join=False)
    time.sleep(25)
"""


def test_one_shot_traps_when_another_rank_never_arrives(tmp_path):
    """A rank whose partner never calls the all-reduce ends with a CUDA error after the
    kernel's timeout (2 s here), not a kernel that spins forever."""
    out = run_ranks(tmp_path / "alone.py", _ALONE, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith(("TRAPPED", "NO ERROR"))),
                out.stdout[-2000:] + out.stderr[-2000:])
    assert line.startswith("TRAPPED"), line
    assert 1.5 <= float(line.split()[2]) <= 15, line


@pytest.mark.parametrize("steps", [
    {},
    {"max_piecewise_tokens": 0},
    {"max_piecewise_tokens": 0, "tp_overlap_tokens": 256},
    {"max_piecewise_tokens": 0, "tp_overlap_tokens": 256, "all_reduce": "one-shot"},
], ids=["graphs", "eager-exchange", "overlapped-exchange", "overlapped-nccl"])
def test_fp32_llama_1b_shape_tp2_equals_tp1(tmp_path, steps):
    """random:llama-3.2-1b (32 heads, 8 KV heads, tied embeddings) in fp32, its prompt steps
    (512 tokens) replayed from piecewise graphs, or eager with the copy-engine exchange
    summing each 4-MiB message (an add kernel after it), or in two overlapped row halves
    (2 MiB: the exchange's sum added inside the norm kernel; or NCCL on its own stream)."""
    from microserve.random_models import materialize

    model = str(materialize("random:llama-3.2-1b", tmp_path))
    prompts = random_prompts([7, 300, 1000], vocab=128256)
    budgets = {"max_num_batched_tokens": 512, "max_prefill_step_tokens": 512}
    one = tokens(model, prompts, **budgets)
    assert tokens(model, prompts, tensor_parallel_size=2, **budgets, **steps) == one


async def _pd(p_url: str, d_url: str, prompts: list[list[int]]) -> list[list[int]]:
    """P/D of each prompt from the engine at p_url to the one at d_url: D's greedy tokens."""
    from microserve.messages import PrepRecvRequest, RemoteSendRequest, SamplingParams
    from microserve.microserving_client import EngineClient

    from daemons import ENGINE_KEY
    from test_kv_exchange import N_NEW

    P, D = EngineClient(p_url, api_key=ENGINE_KEY), EngineClient(d_url, api_key=ENGINE_KEY)
    out = []
    try:
        for i, prompt in enumerate(prompts):
            r = await D.call(PrepRecvRequest(f"pd-{i}", prompt, end=-1))
            begin = r.kv_addr.begin  # what D holds already (nothing on a fresh engine)
            sent = await P.call(RemoteSendRequest(f"pd-{i}", prompt, begin, -1, r.kv_addr))
            assert sent.sent == len(prompt) - 1 - begin
            tokens = []
            async for chunk in D.start_generate(f"pd-{i}", prompt, len(prompt) - 1,
                                                SamplingParams(max_tokens=N_NEW, temperature=0,
                                                               ignore_eos=True)):
                tokens += chunk.token_ids
            out.append(tokens)
    finally:
        await P.aclose()
        await D.aclose()
    return out


@pytest.mark.parametrize("kind", ["cuda_ipc", "tcp"])
@pytest.mark.parametrize("p_size", [2, 1], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_pd_between_tp2_and_tp1(tiny_served_dir, tmp_path, p_size, kind):
    """P/D over cuda_ipc or tcp between engine daemons at TP 2 (cuda:0-1) and TP 1 (cuda:2),
    both ways, in fp32: D's tokens equal Hugging Face's. (That the KV arrives byte-equal, head by
    head, is tests/test_tp_transfer.py's on CPUs, and the head-range copy kernel's on GPUs is
    tests/test_page_copy.py's.)"""
    import asyncio

    import torch

    from daemons import ENGINE_KEY, Daemon
    from test_kv_exchange import N_NEW

    if torch.cuda.device_count() < 3:
        pytest.skip("needs three GPUs")
    common = ("--dtype", "float32", "--num-pages", "256", "--api-key", ENGINE_KEY,
              "--kv-transfer", kind)
    tp = Daemon(tiny_served_dir, tmp_path / "tp.log", "tp", *common, "--device", "cuda:0",
                "--tensor-parallel-size", "2")
    one = Daemon(tiny_served_dir, tmp_path / "one.log", "one", *common, "--device", "cuda:2")
    try:
        tp.wait_ready()
        one.wait_ready()
        prompts = random_prompts([45, 23, 70], seed=11)
        p, d = (tp, one) if p_size == 2 else (one, tp)
        got = asyncio.run(_pd(p.url, d.url, prompts))
        assert got == hf_greedy(tiny_served_dir, prompts, N_NEW)
    finally:
        tp.stop()
        one.stop()
