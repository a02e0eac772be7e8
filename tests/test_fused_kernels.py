"""Fused Triton kernels (engine/kernels/fused.py) against the torch model in llama.py.

Without CUDA the kernels run under the Triton interpreter on CPU (tiny shapes). With CUDA the
same tests run compiled on the GPU, plus the `gpu`-marked ones at Llama-3.1-8B shapes, which
also print timings against torch eager (see them with `-s`).

bf16 bounds are in ulps (units in the last place). The interpreter converts fp32 to bf16 by
truncation where the GPU rounds to nearest, so each rounding step may land one ulp off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_kernels import DEVICE, load

from engine.models.llama import RMSNorm, RotaryEmbedding
from microserve.model_config import ModelConfig

fused = load("engine.kernels.fused")
DTYPES = [torch.float32, torch.bfloat16]
FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def config(
    num_heads: int, num_kv_heads: int, head_dim: int, max_pos: int, rope_scaling=None
) -> ModelConfig:
    return ModelConfig(
        name="test", model_type="llama", vocab_size=256, hidden_size=num_heads * head_dim,
        intermediate_size=4 * num_heads * head_dim, num_layers=1, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=max_pos, tie_word_embeddings=False, bos_token_id=1,
        eos_token_ids=(2,), torch_dtype="bfloat16", rope_scaling=rope_scaling,
    )  # fmt: skip


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between a and b in bf16 steps (crossing zero counts both sides)."""

    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(actual, expected, max_ulps: int = 1, atol: float = 1e-5):
    """fp32: within 1e-5 relative; bf16: within max_ulps bf16 steps of the reference, or atol
    (a difference sum like RoPE's can cancel to ~0, where fp32 noise is many bf16 steps)."""
    assert actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, **FP32_TOL)
    else:
        ulps = bf16_ulps(actual, expected)
        close = (actual.float() - expected.float()).abs() <= atol
        worst = int(torch.where(close, 0, ulps).max())
        assert worst <= max_ulps, f"{worst} bf16 ulps apart (allowed {max_ulps})"


def norm_module(hidden: int, dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    return norm.to(DEVICE, dtype)


# RMSNorm output is rounded twice (normalized row, then times weight): one ulp each, and an ulp
# of the first can be two of the product.
RMS_ULPS = 3


# ---------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 16384 + 40])  # pow2, SmolLM2, two-pass loop
def test_rms_norm_matches_llama(dtype, hidden):
    torch.manual_seed(0)
    norm = norm_module(hidden, dtype)
    x = torch.randn(3, hidden, device=DEVICE, dtype=dtype) * 3
    out = fused.rms_norm(x, norm.weight, norm.eps)
    with torch.no_grad():
        assert_matches(out, norm(x), RMS_ULPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows_and_in_place(dtype):
    torch.manual_seed(0)
    norm = norm_module(96, dtype)
    wide = torch.randn(4, 160, device=DEVICE, dtype=dtype)
    x = wide[:, 32:128]  # row stride 160
    with torch.no_grad():
        expected = norm(x)
    out = torch.empty(4, 96, device=DEVICE, dtype=dtype)
    assert fused.rms_norm(x, norm.weight, norm.eps, out) is out
    assert_matches(out, expected, RMS_ULPS)
    before = wide.clone()
    fused.rms_norm(x, norm.weight, norm.eps, out=x)
    assert_matches(x, expected, RMS_ULPS)
    assert torch.equal(wide[:, :32], before[:, :32]) and torch.equal(wide[:, 128:], before[:, 128:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 16384 + 40])
def test_fused_add_rms_norm_matches_llama(dtype, hidden):
    torch.manual_seed(0)
    norm = norm_module(hidden, dtype)
    x = torch.randn(3, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(3, hidden, device=DEVICE, dtype=dtype) * 4
    summed = x + residual  # the decoder layer's `x = x + self_attn(...)`
    fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert_matches(residual, summed, 1)
    with torch.no_grad():  # the norm of the sum as stored (on the GPU it equals `summed`)
        assert_matches(x, norm(residual), RMS_ULPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 16384 + 40])
def test_fused_add_rms_norm_adds_the_other_ranks_partial_as_an_all_reduce_would(dtype, hidden):
    """With `peer` (engine/tp/exchange.py: the other rank's partial sum), the kernel gives
    exactly what it gives for the sum x + peer computed first (rounded to the dtype, as the
    all-reduce's add rounds), on both ranks: x and peer swapped give the same bits."""
    torch.manual_seed(0)
    norm = norm_module(hidden, dtype)
    ours = torch.randn(3, hidden, device=DEVICE, dtype=dtype)
    theirs = torch.randn(3, hidden, device=DEVICE, dtype=dtype)
    residual = torch.randn(3, hidden, device=DEVICE, dtype=dtype) * 4
    summed, summed_residual = ours + theirs, residual.clone()
    fused.fused_add_rms_norm(summed, summed_residual, norm.weight, norm.eps)
    results = []
    for x, peer in ((ours.clone(), theirs), (theirs.clone(), ours)):  # rank 0, rank 1
        res = residual.clone()
        fused.fused_add_rms_norm(x, res, norm.weight, norm.eps, peer=peer)
        results.append((x, res))
    (x0, res0), (x1, res1) = results
    assert torch.equal(x0, x1) and torch.equal(res0, res1)
    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates the add's
        assert_matches(res0, summed_residual, 2, atol=0.07)  # where torch rounds to nearest
    else:
        assert torch.equal(res0, summed_residual) and torch.equal(x0, summed)
    with pytest.raises(ValueError, match="peer"):
        fused.fused_add_rms_norm(ours, residual, norm.weight, norm.eps, peer=theirs[:2])


def test_rms_norm_rejects_bad_input():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        fused.rms_norm(x.t().contiguous().t(), torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused.fused_add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-5)


# ---------------------------------------------------------------------------------------------
# RoPE + KV-cache write


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """The views LlamaAttention.forward makes of its fused projection."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(-1, num_heads, head_dim),
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
    )


def run_rope_case(cfg: ModelConfig, positions, slots, dtype, num_pages, page_size):
    """Run the kernel on views of one qkv tensor; return (kernel results, references, caches)."""
    h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rotary = RotaryEmbedding(cfg).to(DEVICE)
    positions = torch.tensor(positions, device=DEVICE)
    slot_mapping = torch.tensor(slots, device=DEVICE)
    qkv = torch.randn(len(positions), (h + 2 * kv) * d, device=DEVICE, dtype=dtype)
    q, k, v = split_qkv(qkv, h, kv, d)
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    cache_shape = (num_pages, page_size, kv, d)
    k_cache = torch.full(cache_shape, 7.0, device=DEVICE, dtype=dtype)
    v_cache = torch.full(cache_shape, 7.0, device=DEVICE, dtype=dtype)
    fused.rope_and_store_kv(q, k, v, positions, rotary.cos_sin, k_cache, v_cache, slot_mapping)
    # the kernel's contract: rotation in fp32, one cast; for fp32 this is llama.py exactly
    q32, k32 = rotary(positions, q_in.float(), k_in.float())
    q_llama, k_llama = rotary(positions, q_in, k_in)
    return dict(
        q=q, k=k, v=v, v_in=v_in, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
        rotary=rotary, positions=positions, q_ref=q32.to(dtype), k_ref=k32.to(dtype), q_llama=q_llama, k_llama=k_llama,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64)]  # tiny; SmolLM2 (non-pow2 heads)
)
def test_rope_and_store_kv_matches_llama(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256)  # fmt: skip
    cfg = config(heads, kv_heads, head_dim, max_pos=1024, rope_scaling=scaling)
    positions = [0, 1, 7, 1000]
    slots = [5, 0, 31, 17]  # out of order, across pages of 8
    r = run_rope_case(cfg, positions, slots, dtype, num_pages=4, page_size=8)

    assert_matches(r["q"], r["q_ref"])
    assert_matches(r["k"], r["k_ref"])
    assert torch.equal(r["v"], r["v_in"])  # v is read only
    if dtype == torch.bfloat16:  # llama.py rounds cos/sin and each product to bf16
        scale = max(r["q_ref"].abs().max(), r["k_ref"].abs().max()).item()
        torch.testing.assert_close(r["q"], r["q_llama"], rtol=2e-2, atol=2**-6 * scale)
        torch.testing.assert_close(r["k"], r["k_llama"], rtol=2e-2, atol=2**-6 * scale)

    k_slots = r["k_cache"].view(-1, kv_heads, head_dim)
    v_slots = r["v_cache"].view(-1, kv_heads, head_dim)
    assert torch.equal(k_slots[slots], r["k"])  # the cache holds exactly the rotated k
    assert torch.equal(v_slots[slots], r["v_in"])
    untouched = torch.ones(k_slots.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert (k_slots[untouched] == 7).all() and (v_slots[untouched] == 7).all()


def test_rope_and_store_kv_skips_negative_slots():
    torch.manual_seed(0)
    cfg = config(4, 2, 16, max_pos=64)
    slots = [3, -1, 9, -1]  # rows 1 and 3: CUDA-graph padding
    r = run_rope_case(cfg, [4, 0, 5, 0], slots, torch.float32, num_pages=2, page_size=8)
    assert_matches(r["q"], r["q_ref"])  # padding rows are still rotated (harmlessly)
    assert_matches(r["k"], r["k_ref"])
    k_slots = r["k_cache"].view(-1, 2, 16)
    v_slots = r["v_cache"].view(-1, 2, 16)
    assert torch.equal(k_slots[[3, 9]], r["k"][[0, 2]])
    assert torch.equal(v_slots[[3, 9]], r["v_in"][[0, 2]])
    others = [s for s in range(16) if s not in (3, 9)]
    assert (k_slots[others] == 7).all() and (v_slots[others] == 7).all()


def test_rope_and_store_kv_int32_indices():
    """int32 positions and slots (what a runner may keep in its buffers) give the same result."""
    torch.manual_seed(0)
    cfg = config(4, 2, 16, max_pos=64)
    cos_sin = RotaryEmbedding(cfg).to(DEVICE).cos_sin
    qkv = torch.randn(3, 8 * 16, device=DEVICE)
    results = []
    for index_dtype in (torch.int64, torch.int32):
        q, k, v = split_qkv(qkv.clone(), 4, 2, 16)
        k_cache, v_cache = torch.zeros(2, 1, 4, 2, 16, device=DEVICE).unbind(0)
        positions = torch.tensor([0, 9, 63], dtype=index_dtype, device=DEVICE)
        slots = torch.tensor([2, -1, 0], dtype=index_dtype, device=DEVICE)
        fused.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        results.append((q, k, k_cache, v_cache))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[0][2].abs().sum() > 0


def test_rope_rejects_bad_input():
    cfg = config(4, 2, 16, max_pos=64)
    cos_sin = RotaryEmbedding(cfg).to(DEVICE).cos_sin
    q, k, v = (torch.zeros(2, n, 16, device=DEVICE) for n in (4, 2, 2))
    cache = torch.zeros(1, 4, 2, 16, device=DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin"):
        fused.rope_and_store_kv(q, k, v, pos, cos_sin[:, :, :8], cache, cache, pos)
    with pytest.raises(ValueError, match="k_cache"):
        fused.rope_and_store_kv(q, k, v, pos, cos_sin, cache[:, :, :1], cache, pos)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused.rope_and_store_kv(q, k, v, pos, cos_sin, cache, cache, pos[:1])


# ---------------------------------------------------------------------------------------------
# SiLU and mul


def silu_mul_refs(x: torch.Tensor):
    gate, up = x.chunk(2, dim=-1)  # LlamaMLP.forward
    fp32 = (F.silu(gate.float()) * up.float()).to(x.dtype)
    return fp32, F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [40, 2500])  # one partial block; three blocks
def test_silu_and_mul_matches_llama(dtype, intermediate):
    torch.manual_seed(0)
    x = torch.randn(3, 2 * intermediate, device=DEVICE, dtype=dtype) * 3
    out = torch.empty(3, intermediate, device=DEVICE, dtype=dtype)
    assert fused.silu_and_mul(x, out) is out
    expected_fp32, expected_llama = silu_mul_refs(x)
    assert_matches(out, expected_fp32)
    if dtype == torch.bfloat16:  # llama.py rounds silu(gate) to bf16 before the product
        assert_matches(out, expected_llama, max_ulps=2)


def test_silu_and_mul_strided_rows():
    torch.manual_seed(0)
    wide = torch.randn(4, 100, device=DEVICE)
    x = wide[:, 10:90]  # [4, 2 * 40], row stride 100
    out_wide = torch.zeros(4, 50, device=DEVICE)
    out = out_wide[:, 5:45]
    fused.silu_and_mul(x, out)
    assert_matches(out, silu_mul_refs(x)[0])
    assert (out_wide[:, :5] == 0).all() and (out_wide[:, 45:] == 0).all()


def test_silu_and_mul_rejects_bad_out():
    with pytest.raises(ValueError, match="out"):
        fused.silu_and_mul(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B shapes, CUDA graphs, timings

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
LLAMA_8B_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)  # fmt: skip


def cuda_time_us(fn, iters: int = 50) -> float:
    """Mean time of fn() in microseconds, by CUDA events around `iters` back-to-back calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def report(name: str, tokens: int, kernel_us: float, eager_us: float) -> None:
    print(
        f"\n{name:>20} T={tokens:<5} triton {kernel_us:8.1f} us   torch eager {eager_us:8.1f} us"
        f"   ({eager_us / kernel_us:.2f}x)"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 8192])
def test_gpu_rms_norm_llama8b(tokens):
    torch.manual_seed(0)
    hidden = LLAMA_8B["hidden"]
    norm = norm_module(hidden, torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) * 4
    out = torch.empty_like(x)
    with torch.no_grad():
        assert_matches(fused.rms_norm(x, norm.weight, norm.eps, out), norm(x), RMS_ULPS)
        summed = x + residual
        x2, res2 = x.clone(), residual.clone()
        fused.fused_add_rms_norm(x2, res2, norm.weight, norm.eps)
        assert torch.equal(res2, summed)  # one bf16 rounding of the fp32 sum, as eager
        assert_matches(x2, norm(summed), RMS_ULPS)

        report("rms_norm", tokens, cuda_time_us(lambda: fused.rms_norm(x, norm.weight, 1e-5, out)),
               cuda_time_us(lambda: norm(x)))  # fmt: skip
        # timing repeats the in-place update: values grow, the work per call does not
        report("fused_add_rms_norm", tokens,
               cuda_time_us(lambda: fused.fused_add_rms_norm(x2, res2, norm.weight, 1e-5)),
               cuda_time_us(lambda: norm(x + residual)))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 8192])
def test_gpu_rope_and_store_kv_llama8b(tokens):
    torch.manual_seed(0)
    h, kv, d = LLAMA_8B["heads"], LLAMA_8B["kv_heads"], LLAMA_8B["head_dim"]
    cfg = config(h, kv, d, max_pos=131072, rope_scaling=LLAMA_8B_ROPE)
    page_size = 16
    num_pages = 2 * tokens // page_size + 2
    positions = torch.randint(0, 131072, (tokens,)).tolist()
    positions[:4] = [0, 1, 7, 1000][:tokens]
    slots = torch.randperm(num_pages * page_size)[:tokens]
    slots[1::7] = -1  # some padding rows
    slots = slots.tolist()
    r = run_rope_case(cfg, positions, slots, torch.bfloat16, num_pages, page_size)
    assert_matches(r["q"], r["q_ref"])
    assert_matches(r["k"], r["k_ref"])
    scale = max(r["q_ref"].abs().max(), r["k_ref"].abs().max()).item()
    torch.testing.assert_close(r["q"], r["q_llama"], rtol=2e-2, atol=2**-6 * scale)
    stored = [t for t, s in enumerate(slots) if s >= 0]
    stored_slots = [slots[t] for t in stored]
    assert torch.equal(r["k_cache"].view(-1, kv, d)[stored_slots], r["k"][stored])
    assert torch.equal(r["v_cache"].view(-1, kv, d)[stored_slots], r["v_in"][stored])

    # timing: the kernel on the qkv views vs eager RoPE (llama.py) + two index_copy_ into the cache
    rotary, pos_t = r["rotary"], r["positions"]
    q, k, v = r["q"], r["k"], r["v"]
    k_cache, v_cache, slot_mapping = r["k_cache"], r["v_cache"], r["slot_mapping"]
    valid = torch.tensor(stored_slots, device="cuda")
    valid_rows = torch.tensor(stored, device="cuda")

    def eager():
        q2, k2 = rotary(pos_t, q, k)
        k_cache.view(-1, kv, d).index_copy_(0, valid, k2[valid_rows])
        v_cache.view(-1, kv, d).index_copy_(0, valid, v[valid_rows])
        return q2

    kernel = lambda: fused.rope_and_store_kv(  # noqa: E731
        q, k, v, pos_t, rotary.cos_sin, k_cache, v_cache, slot_mapping
    )
    report("rope_and_store_kv", tokens, cuda_time_us(kernel), cuda_time_us(eager))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 128, 8192])
def test_gpu_silu_and_mul_llama8b(tokens):
    torch.manual_seed(0)
    inter = LLAMA_8B["intermediate"]
    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
    out = torch.empty(tokens, inter, device="cuda", dtype=torch.bfloat16)
    fused.silu_and_mul(x, out)
    expected_fp32, expected_llama = silu_mul_refs(x)
    assert_matches(out, expected_fp32)
    assert_matches(out, expected_llama, max_ulps=2)
    gate, up = x.chunk(2, dim=-1)
    report("silu_and_mul", tokens, cuda_time_us(lambda: fused.silu_and_mul(x, out)),
           cuda_time_us(lambda: F.silu(gate) * up))  # fmt: skip


@pytest.mark.gpu
def test_gpu_kernels_replay_in_cuda_graph():
    """Captured once, replayed after the static inputs change: results follow the new inputs."""
    torch.manual_seed(0)
    tokens, hidden, inter = 8, 256, 512
    h, kv, d = 4, 2, 64
    cfg = config(h, kv, d, max_pos=2048)
    rotary = RotaryEmbedding(cfg).to("cuda")
    norm = norm_module(hidden, torch.bfloat16)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, residual = torch.empty(tokens, hidden, **bf16), torch.empty(tokens, hidden, **bf16)
    qkv = torch.empty(tokens, (h + 2 * kv) * d, **bf16)
    gate_up, act = torch.empty(tokens, 2 * inter, **bf16), torch.empty(tokens, inter, **bf16)
    positions = torch.zeros(tokens, dtype=torch.long, device="cuda")
    slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device="cuda")
    k_cache, v_cache = torch.zeros(4, 16, kv, d, **bf16), torch.zeros(4, 16, kv, d, **bf16)
    q, k, v = split_qkv(qkv, h, kv, d)

    def step():
        fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
        fused.rope_and_store_kv(q, k, v, positions, rotary.cos_sin, k_cache, v_cache,
                                slot_mapping)  # fmt: skip
        fused.silu_and_mul(gate_up, act)

    def fill():
        for t in (x, residual, qkv, gate_up):
            t.copy_(torch.randn_like(t))
        positions.copy_(torch.randint(0, 2048, (tokens,), device="cuda"))
        slot_mapping.copy_(torch.randperm(64, device="cuda")[:tokens])
        slot_mapping[-2:] = -1

    fill()
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        fill()
        inputs = [t.clone() for t in (x, residual, qkv, gate_up)]
        k_cache.zero_()
        v_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        x_in, res_in, qkv_in, gate_up_in = inputs
        with torch.no_grad():
            assert_matches(x, norm(x_in + res_in), RMS_ULPS)
        q_in, k_in, v_in = split_qkv(qkv_in, h, kv, d)
        q32, k32 = rotary(positions, q_in.float(), k_in.float())
        assert_matches(q, q32.to(torch.bfloat16))
        live = slot_mapping[:-2]
        assert torch.equal(k_cache.view(-1, kv, d)[live], k[:-2])
        assert torch.equal(v_cache.view(-1, kv, d)[live], v_in[:-2])
        assert_matches(act, silu_mul_refs(gate_up_in)[0])
