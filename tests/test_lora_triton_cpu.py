"""LoRA adapters on the GPU's code path, run on CPU under the Triton interpreter: the Triton
attention backend and fused kernels, and the forward pass cut into CUDA-graph pieces (launched
one by one here; engine/cuda_graphs.py), every step padded to a bucket. The slot weights and
the per-token mask are the static buffers the pieces read; a padded row must add nothing.
Tokens equal PEFT's for the base and an adapter mixed in each step."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.is_available():
    pytest.skip("the GPU runs this path compiled", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from lora_adapters import peft_greedy, write_adapter  # noqa: E402
from test_engine_core import random_prompts  # noqa: E402
from test_lora import run  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402


# Decode steps after the prompts' chunks: each one runs every kernel under the interpreter,
# and the mixed and padded steps this checks come early (test_lora.py decodes N_NEW).
PIECEWISE_NEW = 6


@pytest.mark.slow  # the Triton interpreter: ~30-120 s here
def test_piecewise_forward_with_adapters_equals_peft(tiny_model_dir, tmp_path):
    from engine.cuda_graphs import PiecewiseGraphs

    model = write_adapter(tiny_model_dir, tmp_path / "a1", rank=8, seed=1)
    prompts = random_prompts([9, 30], seed=5)
    want = {None: peft_greedy(model, prompts, PIECEWISE_NEW, base=True),
            "a1": peft_greedy(model, prompts, PIECEWISE_NEW)}
    core = EngineCore(EngineConfig(model=tiny_model_dir, attention_backend="triton", page_size=4,
                                   num_pages=64, max_num_batched_tokens=24, max_num_seqs=4,
                                   lora_modules=(("a1", str(tmp_path / "a1")),)))
    runner = core.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv, runner.kv.backend, 24, use_graphs=False)
    padded = []
    run_pieces = pieces.run

    def counted(batch, input_ids, fill=None, mark_layers_left=0):
        padded.append(len(input_ids) not in pieces.buckets)
        return run_pieces(batch, input_ids, fill, mark_layers_left)

    def eager(*args):
        raise AssertionError("a step ran eagerly")

    pieces.run = counted
    runner.pieces, runner._forward_eager = pieces, eager
    requests = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts) for name in (None, "a1")}
    tokens = run(core, {rid: r for rid, r in requests.items()}, PIECEWISE_NEW)
    assert tokens == {f"{name}-{i}": want[name][i] for i in range(2) for name in (None, "a1")}
    assert any(padded)


class _QueryAsOutput:
    """Attention stand-in for one layer: returns q (what attention computes is not the point
    here, only that both paths feed it the same q, k, v)."""

    def attention(self, layer_idx, q, k, v, positions, cos_sin, qkv_delta=None):
        if qkv_delta is not None:  # an Attention that does not fuse the adapter's delta
            qkv_delta.add()
        return q


@pytest.mark.slow  # the Triton interpreter
def test_batch1_gemv_layer_adds_the_adapters_delta(tiny_model_dir):
    """Batch-1 decode's fused GEMV kernels (norm inside the projection) add each projection's
    adapter delta as the batched path does: one layer, a random rank-8 adapter. float32: the
    Triton interpreter multiplies bfloat16 tiles as 16-bit integers (numpy has no bfloat16),
    so in bfloat16 both paths gave garbage here and agreed only by chance (the GPU's bf16 is
    checked against PEFT in tests/test_gpu_lora.py)."""
    from engine.lora.adapter import AdapterWeights, module_shapes
    from engine.lora.layers import LoraModel
    from engine.models.loader import load_model

    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    lora = LoraModel(model, config, max_loras=2, max_rank=8, max_tokens=4)
    lora.use_triton_kernels(True)
    gen = torch.Generator().manual_seed(0)
    weights = {(0, m): (torch.randn(8, d_in, generator=gen) * 0.3,
                        torch.randn(d_out, 8, generator=gen) * 0.3)
               for m, (d_in, d_out) in module_shapes(config).items()}
    lora.write_slot(1, lora.pack(AdapterWeights("a", "/a", 8, 1.0, weights)))
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    x = torch.randn(1, config.hidden_size, generator=gen)
    residual = torch.randn(1, config.hidden_size, generator=gen)
    positions = torch.tensor([3])

    def forward(one_row: bool, slot: int):
        lora.batch.set_slots([slot])
        layer.use_gemv = one_row
        out, summed = layer(x.clone(), residual.clone(), positions, rotary, _QueryAsOutput())
        return out.float(), summed.float()

    batched, gemv = forward(False, 1), forward(True, 1)
    base = forward(False, -1)[0]
    tolerance = 1e-4 * batched[0].abs().max()  # summed in other orders
    for got, want in zip(gemv, batched):  # the MLP's output, and the residual stream
        assert (got - want).abs().max() < tolerance
    assert (batched[0] - base).abs().max() > 10 * tolerance, "the adapter changed nothing"
    # a base token in a CUDA graph that holds the kernels (slot -1 in the table): nothing added
    with lora.batch.capturing():
        for one_row in (True, False):
            got = forward(one_row, -1)[0]
            assert (got - base).abs().max() < tolerance


def _masked_delta(x, a, b, offsets, slots, rank):
    """The dense form the segmented kernels replace: every slot for every token, a one-hot
    mask keeping each token's own (base tokens: zero)."""
    loras = a.shape[0]
    mask = (torch.tensor(slots)[:, None] == torch.arange(loras)[None, :]).to(x.dtype)
    mid = torch.einsum("tk,lnk->tln", x, a) * mask[:, :, None]  # [T, L, S*R]
    out = torch.zeros(x.shape[0], offsets[-1], dtype=x.dtype)
    for s in range(len(offsets) - 1):
        lo, hi = offsets[s], offsets[s + 1]
        out[:, lo:hi] = torch.einsum("tlr,lnr->tn", mid[:, :, s * rank : (s + 1) * rank],
                                     b[:, lo:hi])
    return out


@pytest.mark.parametrize("tokens", [40, 7, "40-col-blocks"],
                         ids=["segmented", "bgmv", "segmented-col-blocks"])
@pytest.mark.parametrize("form", ["plain", "norm", "gated"])
def test_segmented_kernels_equal_torch_path_and_masked_form(form, tokens, monkeypatch):
    """Random fp32 inputs, 40 tokens over 3 of 4 slots and the base, interleaved (slot 2's
    group spans two tiles), a fused projection of three uneven slices: the Triton kernels,
    the torch loop over groups and the dense masked form give the same deltas. 7 tokens: the
    same through the per-token (BGMV) kernels of few-token steps. col-blocks: each expand
    program covers every column block (the last one partial, and blocks past the output)."""
    from engine.lora import kernels
    from engine.lora.layers import LoraBatch, LoraLinear, _input

    if tokens == "40-col-blocks":
        tokens = 40
        monkeypatch.setattr(kernels, "_EXPAND_PROGRAMS", 1)
        assert kernels._col_blocks(kernels.max_tiles(tokens, 4), 2) == 8

    gen = torch.Generator().manual_seed(0)
    k, slices, rank = 320, [48, 16, 32], 8  # K over two splits, not a multiple of 64
    slots = [2 if i % 3 else (-1 if i % 2 else [0, 3][i % 4 == 0]) for i in range(tokens)]
    width = 2 * k if form == "gated" else k
    x = torch.randn(len(slots), width, generator=gen)
    norm = (torch.rand(k, generator=gen) + 0.5, 1e-5) if form == "norm" else None
    results = {}
    for use_triton in (True, False):
        batch = LoraBatch(max_loras=4, max_tokens=64, device=torch.device("cpu"))
        batch.use_triton = use_triton
        assert batch.slots.tolist() == [-1] * len(batch.slots)  # before any step: the base
        proj = LoraLinear(torch.nn.Linear(k, sum(slices), bias=False), batch, slices, rank)
        torch.manual_seed(1)
        for slot in (0, 2, 3):
            proj.write_slot(slot, proj.pack([(torch.randn(r, k), torch.randn(n, r))
                                             for r, n in zip((rank, 4, rank), slices)]))
        batch.set_slots(slots)
        out = torch.zeros(len(slots), sum(slices))
        proj.add_delta(x, out, norm=norm, gated=form == "gated")
        results[use_triton] = out
    masked = _masked_delta(_input(x, norm, form == "gated"), proj.a, proj.b, proj.offsets,
                           slots, rank)
    assert torch.allclose(results[False], masked, rtol=1e-4, atol=1e-3)
    assert torch.allclose(results[True], masked, rtol=1e-4, atol=1e-3)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert base_rows and not results[True][base_rows].any()
    assert results[True][[i for i, s in enumerate(slots) if s >= 0]].abs().min() > 0


@pytest.mark.parametrize("slot", [1, -1], ids=["adapter", "base"])
def test_qkv_delta_fused_into_rope_equals_expand_then_rope(slot):
    """Batch-1 decode's qkv expand inside the RoPE-and-store kernel gives what the separate
    expand kernel, then `rope_and_store_kv`, give: the qkv row (q and k rotated, v with the
    delta) and the k, v written to the cache slot, float32; nothing added for a base token."""
    from engine.kernels.fused import rope_and_store_kv
    from engine.lora.kernels import lora_expand_one_row, qkv_delta_rope_and_store_kv

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, rank, pages, page_size = 4, 2, 16, 8, 3, 4
    n_out = (heads + 2 * kv_heads) * head_dim
    bounds = [heads * head_dim, (heads + kv_heads) * head_dim]
    qkv = torch.randn(1, n_out, generator=gen)
    part = torch.randn(3 * rank, generator=gen)
    b = torch.randn(2, n_out, rank, generator=gen)
    slots = torch.tensor([slot] + [-1] * 7, dtype=torch.int32)
    positions = torch.tensor([5])
    angles = torch.randn(16, head_dim // 2, generator=gen)
    cos_sin = torch.stack([angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)], dim=1)
    slot_mapping = torch.tensor([6])
    results = []
    for fused in (True, False):
        row = qkv.clone()
        caches = [torch.zeros(pages, page_size, kv_heads, head_dim) for _ in range(2)]
        q, k, v = row.split([bounds[0], bounds[1] - bounds[0], n_out - bounds[1]], dim=-1)
        views = (q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim),
                 v.view(1, kv_heads, head_dim))
        if fused:
            qkv_delta_rope_and_store_kv(part, b, slots, *views, positions, cos_sin, *caches,
                                        slot_mapping)
        else:
            lora_expand_one_row(part, row, b, slots, bounds)
            rope_and_store_kv(*views, positions, cos_sin, *caches, slot_mapping)
        results.append((row, *caches))
    for got, want in zip(*results):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    plain = qkv.clone()
    q, k, v = plain.split([bounds[0], bounds[1] - bounds[0], n_out - bounds[1]], dim=-1)
    rope_and_store_kv(q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim),
                      v.view(1, kv_heads, head_dim), positions, cos_sin,
                      torch.zeros(pages, page_size, kv_heads, head_dim),
                      torch.zeros(pages, page_size, kv_heads, head_dim), slot_mapping)
    assert torch.equal(results[0][0], plain) == (slot < 0)
    stored = results[0][1].view(-1, kv_heads, head_dim)[6]
    assert torch.equal(stored, results[0][0][0, bounds[0]:bounds[1]].view(kv_heads, head_dim))
