"""Tensor parallelism on the CPU (gloo): an engine split over 2, 3 or 4 processes gives the
greedy tokens of one process and of Hugging Face, with chunked prefill, async scheduling,
prefix-cache hits and KV heads replicated where the ranks outnumber them; the cut itself
reassembles to the whole weights; what cannot be split is refused with the numbers; a rank
that dies ends its engine instead of hanging it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import hf_greedy
from daemons import Daemon, gone_within
from engine.config import EngineConfig
from engine.models.parallel import TensorParallel
from microserve.model_config import ModelConfig
from microserve.random_models import materialize
from test_engine_core import N_NEW, greedy, make_core, random_prompts, run_all
from test_lora import adapters, lora_dir, load, prompts, reference  # noqa: F401 (fixtures)
from test_lora import run as run_lora
from test_prompt_logprobs import assert_hf_scores, collect, scoring
from microserve.messages import LoadLoraRequest

LENGTHS = [1, 5, 17, 40, 64, 90]


def tp_core(model_dir, size, **kw):
    kw.setdefault("cpu_threads", 1)  # the ranks share the machine's cores
    return make_core(model_dir, tensor_parallel_size=size, **kw)


@pytest.fixture(scope="module")
def tiny_ref(tiny_model_dir):
    prompts = random_prompts(LENGTHS)
    return prompts, hf_greedy(tiny_model_dir, prompts, N_NEW)


@pytest.mark.parametrize("size,overlap", [(2, False), (2, True), (4, False)],
                         ids=["tp2-sync", "tp2-async", "tp4-replicated-kv-heads"])
def test_tiny_equals_hf(tiny_model_dir, tiny_ref, size, overlap):
    """The tiny model (4 heads, 2 KV heads, untied head): TP 4 puts one q head on each rank
    and each KV head on two. A budget of 7 tokens chunks every long prompt; the second round
    hits the prefix cache."""
    prompts, ref = tiny_ref
    core = tp_core(tiny_model_dir, size, max_num_batched_tokens=7, async_scheduling=overlap)
    try:
        assert core.runner.shape.num_heads == 4 // size
        assert core.runner.shape.num_kv_heads == max(1, 2 // size)
        assert core.runner.kv.kv.shape[-2] == max(1, 2 // size)  # the rank's KV heads only
        for round_ in range(2):
            got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
            for i, expected in enumerate(ref):
                assert got[f"r{i}"][0] == expected, f"round {round_}, prompt {i}"
            if round_:
                assert got["r5"][1] == (90 // 4) * 4  # whole pages of the prompt were cached
        # prompt logprobs: the scoring blocks gather their logits across the ranks too
        scored = collect(core, {"s": (prompts[3], scoring())})["s"]
        assert scored[0] == ref[3][:2]
        assert_hf_scores(tiny_model_dir, prompts[3], scored[1])
    finally:
        core.close()


@pytest.mark.parametrize("threshold", [9, 1])
def test_large_steps_overlap_their_all_reduces_and_equal_hf(tiny_model_dir, tiny_ref, threshold):
    """Steps of at least tp_overlap_tokens tokens run in two row halves whose all-reduces are
    started before the other half's work and waited for after it (gloo: on its own thread):
    the tokens are still Hugging Face's, with steps of odd sizes cut unevenly. At 1, every step
    of two tokens or more does (decode steps of a few sequences: halves of a row or two), and
    one-token steps do not."""
    prompts, ref = tiny_ref
    core = tp_core(tiny_model_dir, 2, max_num_batched_tokens=61, tp_overlap_tokens=threshold)
    model = core.runner.model.model
    sizes = []
    plain = model._forward_overlapped

    def overlapped(input_ids, positions, attn):
        sizes.append(input_ids.shape[0])
        return plain(input_ids, positions, attn)

    model._forward_overlapped = overlapped
    try:
        assert model.overlap_tokens == threshold
        got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)})
        assert [got[f"r{i}"][0] for i in range(len(prompts))] == ref
        assert sizes and min(sizes) >= max(threshold, 2) and any(n % 2 for n in sizes)
        if threshold == 1:
            assert 2 in sizes
    finally:
        core.close()


def test_smollm2_tp3_equals_hf(smollm2_dir):
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings: the LM head is each rank's rows of
    the replicated embedding) split over 3 ranks: 2 is refused, its heads do not divide."""
    from microserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = [tok.encode("The capital of France is"),
               tok.encode("def fibonacci(n):\n    ")]
    ref = hf_greedy(smollm2_dir, prompts, 16)
    core = tp_core(smollm2_dir, 3, page_size=16, num_pages=64)
    try:
        got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(16))
        assert [got[f"r{i}"][0] for i in range(2)] == ref
    finally:
        core.close()


def test_random_weights_are_the_same_model_at_every_size(tmp_path):
    """random:tiny drawn by 2 ranks (each draws every whole matrix and keeps its share) is
    the model one process draws: the same greedy tokens."""
    model = str(materialize("random:tiny", tmp_path))
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([3, 30], vocab=2048))}
    one = run_all(make_core(model), prompts)
    core = tp_core(model, 2)
    try:
        assert run_all(core, prompts) == one
        assert core.info.tensor_parallel_size == 2
        refuses_kv_transfer(core)
    finally:
        core.close()


def refuses_kv_transfer(core) -> None:
    """A tensor-parallel engine without an engine key neither receives KV nor sends it (its
    ranks' pools are not exported): both calls are 400s that say so, nothing held after them.
    With a key it does both (tests/test_tp_transfer.py)."""
    from microserve.backend import MicroservingError
    from microserve.messages.calls import PrepRecvRequest, RemoteSendRequest

    with pytest.raises(MicroservingError, match="cannot receive KV: .* without an engine key"
                       ) as e:
        core.on_prep_recv(PrepRecvRequest("recv", [5, 6, 7, 8, 9], 4), 0.0)
    assert e.value.status == 400
    with pytest.raises(MicroservingError, match="cannot send KV: it is tensor-parallel "
                                                "\\(--tensor-parallel-size 2\\) and runs with "
                                                "--kv-transfer none") as e:
        core.on_remote_send(RemoteSendRequest("send", [5, 6, 7, 8, 9], 0, 4), 0.0)
    assert e.value.status == 400
    assert core.kv.stats().used_pages == 0 and not core.has_work()


def test_lora_adapters_mixed_in_a_batch_equal_peft_at_tp2(tiny_model_dir, lora_dir, prompts,
                                                          reference):
    """a1 (rank 8, every projection) from the start and a2 (rank 4, q and v) loaded at
    runtime, each rank holding its share of each (B by output rows for q, k, v, gate, up; A
    by input columns for o and down): base and both adapters in one batch give PEFT's
    tokens."""
    core = tp_core(tiny_model_dir, 2, lora_modules=(("a1", str(lora_dir / "a1")),),
                   lora_dir=str(lora_dir))
    try:
        assert load(core, LoadLoraRequest("a2", "a2")).resident
        requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts)
                    for name in (None, "a1", "a2")}
        assert run_lora(core, requests) == {f"{name}-{i}": reference[name][i]
                                            for i, _ in enumerate(prompts)
                                            for name in (None, "a1", "a2")}
    finally:
        core.close()


# ---- the cut, without processes ---------------------------------------------------------------


def test_the_shares_reassemble_to_the_whole_weights():
    """Each rank's share of every kind of weight, put back together, is the whole weight: q,
    k, v by heads (KV heads replicated when fewer than ranks), gate and up by rows, o and down
    by columns, the LM head by vocabulary rows padded to equal shares."""
    config = ModelConfig.from_dicts("t", {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
    }, {})  # fmt: skip
    d, q, kv = 4, 16, 8  # head_dim, q rows, k (and v) rows
    qkv = torch.arange((q + 2 * kv) * 16.0).reshape(q + 2 * kv, 16)
    o = torch.arange(16 * q * 1.0).reshape(16, q)
    head = torch.arange(301 * 16.0).reshape(301, 16)
    for size in (2, 4):
        shares = [TensorParallel(size, r) for r in range(size)]
        cut = [tp.shard_parameter("model.layers.0.self_attn.qkv_proj.weight", qkv, config)
               for tp in shares]
        q_rows = q // size
        assert torch.equal(torch.cat([c[:q_rows] for c in cut]), qkv[:q])
        k_rows = cut[0].shape[0] - q_rows
        assert k_rows == 2 * max(d, kv // size)
        if size == 4:  # two ranks per KV head: ranks 0, 1 hold head 0; ranks 2, 3 head 1
            assert torch.equal(cut[0][q_rows:], cut[1][q_rows:])
            assert torch.equal(cut[2][q_rows : q_rows + d], qkv[q + d : q + 2 * d])
        else:
            assert torch.equal(torch.cat([c[q_rows : q_rows + kv // 2] for c in cut]),
                               qkv[q : q + kv])
        o_cut = [tp.shard_parameter("model.layers.0.self_attn.o_proj.weight", o, config)
                 for tp in shares]
        assert torch.equal(torch.cat(o_cut, dim=1), o)
        head_cut = [tp.shard_parameter("lm_head.weight", head, config) for tp in shares]
        per = -(-301 // size)
        assert all(h.shape == (per, 16) for h in head_cut)
        assert torch.equal(torch.cat(head_cut)[:301], head)
        assert not torch.cat(head_cut)[301:].any()  # padding rows are zero
        # a checkpoint's separate k_proj, cut the same way
        k = qkv[q : q + kv]
        k_cut = [tp.shard_checkpoint("model.layers.0.self_attn.k_proj.weight", k, config)
                 for tp in shares]
        assert all(torch.equal(c, cut[r][q_rows : q_rows + k_rows // 2])
                   for r, c in enumerate(k_cut))


@pytest.mark.parametrize("size,problem", [
    (3, "num_attention_heads 4 is not divisible by it; num_key_value_heads 2 is neither a "
        "multiple nor a divisor of it; intermediate_size 128 is not divisible by it"),
    (8, "num_attention_heads 4 is not divisible by it"),
])  # fmt: skip
def test_sizes_that_do_not_divide_the_model_are_refused(tiny_model_dir, size, problem):
    name = Path(tiny_model_dir).name
    with pytest.raises(ValueError) as e:
        EngineConfig(model=tiny_model_dir, tensor_parallel_size=size)
    assert str(e.value).startswith(f"tensor_parallel_size {size} does not fit model {name}: ")
    assert problem in str(e.value)


@pytest.mark.parametrize("kw,what", [
    ({"kv_transfer": "nvshmem", "nvshmem_group": "0/2@/tmp", "device": "cuda"},
     "--kv-transfer nvshmem"),
    ({"tensor_parallel_size": 0}, None),
])  # fmt: skip
def test_what_tensor_parallel_engines_cannot_do_yet_is_refused(tiny_model_dir, kw, what):
    kw = {"tensor_parallel_size": 2, **kw}
    with pytest.raises(ValueError, match=(f"{what} .*and tensor_parallel_size 2 do not work "
                                          "together yet" if what else
                                          "tensor_parallel_size must be in \\[1, 64\\], got 0")):
        EngineConfig(model=tiny_model_dir, **kw)
    # tcp works (tests/test_tp_transfer.py); auto: as for one rank, shm on CPUs with a key,
    # none without
    assert EngineConfig(model=tiny_model_dir, tensor_parallel_size=2,
                        kv_transfer="tcp").resolved_kv_transfer() == "tcp"
    config = EngineConfig(model=tiny_model_dir, tensor_parallel_size=2)
    assert config.resolved_kv_transfer() == "shm"
    assert config.resolved_kv_transfer(has_key=False) == "none"


# ---- a daemon: HTTP, then a rank killed -------------------------------------------------------


def _workers(core_pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{core_pid}/task").iterdir():
        children += map(int, (task / "children").read_text().split())
    return children


def test_engine_serves_then_ends_when_a_rank_dies(tiny_served_dir, tiny_ref, tmp_path):
    """`microserve engine --tensor-parallel-size 2` answers /v1/completions with Hugging
    Face's greedy tokens; SIGKILL of its worker rank ends the whole engine within seconds
    (no hang on the collective the worker will never join), saying which rank died."""
    prompts, ref = tiny_ref
    daemon = Daemon(tiny_served_dir, tmp_path / "engine.log", "tp", "--tensor-parallel-size",
                    "2", "--cpu-threads", "1", "--num-pages", "128", "--page-size", "4")
    try:
        daemon.wait_ready()
        r = daemon.http.post("/v1/completions", json={
            "model": "tp", "prompt": prompts[3], "max_tokens": N_NEW, "temperature": 0,
            "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].split() == [f"<{t}>" for t in ref[3]]
        core = daemon.core_pid()
        workers = _workers(core)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        assert daemon.proc.wait(30) != 0
        assert gone_within(core, 10)
        assert "tensor-parallel rank 1 exited (status -9): the engine stops" in daemon.log()
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()


def test_a_stopped_engine_takes_its_ranks_with_it(tiny_served_dir, tmp_path):
    """SIGTERM (a clean stop): the engine exits 0 and no worker rank is left behind."""
    daemon = Daemon(tiny_served_dir, tmp_path / "engine.log", "tp", "--tensor-parallel-size",
                    "2", "--cpu-threads", "1", "--num-pages", "64", "--page-size", "4")
    try:
        daemon.wait_ready()
        workers = _workers(daemon.core_pid())
        assert daemon.stop() == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone_within(w, 0.1) for w in workers):
            pass
        assert all(gone_within(w, 0.1) for w in workers), daemon.log()
    finally:
        if daemon.proc.poll() is None:
            daemon.stop()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{daemon.url}/health", timeout=2)


def test_a_model_not_resolved_yet_is_checked_when_it_loads(tmp_path):
    """`up` reads a deployment file (each engine's args into an EngineConfig) before it
    resolves `random:NAME` to a directory: the heads are checked at load instead."""
    from engine.model_runner import ModelRunner

    config = EngineConfig(model="random:tiny", tensor_parallel_size=3)  # no error yet
    resolved = str(materialize("random:tiny", tmp_path))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not fit model random-tiny: "
                                         "num_attention_heads 4 is not divisible by it"):
        ModelRunner(EngineConfig(**{**config.__dict__, "model": resolved,
                                    "tensor_parallel_size": 1}), torch.float32,
                    TensorParallel(3, 0))


def test_the_host_tier_swaps_every_ranks_share_and_tokens_equal_hf(tiny_model_dir):
    """The host KV tier on a TP 2 engine: too few pages for three growing requests, so one is
    preempted, its pages (both ranks' heads) go to the host and come back into other pages,
    byte-equal rank by rank; evicted prefix pages are demoted there too. Every request's greedy
    tokens equal Hugging Face's, and nothing is held at the end."""
    from test_host_swap import TINY_VOCAB

    from microserve.messages import SamplingParams

    core = tp_core(tiny_model_dir, 2, page_size=4, num_pages=24, max_num_seqs=4,
                   kv_host_memory_gb=0.01, kv_host_copy_gbps=1000.0)
    try:
        swap = core.host_swap
        assert len(swap.pools) == 2 and swap.page_shape[0] == 2
        out_pages, in_pages = [], []
        swap_out, swap_in = swap.swap_out, swap.swap_in

        def spy_out(seq_id, gpu_pages, num_tokens, beside=False):
            out_pages.append([pool[:, :, gpu_pages].clone() for pool in swap.pools])
            return swap_out(seq_id, gpu_pages, num_tokens, beside)

        def spy_in(seq_id, gpu_pages, skip=0, beside=False):
            tokens = swap_in(seq_id, gpu_pages, skip, beside)
            in_pages.append([pool[:, :, gpu_pages].clone() for pool in swap.pools])
            return tokens

        swap.swap_out, swap.swap_in = spy_out, spy_in
        prompts = random_prompts([20, 18, 16], seed=5, vocab=TINY_VOCAB)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, params)
        stats = core.stats()
        assert stats.preemptions_by_reason["pages"] >= 1
        assert stats.kv_swap_outs == stats.kv_swap_ins == stats.preemptions == len(out_pages)
        for out, back in zip(out_pages, in_pages):
            assert all(torch.equal(a, b) for a, b in zip(out, back))  # each rank's share
        assert stats.kv_host_prefix_demoted_pages > 0
        assert [got[f"r{i}"][0] for i in range(3)] == hf_greedy(tiny_model_dir, prompts, 24)
        assert stats.kv_host_pages_free + stats.kv_host_pages_cached == \
            stats.kv_host_pages_total
    finally:
        core.close()


def test_all_reduce_modes_are_checked_and_cpu_ranks_sum_with_gloo(tiny_model_dir):
    """--all-reduce: an unknown mode and one-shot without CUDA are refused at start, with the
    values; on the CPU `auto` sets nothing up (gloo sums every message)."""
    from engine.tp import allreduce

    with pytest.raises(ValueError, match="all_reduce must be auto, nccl or one-shot, got 'ring'"):
        EngineConfig(model=tiny_model_dir, all_reduce="ring")
    with pytest.raises(ValueError, match="all_reduce one-shot needs CUDA devices, got device "
                                         "'cpu'"):
        EngineConfig(model=tiny_model_dir, tensor_parallel_size=2, all_reduce="one-shot")
    assert allreduce.set_up("auto", None, torch.device("cpu"), torch.float32) is None
    assert allreduce.set_up("nccl", None, torch.device("cuda", 0), torch.bfloat16) is None
    with pytest.raises(ValueError, match="all_reduce must be one of auto, nccl, one-shot"):
        allreduce.set_up("ring", None, torch.device("cpu"), torch.float32)
    assert allreduce._cannot(torch.int8) == "its kernel sums bfloat16, float16 and float32, " \
                                            "not torch.int8"


# ---- the ranks agree on a custom all-reduce, or all keep NCCL ----------------------------------


def _agree_rank(rank: int, port: int, results) -> None:
    import logging

    import torch.distributed as dist

    from engine.tp.allreduce import ranks_agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("microserve.tp").addHandler(handler)
    both = ranks_agree(None, None, torch.device("cpu"), "large messages", "the exchange")
    one = ranks_agree("no driver" if rank == 1 else None, None, torch.device("cpu"),
                      "large messages", "the exchange")
    results[rank] = (both, one, warnings)
    dist.destroy_process_group()


def test_ranks_take_a_custom_all_reduce_together_or_none_does():
    """engine/tp/allreduce.py `ranks_agree` (the one-shot's and the copy-engine exchange's
    set-up): every rank can, so both take it; one cannot, so neither does, and each says why."""
    import torch.multiprocessing as mp

    from engine.tp.group import free_port

    results = mp.Manager().dict()
    mp.spawn(_agree_rank, args=(free_port(), results), nprocs=2)
    assert results[0][:2] == results[1][:2] == (True, False)
    assert results[1][2] == ["all-reduce: NCCL for large messages (the exchange is not available "
                             "on this rank: no driver)"]
    assert results[0][2] == ["all-reduce: NCCL for large messages (the exchange is not available "
                             "on another rank: see its log)"]
