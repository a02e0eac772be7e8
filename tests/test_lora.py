"""LoRA adapters in the engine core (in-process, the tiny random Llama): greedy tokens equal
transformers + peft's with the same adapter, base and adapters mixed in one step, slots
evicted least-recently-used, load and unload at runtime, bad adapters refused by name, and no
KV shared across adapters. The adapters are random (A and B non-zero), written by peft."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import threading
import time

import pytest
from conftest import TINY_VOCAB
from lora_adapters import peft_greedy, write_adapter
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.frames import CallFailed, invoke
from engine.lora.adapter import read_adapter, resolve_path
from engine.lora.registry import LoraRegistry
from kvcache.manager import KVCacheManager
from microserve.backend import MicroservingError, RequestRejected
from microserve.messages import (CALLS, LoadLoraRequest, LoadLoraResponse, SamplingParams,
                                 UnloadLoraRequest)
from microserve.model_config import ModelConfig

N_NEW = 12


def load(core, request: LoadLoraRequest) -> LoadLoraResponse:
    """/v1/load_lora_adapter as the core's loop runs it: deferred while the loader thread
    reads the adapter, answered by a tick once the thread wakes the loop (wakeup_fd)."""
    frames = core.handle(invoke(7, request))
    while not frames:
        assert select.select([core.wakeup_fd], [], [], 30)[0], "the load never finished"
        os.read(core.wakeup_fd, 4096)
        frames = core.tick(time.monotonic()).frames
    [frame] = frames
    if isinstance(frame, CallFailed):
        raise MicroservingError(frame.status, frame.error, frame.param)
    return CALLS["load_lora_adapter"].decode_answer(frame.result)


def greedy(lora_name=None, max_tokens=N_NEW):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          lora_name=lora_name)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory, prompts):
    """Two adapters under one directory, a1 (rank 8, every projection) and a2 (rank 4, q and
    v only, rsLoRA scaling), and PEFT's greedy tokens for each prompt per adapter (None: the
    base); the three differ."""
    root = tmp_path_factory.mktemp("adapters")
    a1 = write_adapter(tiny_model_dir, root / "a1", rank=8, seed=1)
    a2 = write_adapter(tiny_model_dir, root / "a2", rank=4, seed=2,
                       targets=("q_proj", "v_proj"), alpha=16, rslora=True)
    ref = {None: peft_greedy(a1, prompts, N_NEW, base=True),
           "a1": peft_greedy(a1, prompts, N_NEW), "a2": peft_greedy(a2, prompts, N_NEW)}
    assert ref["a1"] != ref[None] and ref["a2"] != ref[None] and ref["a1"] != ref["a2"]
    return root, ref


@pytest.fixture(scope="module")
def lora_dir(adapters):
    return adapters[0]


@pytest.fixture(scope="module")
def reference(adapters):
    return adapters[1]


def make_core(model_dir, adapters_dir, **kw):
    kw.setdefault("lora_modules", (("a1", str(adapters_dir / "a1")),
                                   ("a2", str(adapters_dir / "a2"))))
    return EngineCore(EngineConfig(model=model_dir, page_size=4, num_pages=256, **kw))


def run(core, requests: dict[str, tuple[list[int], str | None]],
        max_tokens: int = N_NEW) -> dict[str, list[int]]:
    """Add every request at once, step until done; request id -> tokens."""
    for rid, (prompt, name) in requests.items():
        core.add_request(rid, prompt, greedy(name, max_tokens))
    tokens = {rid: [] for rid in requests}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.token_ids
    core.check_integrity()
    assert core.kv.stats().used_pages == 0
    return tokens


def hold_reads(monkeypatch) -> threading.Event:
    """Hold the loader thread's reads of adapters from disk until the event returned is set."""
    import engine.core.adapters as adapters_module

    held, real_read = threading.Event(), adapters_module.read_adapter

    def held_read(*args):
        assert held.wait(30)
        return real_read(*args)

    monkeypatch.setattr(adapters_module, "read_adapter", held_read)
    return held


def spy_slots(core) -> list[set[int]]:
    """The set of LoRA slots each forward mixed."""
    seen, forward = [], core.runner.forward

    def recording(*args, lora_slots=None, **kw):
        seen.append(set(lora_slots))
        return forward(*args, lora_slots=lora_slots, **kw)

    core.runner.forward = recording
    return seen


# ---- tokens equal PEFT's ----------------------------------------------------------------------


def test_base_and_two_adapters_in_one_batch_equal_peft(tiny_model_dir, lora_dir, prompts,
                                                        reference):
    core = make_core(tiny_model_dir, lora_dir)
    steps = spy_slots(core)
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts)
                for name in (None, "a1", "a2")}
    tokens = run(core, requests)
    assert {rid: tokens[rid] for rid in requests} == {
        f"{name}-{i}": reference[name][i] for i, _ in enumerate(prompts)
        for name in (None, "a1", "a2")}
    assert steps[0] == {-1, 0, 1}, "the first step mixes the base and both adapters"
    # each adapter run alone gives the same tokens as in the mixed batch
    for name in ("a1", "a2"):
        assert run(core, {"alone": (prompts[1], name)})["alone"] == reference[name][1]
    stats = core.stats()
    assert (stats.lora_registered, stats.lora_resident) == (["a1", "a2"], ["a1", "a2"])
    assert stats.lora_loads == 2 and stats.lora_load_seconds > 0


def test_stats_and_vllms_lora_info_name_the_adapters_of_running_and_waiting_requests(
        tiny_model_dir, lora_dir, prompts):
    """One seat: the first request (a1) runs, a2's and the base's wait; the stats name the
    adapters each side, and /metrics has them in vLLM's `vllm:lora_requests_info` labels (the
    Gateway API inference extension routes by them), with the slots as `max_lora`."""
    from engine.frontend.core_client import format_core_stats

    core = make_core(tiny_model_dir, lora_dir, max_num_seqs=1, max_loras=2)
    for rid, name in (("r1", "a1"), ("r2", "a2"), ("r3", None), ("r4", "a2")):
        core.add_request(rid, prompts[0], greedy(name, 2))
    core.step()
    stats = core.stats()
    assert (stats.running, stats.waiting) == (1, 3)
    assert (stats.lora_running, stats.lora_waiting) == (["a1"], ["a2"])
    [line] = [x for x in format_core_stats(stats, core.info, "tiny").splitlines()
              if x.startswith("vllm:lora_requests_info{")]
    labels, value = line.rsplit(" ", 1)
    assert labels == ('vllm:lora_requests_info{running_lora_adapters="a1",'
                      'waiting_lora_adapters="a2",max_lora="2"}')
    assert abs(float(value) - time.time()) < 60
    while core.has_work():
        core.step()
    stats = core.stats()
    assert (stats.lora_running, stats.lora_waiting) == ([], [])
    base = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    assert "vllm:lora_requests_info" not in format_core_stats(base.stats(), base.info)
    # an engine behind --api-key: /metrics is open, the adapters' names stay off it
    assert "vllm:lora_requests_info" not in format_core_stats(stats, core.info, "tiny",
                                                              lora_names=False)


def test_prefill_chunks_and_decodes_of_adapters_in_one_step_equal_peft(
        tiny_model_dir, lora_dir, prompts, reference):
    """A 16-token budget: the 40-token prompts arrive in chunks while shorter requests of
    other adapters decode, in the same steps; every request still gets PEFT's tokens."""
    core = make_core(tiny_model_dir, lora_dir, max_num_batched_tokens=16, max_num_seqs=9)
    steps, forward = [], core.runner.forward

    def recording(batch, *args, lora_slots=None, **kw):
        steps.append([(s.num_new_tokens, slot) for s, slot in zip(
            batch.seqs, _first_slot_of_each(batch, lora_slots))])
        return forward(batch, *args, lora_slots=lora_slots, **kw)

    core.runner.forward = recording
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts)
                for name in (None, "a1", "a2")}
    tokens = run(core, requests)
    assert tokens == {f"{name}-{i}": reference[name][i] for i, _ in enumerate(prompts)
                      for name in (None, "a1", "a2")}
    mixed = [step for step in steps
             if any(n > 1 and slot >= 0 for n, slot in step)
             and len({slot for n, slot in step if n == 1}) >= 2]
    assert mixed, "no step had an adapter's prefill chunk beside decodes of two slots"
    core.check_integrity()


def _first_slot_of_each(batch, lora_slots):
    """The slot of each sequence of the batch (its tokens are contiguous in lora_slots)."""
    at, slots = 0, []
    for s in batch.seqs:
        slots.append(lora_slots[at])
        at += s.num_new_tokens
    return slots


@pytest.mark.slow  # loads the real model (the marker's rule): 4 s on a quiet machine
def test_smollm2_adapter_equals_peft(smollm2_dir, tmp_path):
    model = write_adapter(smollm2_dir, tmp_path / "s", rank=8, seed=3, scale_b=0.05)
    prompt = [1, 504, 3458, 2030, 16296, 314, 260, 2365]
    want = peft_greedy(model, [prompt], 8)[0]
    assert want != peft_greedy(model, [prompt], 8, base=True)[0], "the adapter does nothing"
    core = EngineCore(EngineConfig(model=smollm2_dir, num_pages=64,
                                   lora_modules=(("s", str(tmp_path / "s")),)))
    core.add_request("r", prompt, greedy("s", max_tokens=8))
    tokens = []
    while core.has_work():
        tokens += [t for out in core.step() for t in out.token_ids]
    assert tokens == want


# ---- slots: least recently used idle adapter evicted -----------------------------------------


def test_one_slot_serves_two_adapters_in_turn(tiny_model_dir, lora_dir, prompts, reference):
    core = make_core(tiny_model_dir, lora_dir, max_loras=1)
    steps = spy_slots(core)
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in ("a1", "a2")}
    tokens = run(core, requests)
    assert tokens == {f"{name}-{i}": reference[name][i] for i, _ in enumerate(prompts)
                      for name in ("a1", "a2")}
    assert all(len(s) == 1 for s in steps), "one slot: never two adapters in a step"
    stats = core.stats()
    assert stats.lora_slot_writes == 2  # a1 at start-up, a2 once a1's requests were done
    assert stats.lora_resident == ["a2"]


def test_registry_evicts_the_least_recently_used_idle_adapter():
    reg = LoraRegistry(max_loras=2)
    a, b, c = (reg.register(n, f"/{n}") for n in "abc")
    assert reg.claim_slot(a) == (0, None) and reg.claim_slot(b) == (1, None)
    reg.start_running(a)
    reg.start_running(b)
    reg.stop_running(b)
    reg.start_running(a)  # a used last, but it runs: b (idle) goes
    assert reg.claim_slot(c) == (1, b) and b.slot is None
    reg.start_running(c)
    assert reg.claim_slot(b) is None, "every slot's adapter is running"
    reg.stop_running(a), reg.stop_running(a), reg.stop_running(c)
    assert reg.claim_slot(b) == (0, a)  # a's last use is older than c's
    reg.check_integrity()


# ---- KV belongs to its adapter ----------------------------------------------------------------


def test_prefix_cache_never_serves_kv_across_adapters(tiny_model_dir, lora_dir, prompts,
                                                      reference):
    core = make_core(tiny_model_dir, lora_dir)
    prompt = prompts[2]  # 40 tokens: 9 whole pages of 4 reusable
    cached = {}
    for rid, name in (("base", None), ("a1", "a1"), ("a2", "a2"), ("a1-again", "a1")):
        core.add_request(rid, prompt, greedy(name))
        tokens = []
        while core.has_work():
            for out in core.step():
                tokens += out.token_ids
                cached[rid] = out.num_cached_tokens
        assert tokens == reference[name][2], rid
    assert cached == {"base": 0, "a1": 0, "a2": 0, "a1-again": 36}
    core.check_integrity()


def test_kv_manager_namespaces_keep_exact_pages():
    kv = KVCacheManager(num_pages=16, page_size=4)
    tokens = list(range(12))
    assert kv.open("base", tokens) == 0
    kv.allocate("base", 12)
    kv.cache_tokens("base", tokens)
    assert kv.page_table("base") == [0, 1, 2]
    assert kv.open("lora", tokens, namespace=7) == 0, "the base's pages served to an adapter"
    kv.allocate("lora", 12)
    kv.cache_tokens("lora", tokens)
    assert kv.page_table("lora") == [3, 4, 5]
    assert kv.open("lora-2", tokens, namespace=7) == 12
    assert kv.page_table("lora-2") == [3, 4, 5]
    assert kv.open("base-2", tokens) == 12 and kv.page_table("base-2") == [0, 1, 2]
    for seq in ("base", "lora", "lora-2", "base-2"):
        kv.free(seq)
    kv.check_integrity()
    assert kv.cache.evict(6) == 6 and list(kv.cache._roots) == [0]  # the adapter's tree goes
    kv.check_integrity()


# ---- load and unload at runtime --------------------------------------------------------------


def test_load_and_unload_at_runtime(tiny_model_dir, lora_dir, prompts, reference):
    core = make_core(tiny_model_dir, lora_dir, lora_modules=(), enable_lora=True,
                     lora_dir=str(lora_dir))
    with pytest.raises(RequestRejected, match="no LoRA adapter of that name"):
        core.add_request("early", prompts[0], greedy("a1"))
    assert core.stats().lora_host_slabs == 1  # a spare slab, for the first load
    answer = load(core, LoadLoraRequest("a1", "a1"))
    assert (answer.lora_name, answer.rank, answer.resident) == ("a1", 8, True)
    core.adapters._loader.submit(lambda: None).result()  # the loader thread is done
    assert core.stats().lora_host_slabs == 2, "the next spare, allocated after the load"
    print(f"\nrank-8 adapter of the tiny model loaded in {answer.load_s * 1e3:.1f} ms (CPU: "
          f"read, check and pack in the loader thread, then the slot write)")
    with pytest.raises(MicroservingError, match="already loaded"):
        load(core, LoadLoraRequest("a1", "a2"))
    core.add_request("r", prompts[1], greedy("a1"))
    tokens = [t for out in core.step() for t in out.token_ids]  # admitted and running
    gone = core.on_unload_lora_adapter(UnloadLoraRequest("a1"), None)
    assert gone.pending, "a1 has a request running: it goes with it"
    with pytest.raises(RequestRejected):
        core.add_request("late", prompts[0], greedy("a1"))
    while core.has_work():
        for out in core.step():
            tokens += out.token_ids
    assert tokens == reference["a1"][1]
    assert core.stats().lora_registered == [] and core.stats().lora_resident == []
    assert core.adapters._packed == {}
    core.check_integrity()
    with pytest.raises(MicroservingError) as e:
        core.on_unload_lora_adapter(UnloadLoraRequest("a1"), None)
    assert e.value.status == 404
    # loaded again under the same name: a new id, so none of its old KV is reused
    load(core, LoadLoraRequest("a1", str(lora_dir / "a1")))
    assert run(core, {"again": (prompts[1], "a1")})["again"] == reference["a1"][1]
    core.adapters._loader.submit(lambda: None).result()
    assert core.stats().lora_host_slabs == 2, "the unloaded adapter's slab is reused"


def test_slab_layout_packs_tensors_into_aligned_pieces():
    from engine.lora.host import Layout, Slabs

    layout = Layout([100, 3 << 20, 2 << 20, 5 << 20, 64], piece_bytes=4 << 20)
    assert layout.piece_bytes == 8 << 20  # a power of two that holds the largest
    assert layout.places == [(0, 0), (0, 128), (0, 128 + (3 << 20)), (1, 0), (1, 5 << 20)]
    assert layout.pieces == 2
    slabs = Slabs(layout, pin=False, keep=1)
    slabs.reserve(1)
    first = slabs.take()
    assert [len(p) for p in first] == [8 << 20] * 2 and slabs.allocated == 1
    second = slabs.take()  # none free: a new one
    slabs.give(first, None)
    slabs.give(second, None)  # past `keep`: dropped
    assert slabs.free == 1 and slabs.take() is first and slabs.allocated == 2


def test_steps_go_on_while_an_adapter_loads(tiny_model_dir, lora_dir, prompts, reference,
                                           monkeypatch):
    """The read from disk runs in the loader thread: a base request's steps run to the end
    while it is held, the call is answered only once it is done, and the adapter then
    serves PEFT's tokens."""
    held = hold_reads(monkeypatch)
    core = make_core(tiny_model_dir, lora_dir, lora_modules=(), enable_lora=True,
                     lora_dir=str(lora_dir))
    assert core.handle(invoke(7, LoadLoraRequest("a1", "a1"))) == []  # deferred
    with pytest.raises(MicroservingError, match="already loaded"):  # nor loaded twice
        load(core, LoadLoraRequest("a1", "a2"))
    assert run(core, {"base": (prompts[1], None)})["base"] == reference[None][1]
    assert core.tick(time.monotonic()).frames == [] and core.stats().lora_registered == []
    held.set()
    assert select.select([core.wakeup_fd], [], [], 30)[0]
    [reply] = core.tick(time.monotonic()).frames
    answer = CALLS["load_lora_adapter"].decode_answer(reply.result)
    assert (answer.lora_name, answer.resident) == ("a1", True)
    assert run(core, {"lora": (prompts[1], "a1")})["lora"] == reference["a1"][1]
    core.check_integrity()
    core.close()


def test_requests_for_adapters_refused_where_they_cannot_run(tiny_model_dir, lora_dir, prompts):
    core = make_core(tiny_model_dir, lora_dir)
    run(core, {"base": (prompts[1], None)})  # cached under the base: nothing of it for a1
    with pytest.raises(MicroservingError, match="beyond the 0 tokens of this prompt cached") as e:
        core.add_request("pd", prompts[1], greedy("a1"), begin=8)
    assert e.value.param == "begin"
    plain = EngineCore(EngineConfig(model=tiny_model_dir, page_size=4, num_pages=64))
    with pytest.raises(RequestRejected, match="serves no LoRA adapters"):
        plain.add_request("x", prompts[0], greedy("a1"))
    with pytest.raises(MicroservingError, match="LoRA is off"):
        load(plain, LoadLoraRequest("a1", "a1"))
    for c in (core, plain):
        c.check_integrity()
        assert not c.requests.get("pd") and not c.requests.get("x")


# ---- bad adapters -----------------------------------------------------------------------------


def _copy(lora_dir, tmp_path, name="a1"):
    dst = tmp_path / "bad"
    shutil.copytree(lora_dir / name, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


Q_A = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("break_it, message", [
    (lambda p: _edit_config(p, r=32), "rank 32 is over --max-lora-rank 16"),
    (lambda p: _edit_tensors(p, lambda t: t.pop(Q_A)),
     "layer 1 q_proj has no lora_A tensor"),
    (lambda p: _edit_tensors(p, lambda t: t.update({Q_A: t[Q_A][:, :10].clone()})),
     r"has shape \[8, 10\], expected \[8, 64\]"),
    (lambda p: _edit_config(p, target_modules=["q_proj", "lm_head"]),
     "unknown target module.s. lm_head"),
    (lambda p: _edit_tensors(p, lambda t: t.update(
        {Q_A.replace("q_proj", "rotary"): t[Q_A].clone()})), "unknown target module .rotary."),
    (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    (lambda p: _edit_config(p, use_dora=True), "use_dora is not supported"),
])
def test_bad_adapter_is_refused_naming_the_problem(tiny_model_dir, lora_dir, tmp_path,
                                                   break_it, message):
    bad = _copy(lora_dir, tmp_path)
    break_it(bad)
    with pytest.raises(ValueError, match=message):
        read_adapter("bad", bad, ModelConfig.from_dir(tiny_model_dir), max_rank=16)


def test_missing_layer_of_a_target_is_refused(tiny_model_dir, lora_dir, tmp_path):
    bad = _copy(lora_dir, tmp_path)
    _edit_tensors(bad, lambda t: [t.pop(k) for k in list(t) if ".layers.0.mlp.down_proj." in k])
    with pytest.raises(ValueError, match="target module down_proj of layer 0 has no"):
        read_adapter("bad", bad, ModelConfig.from_dir(tiny_model_dir), max_rank=16)


def test_path_outside_the_adapters_directory_is_refused(lora_dir, tmp_path):
    with pytest.raises(ValueError, match="outside the adapters directory"):
        resolve_path("../elsewhere", str(lora_dir))
    (lora_dir / "link").symlink_to(tmp_path)  # a link out of it counts as outside too
    with pytest.raises(ValueError, match="outside the adapters directory"):
        resolve_path("link", str(lora_dir))
    assert resolve_path("a1", str(lora_dir)) == (lora_dir / "a1").resolve()


def test_bad_adapters_at_start_up_and_at_runtime(tiny_model_dir, lora_dir, tmp_path):
    bad = _copy(lora_dir, tmp_path)
    _edit_config(bad, r=32)
    with pytest.raises(ValueError, match="rank 32 is over --max-lora-rank 16"):
        make_core(tiny_model_dir, lora_dir, lora_modules=(("bad", str(bad)),))
    core = make_core(tiny_model_dir, lora_dir, lora_modules=(), enable_lora=True,
                     lora_dir=str(lora_dir), max_lora_rank=4)
    with pytest.raises(MicroservingError, match="rank 8 is over --max-lora-rank 4") as e:
        load(core, LoadLoraRequest("a1", "a1"))
    assert (e.value.status, e.value.param) == (400, "lora_path")
    with pytest.raises(MicroservingError, match="outside the adapters directory"):
        load(core, LoadLoraRequest("x", str(bad)))
    assert core.stats().lora_registered == []
    core.check_integrity()


def test_an_adapter_may_not_take_the_served_models_name(tiny_model_dir):
    from engine.frontend.core_client import CoreClient

    config = EngineConfig(model=tiny_model_dir, lora_modules=(("tiny", "/anywhere"),))
    with pytest.raises(ValueError, match="the served model's own name"):
        CoreClient(config, "tiny")


def test_a_slot_holds_the_adapter_scaled_and_zeros_wherever_it_has_nothing():
    """LoraLinear.pack into buffers it does not zero first: a rank-2 adapter in rank-4 slots,
    one of three slices left out, B times the scale rounded once into bfloat16 as float32 math
    gives it, from a float32 B (scaled, then cast) and from a bfloat16 one (cast exactly, then
    scaled in place)."""
    import torch
    from torch import nn

    from engine.lora.layers import LoraBatch, LoraLinear

    base = nn.Linear(8, 3 + 2 + 2, bias=False, dtype=torch.bfloat16)
    proj = LoraLinear(base, LoraBatch(2, 4, torch.device("cpu")), [3, 2, 2], rank=4)
    gen = torch.Generator().manual_seed(0)
    a_q, b_q = torch.randn(2, 8, generator=gen), torch.randn(3, 2, generator=gen)
    a_v, b_v = (t.to(torch.bfloat16) for t in (torch.randn(2, 8, generator=gen),
                                               torch.randn(2, 2, generator=gen)))
    for _ in range(3):  # reused memory holds whatever the last pack left there
        a, b = proj.pack([(a_q, b_q), None, (a_v, b_v)], scale=0.75)
    want_a = torch.zeros(12, 8, dtype=torch.bfloat16)
    want_a[0:2], want_a[8:10] = a_q.to(torch.bfloat16), a_v
    want_b = torch.zeros(7, 4, dtype=torch.bfloat16)
    want_b[0:3, :2] = (b_q * 0.75).to(torch.bfloat16)
    want_b[5:7, :2] = (b_v.float() * 0.75).to(torch.bfloat16)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)
    assert proj.pack([None, None, None]) is None


@pytest.mark.parametrize("keep", ["all", "no-k-in-layer-1", "q-only"])
def test_slab_chunks_hold_what_layer_by_layer_packing_gives(tiny_model_dir, keep):
    """An adapter packed into a slab (chunks of layers stacked with a few ops, or layer by
    layer where a projection is not at the slots' full rank everywhere, zeros where it has
    no target) equals it packed layer by layer into new tensors, tensor for tensor; a slot
    written from the slab a chunk at a time equals one written layer by layer; a slab
    reused for another adapter keeps nothing of the first."""
    import torch

    from engine.lora.adapter import AdapterWeights, module_shapes
    from engine.lora.host import Slabs
    from engine.lora.layers import LoraModel
    from engine.models.loader import load_model

    model, config = load_model(tiny_model_dir, dtype=torch.bfloat16)
    lora = LoraModel(model, config, max_loras=3, max_rank=4, max_tokens=4)
    gen = torch.Generator().manual_seed(1)

    def adapter(seed_scale: float) -> AdapterWeights:
        weights = {(layer, m): ((torch.randn(4, d_in, generator=gen) * seed_scale).bfloat16(),
                                (torch.randn(d_out, 4, generator=gen)).bfloat16())
                   for layer in range(config.num_layers)
                   for m, (d_in, d_out) in module_shapes(config).items()
                   if keep != "q-only" or m == "q_proj"}
        if keep == "no-k-in-layer-1":
            del weights[(1, "k_proj")]
        return AdapterWeights("a", "/a", 4, 0.5, weights)

    slabs = Slabs(lora.layout, pin=False)
    for scale in (1.0, 3.0):  # the second reuses the first's slab
        weights = adapter(scale)
        slab = slabs.take()
        chunked, by_layer = lora.pack(weights, slab=slab), lora.pack(weights)
        for got, want in zip(chunked, by_layer):
            for name in got:
                if want[name] is None:  # nothing targeted (the slab's chunk holds zeros)
                    assert got[name] is None, name
                else:
                    assert all(torch.equal(g, w) for g, w in zip(got[name], want[name])), name
        lora.write_slot(0, chunked, slab)
        lora.write_slot(1, by_layer)
        for a, b in lora.slots.values():
            assert torch.equal(a[:, 0], a[:, 1]) and torch.equal(b[:, 0], b[:, 1])
            assert not a[:, 2].any() and not b[:, 2].any()  # the slot between untouched
        slabs.give(slab, None)
    assert slabs.allocated == 1
    lora.write_slot(0, None)
    assert all(not a[:, 0].any() and not b[:, 0].any() for a, b in lora.slots.values())


# ---- reading an adapter straight into its slab -----------------------------------------------


@pytest.mark.parametrize("file_dtype, model_dtype", [
    ("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
    ("float16", "bfloat16")])
def test_adapter_read_into_its_slab_equals_packing_its_tensors(tiny_model_dir, tmp_path,
                                                               file_dtype, model_dtype):
    """An adapter at the slots' full rank is read from its file straight into the slab (no
    tensor made in between: `tensors()` is never called), cast and scaled there; what lands
    in the slab equals, byte for byte, the adapter's tensors packed layer by layer."""
    import torch

    from engine.lora.adapter import AdapterWeights
    from engine.lora.host import Slabs
    from engine.lora.layers import LoraModel
    from engine.models.loader import load_model

    write_adapter(tiny_model_dir, tmp_path / "a", rank=4, seed=5, alpha=12)
    file = tmp_path / "a" / "adapter_model.safetensors"
    dtype = getattr(torch, file_dtype)
    save_file({k: t.to(dtype) for k, t in load_file(file).items()}, file)
    model, config = load_model(tiny_model_dir, dtype=getattr(torch, model_dtype))
    lora = LoraModel(model, config, max_loras=2, max_rank=4, max_tokens=4)
    direct = read_adapter("a", tmp_path / "a", config, max_rank=4)
    assert direct.scale == 3.0
    slab = Slabs(lora.layout, pin=False).take()
    for piece in slab:
        piece.fill_(0xAB)  # whatever was there before
    got = lora.pack(direct, slab=slab)
    assert direct.weights is None, "the tensors were read into host tensors first"
    tensors = read_adapter("a", tmp_path / "a", config, max_rank=4).tensors()
    assert all(t.dtype == dtype for pair in tensors.values() for t in pair)
    want = lora.pack(AdapterWeights("a", "/a", 4, 3.0, tensors))
    for got_layer, want_layer in zip(got, want, strict=True):
        for name, pair in want_layer.items():
            assert all(torch.equal(g, w) for g, w in zip(got_layer[name], pair)), name


def test_adapter_read_into_its_slab_gives_peft_tokens(tiny_model_dir, lora_dir, prompts,
                                                      reference, monkeypatch):
    """a1 (rank 8, float32 file, every projection) with slots of rank 8: read straight into
    its slab at start-up and at runtime, and the tokens are PEFT's."""
    from engine.lora.adapter import AdapterWeights

    def refuse(self):
        raise AssertionError("read into host tensors, not straight into the slab")

    monkeypatch.setattr(AdapterWeights, "tensors", refuse)
    core = make_core(tiny_model_dir, lora_dir, max_lora_rank=8, lora_dir=str(lora_dir),
                     lora_modules=(("a1", str(lora_dir / "a1")),))
    load(core, LoadLoraRequest("again", "a1"))
    tokens = run(core, {f"{name}-{i}": (p, name) for i, p in enumerate(prompts)
                        for name in ("a1", "again")})
    assert tokens == {f"{name}-{i}": reference["a1"][i] for i, p in enumerate(prompts)
                      for name in ("a1", "again")}


def _rewrite_header(path, edit):
    """Rewrite the safetensors header of `path`'s adapter through `edit(header dict)`."""
    file = path / "adapter_model.safetensors"
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def _truncate(path, nbytes):
    file = path / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-nbytes])


@pytest.mark.parametrize("break_it, message", [
    (lambda p: _truncate(p, 100), r"has bytes \[\d+, \d+\) of a data section of \d+"),
    (lambda p: _rewrite_header(p, lambda h: h[Q_A].update(dtype="I32")),
     "has dtype I32, not a floating-point one"),
    (lambda p: _rewrite_header(p, lambda h: h[Q_A].update(dtype=["F32"])),
     r"has dtype \['F32'\], not a floating-point one"),
    (lambda p: _rewrite_header(p, lambda h: h[Q_A].update(shape=[8, 65])),
     r"has bytes \[\d+, \d+\) of a data section"),
    (lambda p: _rewrite_header(p, lambda h: h[Q_A].pop("data_offsets")), "broken header entry"),
    (lambda p: (p / "adapter_model.safetensors").write_bytes(b"\xff" * 64),
     "is not a safetensors file"),
    (lambda p: (p / "adapter_model.safetensors").write_bytes(
        (5).to_bytes(8, "little") + b"{nope"), "has a broken header"),
])
def test_broken_safetensors_file_is_refused_naming_the_problem(tiny_model_dir, lora_dir,
                                                               tmp_path, break_it, message):
    bad = _copy(lora_dir, tmp_path)
    break_it(bad)
    with pytest.raises(ValueError, match=message):
        read_adapter("bad", bad, ModelConfig.from_dir(tiny_model_dir), max_rank=16)


@pytest.mark.parametrize("change", ["cut short", "replaced"])
def test_adapter_file_changed_after_its_check_is_refused(tiny_model_dir, lora_dir, tmp_path,
                                                         change):
    """A file that loses its tail, or is replaced by another adapter's, between the header's
    check and the read of its data: a ValueError naming the adapter (no crash, no slot filled
    from the old header's offsets)."""
    bad = _copy(lora_dir, tmp_path)
    weights = read_adapter("bad", bad, ModelConfig.from_dir(tiny_model_dir), max_rank=16)
    if change == "cut short":
        _truncate(bad, 4096)
    else:
        shutil.copy(lora_dir / "a2" / "adapter_model.safetensors",
                    bad / "adapter_model.safetensors.new")
        os.replace(bad / "adapter_model.safetensors.new", bad / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="'bad': adapter_model.safetensors changed since it "
                                         "was checked"):
        weights.tensors()


# ---- host copies capped (max_cpu_loras): read back from disk when next needed --------------


def run_ticking(core, requests: dict[str, tuple[list[int], str | None]]):
    """Add the requests, then run the core's loop as its process does (a tick, a step; waiting
    on the wakeup pipe while stalled) until none is left. Returns (tokens by request id,
    Rejected frames by request id); requests are added one at a time, each after the last
    one finished, so each waits for its own adapter."""
    from engine.frames import Rejected

    tokens, rejected = {}, {}
    for rid, (prompt, name) in requests.items():
        core.add_request(rid, prompt, greedy(name, N_NEW))
        tokens[rid] = []
        deadline = time.monotonic() + 60
        while core.has_work() and time.monotonic() < deadline:
            for frame in core.tick(time.monotonic()).frames:
                if isinstance(frame, Rejected):
                    rejected[frame.request_id] = frame
            if not core.has_work():
                break
            for out in core.step():
                tokens[out.request_id] += out.token_ids
            if core.stalled:
                select.select([core.wakeup_fd], [], [], 5)
                os.read(core.wakeup_fd, 4096)
        assert not core.has_work(), "the core never finished"
    core.check_integrity()
    assert core.kv.stats().used_pages == 0
    return tokens, rejected


def test_host_copies_past_max_cpu_loras_are_read_back_when_needed(tiny_model_dir, lora_dir,
                                                                   prompts, reference):
    """One slot, one host copy for two adapters: each request of the adapter whose copy was
    dropped reads it back from disk, waits for it, and gets PEFT's tokens; at most one host
    copy is ever kept."""
    core = make_core(tiny_model_dir, lora_dir, max_loras=1, max_cpu_loras=1)
    assert core.stats().lora_host_copies == 1  # a2's: a1 sits in the slot, its copy dropped
    order = ["a1", "a2", "a1", "a2"]
    tokens, rejected = run_ticking(core, {f"r{i}": (prompts[1], n) for i, n in enumerate(order)})
    assert not rejected
    assert tokens == {f"r{i}": reference[n][1] for i, n in enumerate(order)}
    stats = core.stats()
    assert stats.lora_reads_back == 2  # a1 for r2, a2 for r3 (r1 found a2's copy kept)
    assert stats.lora_host_copies == 1 and stats.lora_slot_writes == 4


def test_an_adapter_that_cannot_be_read_back_fails_its_requests(tiny_model_dir, lora_dir,
                                                                prompts, reference, tmp_path):
    """a1's host copy was dropped and its file is gone: its request fails with a 500 naming
    it (nothing held), and the engine goes on serving a2; a1 stays registered."""
    root = tmp_path / "adapters"
    shutil.copytree(lora_dir, root)
    core = make_core(tiny_model_dir, root, max_loras=1, max_cpu_loras=1)
    (root / "a1" / "adapter_model.safetensors").unlink()
    tokens, rejected = run_ticking(core, {"r0": (prompts[0], "a2"), "r1": (prompts[0], "a1"),
                                          "r2": (prompts[0], "a2")})
    assert set(rejected) == {"r1"} and rejected["r1"].status == 500
    assert "LoRA adapter 'a1' could not be read back from disk" in rejected["r1"].message
    assert tokens["r0"] == tokens["r2"] == reference["a2"][0]
    assert core.stats().lora_registered == ["a1", "a2"]


def test_max_cpu_loras_below_max_loras_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be at least max_loras \(4\)"):
        EngineConfig(model=tiny_model_dir, enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_an_adapter_unloaded_while_it_is_read_back_leaves_nothing(tiny_model_dir, lora_dir,
                                                                  prompts, monkeypatch):
    """a1's copy was dropped; its request starts a read back, which the test holds; the
    request is aborted and a1 unloaded (gone at once: no request of it left). When the read
    ends, the slab it read into goes back to the free ones: nothing kept for an adapter that
    is gone."""
    core = make_core(tiny_model_dir, lora_dir, max_loras=1, max_cpu_loras=1)
    run(core, {"a2": (prompts[0], "a2")})  # a1 leaves the slot; its copy was dropped before
    held = hold_reads(monkeypatch)
    core.add_request("r", prompts[0], greedy("a1", N_NEW))
    assert core.step() == [] and core.stats().lora_reads_back == 1
    core.abort_request("r")
    assert core.on_unload_lora_adapter(UnloadLoraRequest("a1"), None).pending is False
    slabs = core.adapters._slabs
    free, allocated = slabs.free, slabs.allocated
    held.set()  # the read takes a free slab, reads a1 into it, and ends
    assert select.select([core.wakeup_fd], [], [], 30)[0]
    core.tick(time.monotonic())
    assert (slabs.free, slabs.allocated) == (free, allocated)  # its slab came back
    assert core.stats().lora_registered == ["a2"] and core.stats().lora_host_copies == 1
    core.check_integrity()
    core.close()


@pytest.mark.parametrize("threads, iov_max", [(1, 1024), (3, 2)])
def test_read_into_fills_each_place_from_the_file(lora_dir, tiny_model_dir, monkeypatch,
                                                  threads, iov_max):
    """`read_into` over any subset of a file's tensors, in any order, split into runs at
    gaps, at the iovec limit and across threads, fills each buffer with exactly its tensor."""
    import random as random_module

    import torch

    from engine.lora import adapter as adapter_module

    monkeypatch.setattr(adapter_module, "_READ_THREADS", threads)
    monkeypatch.setattr(adapter_module, "_IOV_MAX", iov_max)
    weights = read_adapter("a1", lora_dir / "a1", ModelConfig.from_dir(tiny_model_dir), 16)
    want = load_file(lora_dir / "a1" / "adapter_model.safetensors")
    places = [(key, half, place) for key, pair in weights.places.items()
              for half, place in enumerate(pair)]
    random_module.Random(threads).shuffle(places)
    chosen = places[::2]  # every other one: gaps between the runs
    buffers = [torch.full(p.shape, -1.0, dtype=p.dtype) for _, _, p in chosen]
    weights.read_into([(p, adapter_module.host_bytes(b)) for (_, _, p), b in
                       zip(chosen, buffers)])
    parents = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn"}
    for ((layer, module), half, _), got in zip(chosen, buffers):
        key = (f"base_model.model.model.layers.{layer}.{parents.get(module, 'mlp')}."
               f"{module}.lora_{'AB'[half]}.weight")
        assert torch.equal(got, want[key]), key
