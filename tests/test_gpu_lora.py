"""LoRA on the GPU with the compiled segmented kernels (engine/lora/kernels.py): the tiny model
in float32 with CUDA graphs gives PEFT's greedy tokens for the base and two adapters mixed in
steps, and for one adapter request alone (batch-1 decode's fused GEMV path); in bfloat16 at
Llama-3.1-8B's shapes the kernels' deltas equal a float32 torch reference within bf16's
rounding, for one token (decode) and for tiles over many, in each of the kernels' three forms.
The CPU runs the same kernels under the Triton interpreter only in float32
(tests/test_lora_triton_cpu.py): its bfloat16 is not a float."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from test_lora import adapters, lora_dir, prompts, reference, run  # noqa: E402,F401

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402

pytestmark = pytest.mark.gpu


def _core(tiny_model_dir, lora_dir):  # noqa: F811 (test_lora's fixture names)
    return EngineCore(EngineConfig(
        model=tiny_model_dir, device="cuda", dtype="float32", page_size=16, num_pages=256,
        max_num_seqs=8, lora_modules=(("a1", str(lora_dir / "a1")),
                                      ("a2", str(lora_dir / "a2")))))


def test_fp32_adapters_mixed_and_alone_equal_peft_with_graphs(
        tiny_model_dir, lora_dir, prompts, reference):  # noqa: F811
    core = _core(tiny_model_dir, lora_dir)
    try:
        assert core.runner.graphs is not None and core.runner.lora.batch.use_triton
        mixed = {f"{name}-{i}": (p, name) for i, p in enumerate(prompts)
                 for name in (None, "a1", "a2")}
        got = run(core, mixed)
        assert got == {f"{name}-{i}": reference[name][i] for i in range(len(prompts))
                       for name in (None, "a1", "a2")}
        for name in ("a1", "a2"):  # alone: batch-1 decode steps, the fused GEMV kernels
            assert run(core, {"solo": (prompts[1], name)}) == {"solo": reference[name][1]}
    finally:
        core.close()


# Llama-3.1-8B's fused projections: (K, slices of the output), rank 16
_SHAPES = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]),
           "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}


@pytest.mark.parametrize("tokens", [1, 7, 70])
@pytest.mark.parametrize("proj,form", [("qkv", "norm"), ("o", "plain"), ("gate_up", "norm"),
                                       ("down", "gated"), ("qkv", "plain")])
def test_bf16_kernel_deltas_at_8b_shapes_equal_a_float32_reference(proj, form, tokens):
    from engine.lora.layers import LoraBatch, LoraLinear, _input

    k, slices = _SHAPES[proj]
    rank, device = 16, torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    # tokens over slots 1 and 3 and the base, interleaved
    slots = [[1, -1, 3][i % 3] for i in range(tokens)] if tokens > 1 else [3]
    batch = LoraBatch(max_loras=4, max_tokens=128, device=device)
    batch.use_triton = True
    base = torch.nn.Linear(k, sum(slices), bias=False, dtype=torch.bfloat16, device=device)
    proj_ = LoraLinear(base, batch, slices, rank)
    for slot in (1, 3):
        proj_.write_slot(slot, proj_.pack([
            (torch.randn(rank, k, generator=gen, device=device) / k ** 0.5,
             torch.randn(n, rank, generator=gen, device=device)) for n in slices], scale=2.0))
    width = 2 * k if form == "gated" else k
    x = torch.randn(tokens, width, generator=gen, device=device).to(torch.bfloat16)
    norm = ((torch.rand(k, generator=gen, device=device) + 0.5).to(torch.bfloat16), 1e-5) \
        if form == "norm" else None
    batch.set_slots(slots)
    out = torch.zeros(tokens, sum(slices), dtype=torch.bfloat16, device=device)
    proj_.add_delta(x, out, norm=norm, gated=form == "gated")
    torch.cuda.synchronize()
    # the reference: the engine's own input form (bf16, as the base projection sees it), then
    # float32 products of the bf16 slot weights
    inputs = _input(x, norm, form == "gated").float()
    want = torch.zeros(tokens, sum(slices), device=device)
    offsets = proj_.offsets
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        h = inputs[t] @ proj_.a[slot].float().t()
        for s in range(len(slices)):
            lo, hi = offsets[s], offsets[s + 1]
            want[t, lo:hi] = h[s * rank:(s + 1) * rank] @ proj_.b[slot, lo:hi].float().t()
    scale = want.abs().max()
    assert scale > 1
    base_rows = [t for t, slot in enumerate(slots) if slot < 0]
    assert not out[base_rows].any()  # base tokens: nothing added
    assert ((out.float() - want).abs().max() / scale) < 2e-2
