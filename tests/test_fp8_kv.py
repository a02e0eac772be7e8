"""The fp8 KV cache (`--kv-cache-dtype fp8`): K and V stored as float8 e4m3 with scale 1.

- Storing saturates at +-448 and rounds to nearest even: the torch backend's bytes are torch's
  cast; the Triton kernel that rotates and stores k writes the same bytes (under the CPU
  interpreter on values its inexact fp8 conversion holds exactly, on the GPU on random ones).
- The engine generates exactly the greedy tokens of Hugging Face's model whose attention reads
  K and V rounded to e4m3 (`bench.fp8_quality.hf_fp8_kv`); its logprobs are that model's, not
  the 32-bit cache's (the rounding is real).
- The pool holds four times the tokens of an fp32 cache in the same memory; `info` says so.
- P/D between two fp8 engines (shm, tcp): D receives P's KV byte for byte and continues with
  the single engine's tokens. An fp8 engine and a 32-bit one refuse to exchange KV, naming the
  dtypes.
- Bad settings are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
from conftest import _hf_model, hf_greedy
from test_engine_core import greedy, make_core, random_prompts, run_all
from test_kv_exchange import KEY, PAGE, answered, assert_clean, generate
from triton_kernels import DEVICE, INTERPRET, load

from bench.fp8_quality import hf_fp8_kv, round_to_fp8
from engine.attention.torch_backend import store
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_exchange import slot_tensor
from microserve.backend import MicroservingError
from microserve.messages import SamplingParams

FP8 = torch.float8_e4m3fn
fused = load("engine.kernels.fused")


def _e4m3_grid_values(shape, gen) -> torch.Tensor:
    """Random fp32 values each exactly an e4m3 number (normal or zero), so that any correct
    conversion keeps them: the interpreter's fp8 conversion rounds ties up and flushes
    subnormals, but an exact value it converts right."""
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    exponent = (bits >> 3) & 0xF
    bits[(exponent == 0) | ((bits & 0x7F) == 0x7F)] = 0  # no subnormals, no NaN
    return bits.view(FP8).float()


def test_store_saturates_and_rounds_to_nearest_even():
    cache = torch.full((2, 4, 1, 4), 7.0).to(FP8)  # [pages, page_size, kv_heads, head_dim]
    x = torch.tensor([[[500.0, -1e4, 448.0, 0.3]], [[1.0625, 1.1875, -2**-8, 2**-10]]])
    store(cache, torch.tensor([6, 1]), x)
    rows = cache.view(-1, 1, 4).float()
    assert rows[6].flatten().tolist() == [448.0, -448.0, 448.0, 0.3125]
    # ties go to the even mantissa (1.0625 -> 1.0, 1.1875 -> 1.25); subnormals keep their value
    assert rows[1].flatten().tolist() == [1.0, 1.25, -2**-8, 0.0]
    assert (rows[[0, 2, 3, 4, 5, 7]] == 7.0).all()  # no other slot written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_kv_writes_the_reference_bytes_into_an_fp8_cache(dtype):
    """The kernel leaves rotated k in k; the cache must hold `store`'s bytes of that k and of v.
    On CPU every position is 0 (cos 1, sin 0: k stays on the e4m3 grid) with a few values past
    +-448; on the GPU, random values and positions."""
    from test_fused_kernels import config

    from engine.models.llama import RotaryEmbedding

    heads, kv_heads, head_dim, tokens = 4, 2, 32, 24
    cfg = config(heads, kv_heads, head_dim, max_pos=512)
    gen = torch.Generator().manual_seed(0)
    width = (heads + 2 * kv_heads) * head_dim
    if INTERPRET:
        qkv = _e4m3_grid_values((tokens, width), gen)
        qkv[::5, heads * head_dim] = 1000.0  # past 448: saturates
        qkv[1::5, -1] = -600.0
        positions = torch.zeros(tokens, dtype=torch.long)
    else:
        qkv = torch.randn(tokens, width, generator=gen) * 8
        qkv[::5, heads * head_dim] = 1000.0
        positions = torch.randint(0, 512, (tokens,), generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cache = torch.zeros(2, 8, 4, kv_heads, head_dim, device=DEVICE).to(FP8)
    slots = torch.randperm(32, generator=gen)[:tokens].to(DEVICE)
    slots[3] = -1  # a CUDA graph's padding row: stores nothing
    cos_sin = RotaryEmbedding(cfg).to(DEVICE).cos_sin
    fused.rope_and_store_kv(q, k, v, positions.to(DEVICE), cos_sin, cache[0], cache[1], slots)
    expected = torch.zeros_like(cache).cpu()
    kept = slots >= 0
    store(expected[0], slots[kept].cpu(), k[kept].cpu())
    store(expected[1], slots[kept].cpu(), v[kept].cpu())
    assert torch.equal(cache.cpu().view(torch.uint8), expected.view(torch.uint8))
    assert (cache.cpu().float() == 448.0).any()  # the saturated values are in


def _fp8_hf_greedy(model_dir, prompts, n):
    with hf_fp8_kv(_hf_model(model_dir)):
        return hf_greedy(model_dir, prompts, n)


def _first_logprobs(core, prompts) -> dict[str, float]:
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))
    got = {}
    while core.has_work():
        for out in core.step():
            got[out.request_id] = out.logprobs[0].logprob
    return got


def _hf_first_logprob(model_dir, prompt) -> float:
    model = _hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return logits.log_softmax(-1).max().item()


def test_engine_with_an_fp8_cache_equals_hf_reading_fp8_kv(tiny_model_dir):
    prompts = random_prompts([1, 5, 17, 40, 64, 90], seed=3)
    n = 24
    core = make_core(tiny_model_dir, kv_cache_dtype="fp8")
    assert core.runner.kv.kv.dtype == FP8
    assert core.info.kv_cache_dtype == "float8_e4m3fn" and core.info.dtype == "float32"
    got = run_all(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(n))
    for i, expected in enumerate(_fp8_hf_greedy(tiny_model_dir, prompts, n)):
        assert got[f"r{i}"][0] == expected, i
    # logprobs: Hugging Face's with fp8 K/V, and not those of the fp32 cache
    named = {f"p{i}": p for i, p in enumerate(prompts) if len(p) > 1}
    fp8_lp = _first_logprobs(core, named)
    plain_lp = _first_logprobs(make_core(tiny_model_dir), named)
    moved = 0.0
    for rid, prompt in named.items():
        with hf_fp8_kv(_hf_model(tiny_model_dir)):
            assert fp8_lp[rid] == pytest.approx(_hf_first_logprob(tiny_model_dir, prompt),
                                                abs=1e-4), rid
        moved = max(moved, abs(fp8_lp[rid] - plain_lp[rid]))
    assert moved > 1e-3, moved
    assert_clean(core)


def test_the_pool_holds_a_quarter_of_the_bytes_a_token(tiny_model_dir):
    fp32 = make_core(tiny_model_dir, num_pages=None, kv_cache_memory_gb=0.01)
    fp8 = make_core(tiny_model_dir, num_pages=None, kv_cache_memory_gb=0.01, kv_cache_dtype="fp8")
    per_page = fp8.runner.kv_bytes_per_page(4)
    assert per_page * 4 == fp32.runner.kv_bytes_per_page(4)
    assert fp8.info.num_pages == int(0.01 * 2**30 // per_page)
    assert fp8.info.kv_capacity_tokens == 4 * fp8.info.num_pages
    assert fp8.info.num_pages in range(4 * fp32.info.num_pages, 4 * fp32.info.num_pages + 4)
    assert fp8.runner.kv.kv.numel() * 1 <= 0.01 * 2**30


# ---- P/D with fp8 pools ---------------------------------------------------------------------

def _core(model_dir, kind, **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("num_pages", 128)
    return EngineCore(EngineConfig(model=model_dir, kv_transfer=kind, **kw), transfer_key=KEY)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_pd_between_fp8_engines_moves_the_bytes(tiny_model_dir, kind):
    prompt = random_prompts([45], seed=9)[0]
    p = _core(tiny_model_dir, kind, kv_cache_dtype="fp8")
    d = _core(tiny_model_dir, kind, kv_cache_dtype="fp8")
    try:
        r = d.exchange.prep_recv("a", prompt, -1, None)
        assert r.kv_addr.layout.dtype == "float8_e4m3fn"
        p.remote_send("a", prompt, 0, -1, r.kv_addr)
        answered(p, "a")
        # P's pages of the prompt (now in its prefix cache) against D's received slots
        full = (len(prompt) - 1) // PAGE * PAGE
        pages = p.kv.cache.match(prompt[:full]).pages
        assert len(pages) * PAGE == full
        p_slots = torch.tensor([pg * PAGE + o for pg in pages for o in range(PAGE)])
        d_slots = slot_tensor(r.kv_addr.ranges)[:full]
        p_kv = p.runner.kv.kv.flatten(2, 3)[:, :, p_slots]
        d_kv = d.runner.kv.kv.flatten(2, 3)[:, :, d_slots]
        assert p_kv.dtype == d_kv.dtype == FP8
        assert torch.equal(p_kv.view(torch.uint8), d_kv.view(torch.uint8))
        assert p_kv.view(torch.uint8).any()
        tokens, cached = generate(d, "a", prompt, begin=len(prompt) - 1)
        assert tokens == _fp8_hf_greedy(tiny_model_dir, [prompt], len(tokens))[0]
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_an_fp8_engine_and_a_32_bit_one_refuse_to_exchange_kv(tiny_model_dir):
    prompt = random_prompts([20], seed=2)[0]
    p = _core(tiny_model_dir, "shm")
    d = _core(tiny_model_dir, "shm", kv_cache_dtype="fp8")
    try:
        r = d.exchange.prep_recv("m", prompt, -1, None)
        with pytest.raises(MicroservingError, match="KV layout mismatch in dtype") as e:
            p.remote_send("m", prompt, 0, -1, r.kv_addr)
        assert "'dtype': 'float32'" in str(e.value)
        assert "'dtype': 'float8_e4m3fn'" in str(e.value)
        assert e.value.status == 400
        d.abort_request("m")
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


# ---- settings -------------------------------------------------------------------------------

def test_bad_kv_cache_dtypes_are_refused(monkeypatch, tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3; "
                                         "got 'fp8_e5m2'"):
        EngineConfig(model="/unused", kv_cache_dtype="fp8_e5m2")
    assert EngineConfig(model="/unused", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    from engine.models import fp8

    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8 needs a GPU of compute capability "
                                         r"8.9 or later .* A100 \(8.0\)"):
        fp8.check_supported(torch.device("cuda:0"), "kv_cache_dtype fp8")


def test_cli_takes_kv_cache_dtype():
    from launcher.cli import parser

    assert parser().parse_args(["engine", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser().parse_args(["engine"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser().parse_args(["engine", "--kv-cache-dtype", "int8"])


def test_round_to_fp8_is_the_stores_rounding():
    x = torch.randn(64, 2, 16) * 100
    cache = torch.zeros(4, 16, 2, 16, dtype=FP8)
    store(cache, torch.arange(64), x)
    assert torch.equal(cache.view(-1, 2, 16).float(), round_to_fp8(x))
