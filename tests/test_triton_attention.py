"""Triton paged attention (engine/kernels/paged_attention.py) against dense torch references.

Without CUDA the kernels run under the Triton interpreter on tiny fp32/fp16 shapes. That needs
TRITON_INTERPRET=1 before `triton.jit` decorates them (tests/triton_kernels.py sets it, and
reloads the kernel module if something imported it first). With CUDA the same tiny cases compile for the
GPU, and the `gpu` tests below run Llama-3.1-8B shapes in bf16 with timings (printed).

Caches are filled with NaN before the real tokens are written, and padded page-table entries
point at an all-NaN poison page: a kernel that reads one key past kv_len returns NaN.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from triton_kernels import DEVICE, load  # noqa: E402  (before triton is first imported)

pytest.importorskip("triton")

from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvcache.forward import ForwardBatch, SeqForward  # noqa: E402

pa = load("engine.kernels.paged_attention")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedCase:
    """Sequences given as (cached prefix, new tokens), their K/V scattered over shuffled pages."""

    def __init__(self, specs, num_heads, num_kv_heads, head_dim, page_size, dtype, seed=0,
                 kv_dtype=None):
        """kv_dtype: the caches' (default: dtype, q's); the reference reads what they hold."""
        kv_dtype = kv_dtype or dtype
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.specs, self.num_heads, self.page_size = specs, num_heads, page_size
        kv_lens = [ctx + new for ctx, new in specs]
        n_pages = [cdiv(n, page_size) for n in kv_lens]
        poison = sum(n_pages)  # the last page, never allocated
        order = torch.randperm(poison, generator=gen, device=DEVICE)
        shape = (poison + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=DEVICE)
        self.v_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=DEVICE)
        table = torch.full((len(specs), max(n_pages) + 2), poison, dtype=torch.int32)
        self.keys, self.values, first = [], [], 0
        slot_in_page = torch.arange(page_size, device=DEVICE)
        for s, (kv_len, n) in enumerate(zip(kv_lens, n_pages)):
            pages = order[first : first + n]
            first += n
            table[s, :n] = pages.cpu().to(torch.int32)
            slots = (pages[:, None] * page_size + slot_in_page).flatten()[:kv_len]
            for cache, store in ((self.k_cache, self.keys), (self.v_cache, self.values)):
                x = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen, device=DEVICE)
                cache.view(-1, num_kv_heads, head_dim)[slots] = x.to(kv_dtype)
                store.append(x.to(kv_dtype).float())
        self.page_table = table.to(DEVICE)
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
        q_lens = [new for _, new in specs]
        self.cu_seqlens = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
        self.max_q_len = max(q_lens)
        self.q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen, device=DEVICE)
        self.q = self.q.to(dtype)
        self.scale = head_dim**-0.5

    def reference(self) -> torch.Tensor:
        """fp32 causal attention per sequence over its dense K/V: [tokens, heads, head_dim]."""
        out, row = [], 0
        for (ctx, new), k, v in zip(self.specs, self.keys, self.values):
            q = self.q[row : row + new].float()
            row += new
            group = self.num_heads // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            pos = ctx + torch.arange(new, device=DEVICE)
            keep = torch.arange(ctx + new, device=DEVICE) <= pos[:, None]
            o = torch.empty_like(q)
            for h in range(0, self.num_heads, 8):  # bounds the [heads, new, kv] score tensor
                s = torch.einsum("mhd,nhd->hmn", q[:, h : h + 8], k[:, h : h + 8]) * self.scale
                p = s.masked_fill(~keep, float("-inf")).softmax(-1)
                o[:, h : h + 8] = torch.einsum("hmn,nhd->mhd", p, v[:, h : h + 8])
            out.append(o)
        return torch.cat(out)

    def decode(self, num_splits=None, **kw) -> torch.Tensor:
        out = torch.empty_like(self.q)
        return pa.paged_decode_attention(
            self.q, self.k_cache, self.v_cache, self.page_table, self.kv_lens, self.scale, out,
            num_splits=num_splits, **kw,
        )

    def extend(self, **kw) -> torch.Tensor:
        out = torch.empty_like(self.q)
        return pa.paged_extend_attention(
            self.q, self.k_cache, self.v_cache, self.page_table, self.cu_seqlens, self.kv_lens,
            self.max_q_len, self.scale, out, **kw,
        )


def assert_close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected, atol=tol, rtol=tol)


# ---- tiny shapes (interpreter on CPU) ---------------------------------------------------------

CONTEXTS = [1, 5, 16, 17, 70, 200]
TILES16 = pa.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
SHAPES = [  # heads, kv_heads, head_dim, page_size
    (4, 2, 16, 1),
    (4, 1, 32, 4),
    (4, 2, 32, 16),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_tiny(num_heads, num_kv_heads, head_dim, page_size, num_splits):
    specs = [(n - 1, 1) for n in CONTEXTS]
    case = PagedCase(specs, num_heads, num_kv_heads, head_dim, page_size, torch.float32)
    expected = case.reference()
    assert_close(case.decode(num_splits), expected, 1e-5)
    # 16-key tiles: several tiles per split and splits that end mid-page
    assert_close(case.decode(num_splits, config=TILES16), expected, 1e-5)


def test_decode_splits_from_workspace_and_fp16():
    case = PagedCase([(n - 1, 1) for n in CONTEXTS], 4, 2, 16, 4, torch.float16, seed=1)
    ws = pa.decode_workspace(len(CONTEXTS), 4, 16, 5, DEVICE)
    out = pa.paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.scale,
        torch.empty_like(case.q), ws, config=TILES16,
    )
    assert out.dtype == torch.float16
    assert_close(out, case.reference(), 2e-3)


EXTEND_SPECS = [(0, 1), (0, 5), (0, 17), (3, 1), (16, 16), (17, 5), (30, 20), (62, 3), (0, 70)]
# ctx 30 and 62: the first query row sees keys up to 30 (62), one short of the end of its key
# tile of 16 (64): that tile must go through the causal phase, not the unmasked one.


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size", SHAPES)
@pytest.mark.parametrize("config", [None, TILES16], ids=["default", "tiles16"])
def test_extend_tiny(num_heads, num_kv_heads, head_dim, page_size, config):
    case = PagedCase(EXTEND_SPECS, num_heads, num_kv_heads, head_dim, page_size, torch.float32)
    out = case.extend(config=config)
    assert_close(out, case.reference(), 1e-5)


def test_extend_decode_rows_and_fp16():
    """q_len 1 everywhere (decode through the extend kernel), in fp16."""
    case = PagedCase([(n - 1, 1) for n in CONTEXTS], 4, 2, 16, 4, torch.float16, seed=2)
    assert_close(case.extend(), case.reference(), 2e-3)


FP8 = torch.float8_e4m3fn


FP8_CASES = [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]  # out's rounding


@pytest.mark.parametrize("dtype,tol", FP8_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_an_fp8_cache(dtype, tol, num_splits):
    """--kv-cache-dtype fp8: K and V are e4m3 (scale 1); the kernel widens each tile to q's
    dtype (fp16 for a bf16 q: bf16 q values are exact in it), so the output is attention over
    exactly the values the cache holds."""
    specs = [(n - 1, 1) for n in CONTEXTS]
    case = PagedCase(specs, 4, 2, 32, 4, dtype, seed=4, kv_dtype=FP8)
    assert_close(case.decode(num_splits, config=TILES16), case.reference(), tol)


@pytest.mark.parametrize("dtype,tol", FP8_CASES)
def test_extend_reads_an_fp8_cache(dtype, tol):
    case = PagedCase(EXTEND_SPECS, 4, 2, 32, 4, dtype, seed=5, kv_dtype=FP8)
    assert_close(case.extend(), case.reference(), tol)
    assert_close(case.extend(config=TILES16), case.reference(), tol)


def test_kernels_agree_with_torch_backend():
    """A mixed step (prefill over a prefix, fresh prefill, decodes) through the torch reference
    backend, which also writes the step's K/V; the kernels then attend over that same cache."""
    ps, heads, kv_heads, dim = 4, 4, 2, 16
    seqs_spec = [(6, 9), (0, 7), (12, 1), (3, 1), (0, 1)]  # (context, new)
    gen = torch.Generator().manual_seed(3)
    kv_layer = torch.randn(2, 40, ps, kv_heads, dim, generator=gen).to(DEVICE)
    seqs, first = [], 0
    for i, (ctx, new) in enumerate(seqs_spec):
        n = cdiv(ctx + new, ps)
        seqs.append(SeqForward(f"s{i}", ctx, new, list(range(first + n - 1, first - 1, -1))))
        first += n
    batch = ForwardBatch(seqs, ps)
    q = torch.randn(batch.num_tokens, heads, dim, generator=gen).to(DEVICE)
    k = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen).to(DEVICE)
    v = torch.randn(batch.num_tokens, kv_heads, dim, generator=gen).to(DEVICE)
    positions = torch.tensor(batch.positions(), device=DEVICE)
    # an identity RoPE table (cos 1, sin 0): the kernels attend over what they are given
    cos_sin = torch.stack([torch.ones(32, dim), torch.zeros(32, dim)], dim=1).to(DEVICE)
    backend = TorchAttentionBackend(DEVICE)
    backend.plan(batch)
    expected = backend.forward(kv_layer, q.clone(), k.clone(), v, positions, cos_sin)

    width = max(len(s.page_table) for s in seqs)
    table = torch.tensor([s.page_table + [0] * (width - len(s.page_table)) for s in seqs],
                         dtype=torch.int32, device=DEVICE)
    kv_lens = torch.tensor([s.kv_len for s in seqs], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + [s.num_new_tokens for s in seqs], device=DEVICE).cumsum(0)
    out = pa.paged_extend_attention(q, kv_layer[0], kv_layer[1], table, cu.to(torch.int32),
                                    kv_lens, 9, dim**-0.5, torch.empty_like(q))
    assert_close(out, expected, 1e-5)

    decode_rows = [int(cu[i]) for i, s in enumerate(seqs) if s.num_new_tokens == 1]
    idx = [i for i, s in enumerate(seqs) if s.num_new_tokens == 1]
    out = pa.paged_decode_attention(q[decode_rows], kv_layer[0], kv_layer[1], table[idx],
                                    kv_lens[idx], dim**-0.5, torch.empty_like(q[decode_rows]),
                                    num_splits=2)
    assert_close(out, expected[decode_rows], 1e-5)


def test_choose_num_splits():
    assert pa.choose_num_splits(1, 32768, 8) == 17  # 8 programs -> 136 >= 132 SMs
    assert pa.choose_num_splits(1, 1024, 8) == 16  # no split under 64 keys
    assert pa.choose_num_splits(1, 16, 8) == 1
    assert pa.choose_num_splits(8, 4096, 8) == 3
    assert pa.choose_num_splits(64, 4096, 8) == 1


def test_tile_configs():
    assert pa.extend_config(128, 4096) == pa.TileConfig(block_n=64, num_warps=8, num_stages=3,
                                                        block_m=128, maxnreg=128)  # fmt: skip
    assert pa.extend_config(256, 4096).maxnreg is None  # capping wider heads would spill
    assert pa.extend_config(128, 9).block_m == 16
    assert pa.extend_config(128, 9).maxnreg is None
    assert pa.decode_config(256).block_n == 32
    # over an fp8 cache (measured on an H100: docs/benchmarks.md, "fp8 KV cache")
    assert pa.decode_config(128, kv_fp8=True) == pa.TileConfig(64, 2, 5)
    assert pa.extend_config(128, 4096, kv_fp8=True) == pa.TileConfig(64, 4, 3, block_m=128)
    assert pa.extend_config(128, 9, kv_fp8=True) == pa.extend_config(128, 9)
    assert pa.TileConfig(64, 4, 3).launch_options() == {"num_warps": 4, "num_stages": 3}
    capped = pa.TileConfig(64, 8, 3, block_m=64, maxnreg=128).launch_options()
    assert capped == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}


def test_rejects_bad_arguments():
    case = PagedCase([(4, 1)], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="workspace must be fp32"):
        case.decode(num_splits=2, workspace=torch.empty(1, 4, 3, 17, device=DEVICE))
    with pytest.raises(ValueError, match="k_cache and v_cache must both be q's dtype or "
                                         "float8_e4m3fn: q torch.float32, k_cache torch.float16"):
        pa.paged_decode_attention(case.q, case.k_cache.half(), case.v_cache.half(),
                                  case.page_table, case.kv_lens, case.scale,
                                  torch.empty_like(case.q))
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        pa.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.page_table,
                                  case.kv_lens.long(), case.scale, torch.empty_like(case.q))


# ---- Llama-3.1-8B shapes, bf16 (GPU) ---------------------------------------------------------

L8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
BF16_TOL = 2e-2


@pytest.fixture
def compiled():
    if type(pa._extend_kernel).__name__ == "InterpretedFunction":
        pytest.fail("TRITON_INTERPRET is set: the gpu tests need compiled kernels")


def _decode_lens(batch: int) -> list[int]:
    if batch == 1:
        return [1, 15, 16, 17, 1024, 4097, 32768]  # one sequence per case
    gen = torch.Generator().manual_seed(batch)
    fixed = [1, 15, 16, 17, 1024, 4097]
    rand = torch.randint(1, 4097, (batch - len(fixed),), generator=gen).tolist()
    return fixed + rand


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64, 128])
def test_decode_llama8b(compiled, batch):
    lens = _decode_lens(batch)
    groups = [[n] for n in lens] if batch == 1 else [lens]
    for group in groups:
        case = PagedCase([(n - 1, 1) for n in group], **L8B)
        expected = case.reference()
        for num_splits in (None, 1, 7):
            assert_close(case.decode(num_splits), expected, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [0, 100, 2048])
def test_extend_llama8b(compiled, prefix):
    case = PagedCase([(prefix, n) for n in (1, 17, 512, 4096)], **L8B)
    assert_close(case.extend(), case.reference(), BF16_TOL)
    single = PagedCase([(prefix, 17)], **L8B)
    assert_close(single.extend(), single.reference(), BF16_TOL)


# Launch configurations other than the defaults that `bench.kernel_sweep` times on a GPU:
# 64-row tiles with 4 warps, 8 warps under a 128-register cap, 128-key tiles.
ALT_EXTEND = [
    pa.TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    pa.TileConfig(block_m=64, block_n=64, num_warps=8, num_stages=3, maxnreg=128),
    pa.TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=2),
]
ALT_DECODE = [pa.TileConfig(block_n=32, num_warps=4, num_stages=3),
              pa.TileConfig(block_n=128, num_warps=4, num_stages=2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ALT_EXTEND, ids=str)
def test_extend_llama8b_tile_configs(compiled, config):
    case = PagedCase([(100, n) for n in (1, 17, 512, 1000)], **L8B, seed=6)
    assert_close(case.extend(config=config), case.reference(), BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ALT_DECODE, ids=str)
def test_decode_llama8b_tile_configs(compiled, config):
    case = PagedCase([(n - 1, 1) for n in _decode_lens(64)], **L8B, seed=7)
    expected = case.reference()
    for num_splits in (1, 3):
        assert_close(case.decode(num_splits, config=config), expected, BF16_TOL)


@pytest.mark.gpu
def test_decode_and_extend_llama8b_read_an_fp8_cache(compiled):
    case = PagedCase([(n - 1, 1) for n in _decode_lens(64)], **L8B, kv_dtype=FP8)
    expected = case.reference()
    for num_splits in (None, 1, 7):
        assert_close(case.decode(num_splits), expected, BF16_TOL)
    case = PagedCase([(100, n) for n in (1, 17, 512, 4096)], **L8B, kv_dtype=FP8)
    assert_close(case.extend(), case.reference(), BF16_TOL)


@pytest.mark.gpu
def test_extend_llama8b_decode_rows(compiled):
    case = PagedCase([(n - 1, 1) for n in (1, 17, 1024, 4097)], **L8B)
    assert_close(case.extend(), case.reference(), BF16_TOL)


@pytest.mark.gpu
def test_decode_cuda_graph_replay(compiled):
    """Capture once with fixed buffers; new lengths and page tables written in place replay
    correctly (nothing on the host read tensor values at capture)."""
    a = PagedCase([(n - 1, 1) for n in (40, 1000, 3000, 17)], **L8B, seed=4)
    b = PagedCase([(n - 1, 1) for n in (3000, 5, 16, 2500)], **L8B, seed=5)
    width = max(a.page_table.shape[1], b.page_table.shape[1])
    table = torch.zeros(4, width, dtype=torch.int32, device=DEVICE)
    q, out, kv_lens = a.q.clone(), torch.empty_like(a.q), a.kv_lens.clone()
    k_cache, v_cache = torch.cat([a.k_cache, b.k_cache]), torch.cat([a.v_cache, b.v_cache])
    ws = pa.decode_workspace(4, 32, 128, 8, DEVICE)

    def load(case, page_offset):
        table.zero_()
        table[:, : case.page_table.shape[1]] = case.page_table + page_offset
        q.copy_(case.q)
        kv_lens.copy_(case.kv_lens)

    def step():
        pa.paged_decode_attention(q, k_cache, v_cache, table, kv_lens, a.scale, out, ws)

    load(a, 0)
    step()  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case, offset in ((a, 0), (b, a.k_cache.shape[0]), (a, 0)):
        load(case, offset)
        graph.replay()
        assert_close(out, case.reference(), BF16_TOL)


def _time_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.gpu
def test_print_timings(compiled, capsys):
    """Not a speed assertion (docs/gpu.md, "Benchmarks"): prints one layer's kernel times for the lead to read."""
    lines = [f"paged attention timings, {torch.cuda.get_device_name()}, one layer:"]
    for batch, kv_dtype in ((1, None), (128, None), (128, FP8)):
        case = PagedCase([(1023, 1)] * batch, **L8B, kv_dtype=kv_dtype)
        kv_bytes_per_token = 2 * 8 * 128 * case.k_cache.element_size()
        splits = pa.choose_num_splits(batch, 1024, 8)
        ws = pa.decode_workspace(batch, 32, 128, splits, DEVICE)
        out = torch.empty_like(case.q)
        ms = _time_ms(lambda: pa.paged_decode_attention(
            case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.scale, out,
            ws, splits))
        gbs = batch * 1024 * kv_bytes_per_token / ms / 1e6
        lines.append(f"  decode batch {batch:3d} ctx 1024 splits {splits:2d} "
                     f"{str(case.k_cache.dtype)[6:]:14s}: {ms * 1e3:8.1f} us  "
                     f"{gbs:7.1f} GB/s of KV")
    flops = 8 * 4 * 32 * 128 * (4096 * 4097 // 2)  # QK^T and PV over the causal half
    for kv_dtype in (None, FP8):
        case = PagedCase([(0, 4096)] * 8, **L8B, kv_dtype=kv_dtype)
        ms = _time_ms(case.extend, iters=5)
        lines.append(f"  extend 8 x 4096 (no prefix) {str(case.k_cache.dtype)[6:]:14s}: "
                     f"{ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    dense = [torch.randn(8, 32, 4096, 128, device=DEVICE, dtype=torch.bfloat16) for _ in "qkv"]
    ms = _time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        *dense, is_causal=True), iters=5)
    lines.append(f"  torch SDPA 8 x 4096 dense, MHA:   {ms:8.3f} ms  "
                 f"{flops / ms / 1e9:7.1f} TFLOP/s (contiguous KV, for comparison)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
