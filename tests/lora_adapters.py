"""PEFT LoRA adapters for tests, written by peft itself, and PEFT's greedy output as the
reference (tests/test_lora.py, tests/test_lora_server.py)."""

from __future__ import annotations

import contextlib

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: str, path, rank: int = 8, targets=ALL_TARGETS, seed: int = 0,
                  alpha: int | None = None, rslora: bool = False, scale_b: float = 1.0):
    """Save a random adapter (A and B both non-zero: init_lora_weights=False, B times
    `scale_b`) for the model at `model_dir` with peft's save_pretrained. Returns the peft
    model, the reference for `peft_greedy`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale_b)
    model.save_pretrained(str(path))
    return model.eval()


def peft_greedy(model, prompts: list[list[int]], max_new_tokens: int,
                base: bool = False) -> list[list[int]]:
    """Greedy continuations by a peft model (`base`: with its adapter disabled), one prompt at
    a time, never stopping at eos."""
    import torch

    out = []
    with torch.no_grad(), (model.disable_adapter() if base else contextlib.nullcontext()):
        for prompt in prompts:
            step = model(input_ids=torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(max_new_tokens):
                token = int(step.logits[0, -1].argmax())
                tokens.append(token)
                step = model(input_ids=torch.tensor([[token]]),
                             past_key_values=step.past_key_values, use_cache=True)
            out.append(tokens)
    return out
