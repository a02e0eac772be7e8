"""What `--quantization fp8` and `--kv-cache-dtype fp8` cost in quality: a model's perplexity on
a text, and how often its next-token choice stays the same, with its projections, its KV cache,
or both in fp8 against as they were (CPU).

    python -m bench.fp8_quality [--model smollm2-135m-instruct] [--text FILE] [--tokens 4096]

The fp8 model is Hugging Face's with each decoder projection computing the engine's W8A8
arithmetic (`hf_fp8_projections`: per-channel e4m3 weights, per-token e4m3 activations, as
engine/models/fp8.py) and with attention reading K and V rounded to e4m3 (`hf_fp8_kv`), so
the figures are the quantization's, not an implementation's. The text
is cut into windows of `--window` tokens, each scored on its own. The default text is the
LLM microserving paper shipped with the design notes, if present, else this repository's
README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch

from engine.models.fp8 import FP8, FP8_MAX, quantize_rows
from microserve.model_files import resolve_model


@contextlib.contextmanager
def hf_fp8_projections(model, quantize_weight=quantize_rows):
    """Within the block, every q/k/v/o/gate/up/down projection of a Hugging Face Llama computes
    (x8 s_x)(W8 s_w)^T in fp32, as the engine's fp8 path does; `quantize_weight(W) -> (W8,
    s_w [N, 1] or a scalar)` (default: per output channel, as `--quantization fp8`)."""
    patched = []
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                     layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                     layer.mlp.down_proj):  # fmt: skip
            w8, ws = quantize_weight(proj.weight)
            dequant = w8.float() * ws

            def forward(x, dequant=dequant):
                x8, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
                return ((x8.float() * sx) @ dequant.t()).view(*x.shape[:-1], -1).to(x.dtype)

            proj.forward = forward
            patched.append(proj)
    try:
        yield model
    finally:
        for proj in patched:
            del proj.forward


def round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x through an fp8 KV cache (`--kv-cache-dtype fp8`): e4m3 with scale 1, saturated at
    +-448, back in x's dtype (engine/attention/torch_backend.py `store`)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype)


@contextlib.contextmanager
def hf_fp8_kv(model):
    """A Hugging Face Llama whose attention reads its keys (after RoPE) and values as an fp8
    KV cache holds them: its SDPA attention with K and V rounded to e4m3 first. Rounding is
    idempotent, so rounding the whole cache at each step equals storing each token rounded."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, round_to_fp8(key), round_to_fp8(value),
                                      *args, **kwargs)  # fmt: skip

    AttentionInterface.register("microserve_fp8_kv", attention)
    before = model.config._attn_implementation
    model.set_attn_implementation("microserve_fp8_kv")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def _default_text() -> Path:
    paper = Path(__file__).resolve().parents[2] / "shared/seeds/002_b20dd62cb4e4e59a.txt"
    return paper if paper.is_file() else Path(__file__).resolve().parents[1] / "README.md"


@torch.no_grad()
def score(model, ids: torch.Tensor, window: int) -> tuple[float, torch.Tensor]:
    """(mean negative log-likelihood per predicted token, the argmax predictions)."""
    nll, count, preds = 0.0, 0, []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        logits = model(chunk[None, :-1]).logits[0].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
        preds.append(logits.argmax(-1))
    return nll / count, torch.cat(preds)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    text = Path(args.text) if args.text else _default_text()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(tokenizer(text.read_text())["input_ids"][: args.tokens + 1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t = time.perf_counter()
    nll, preds = score(model, ids, args.window)
    result = {"model": str(args.model or "smollm2-135m-instruct"), "text": text.name,
              "tokens": len(ids) - 1, "window": args.window, "date": time.strftime("%Y-%m-%d"),
              "perplexity": math.exp(nll)}  # fmt: skip
    variants = {  # suffix: what is in fp8
        "": [hf_fp8_projections],  # --quantization fp8 (the keys of the first record)
        "_kv": [hf_fp8_kv],  # --kv-cache-dtype fp8
        "_both": [hf_fp8_projections, hf_fp8_kv],
    }
    for suffix, patches in variants.items():
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch(model))
            nll8, preds8 = score(model, ids, args.window)
        result[f"perplexity_fp8{suffix}"] = math.exp(nll8)
        result[f"perplexity_change{suffix}"] = math.exp(nll8) / math.exp(nll) - 1
        result[f"same_next_token{suffix}"] = (preds == preds8).float().mean().item()
    result["seconds"] = time.perf_counter() - t
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
