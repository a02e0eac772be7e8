"""Our Llama against Hugging Face transformers: logits of packed prompts and greedy tokens.

Attention here is a test-only contiguous helper (per-sequence K/V, causal over the cached
prefix), so these tests check the model alone; the paged backends are tested against it.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from engine.models.llama import LlamaForCausalLM as OurLlama
from engine.models.llama import apply_rope
from engine.models.loader import load_model

PROMPTS = [[5, 17, 99, 3, 250], [7] * 3 + list(range(40, 48)), [201, 2, 64]]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


class ContiguousAttention:
    """Test-only attention: each sequence's K/V per layer in one growing tensor.

    Call `begin(seq_ids, num_new)` before each forward with the packed layout: the first
    num_new[0] rows belong to seq_ids[0], and so on.
    """

    def __init__(self):
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.seq_ids: list[int] = []
        self.num_new: list[int] = []

    def begin(self, seq_ids: list[int], num_new: list[int]) -> None:
        self.seq_ids, self.num_new = seq_ids, num_new

    def attention(self, layer_idx, q, k, v, positions, cos_sin):
        q, k = apply_rope(q, k, positions, cos_sin)
        outs, start = [], 0
        for seq_id, n in zip(self.seq_ids, self.num_new):
            rows = slice(start, start + n)
            old_k, old_v = self.kv.get((layer_idx, seq_id), (k[:0], v[:0]))
            keys, values = torch.cat([old_k, k[rows]]), torch.cat([old_v, v[rows]])
            self.kv[(layer_idx, seq_id)] = (keys, values)
            outs.append(_causal_attention(q[rows], keys, values))
            start += n
        return torch.cat(outs)


def _causal_attention(q, k, v):
    """q [n, H, D] are the last n of the k/v [ctx, KV, D] positions."""
    n, ctx = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def packed_prefill(model: OurLlama, attn: ContiguousAttention, prompts) -> list[torch.Tensor]:
    """One forward over all prompts packed; returns each prompt's logits [len, vocab]."""
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    attn.begin(list(range(len(prompts))), [len(p) for p in prompts])
    logits = model.compute_logits(model(input_ids, positions, attn))
    return list(logits.split([len(p) for p in prompts]))


def packed_greedy(model: OurLlama, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy decode all prompts together: one packed prefill, then one packed token each."""
    attn = ContiguousAttention()
    next_ids = [int(lg[-1].argmax()) for lg in packed_prefill(model, attn, prompts)]
    outputs = [[t] for t in next_ids]
    for step in range(max_new_tokens - 1):
        positions = torch.tensor([len(p) + step for p in prompts])
        attn.begin(list(range(len(prompts))), [1] * len(prompts))
        hidden = model(torch.tensor(next_ids), positions, attn)
        next_ids = model.compute_logits(hidden).argmax(-1).tolist()
        for out, t in zip(outputs, next_ids):
            out.append(t)
    return outputs


def tiny_hf_llama(tmp_path, tie: bool, rope_scaling=None):
    """A seeded random 2-layer GQA Llama saved as safetensors; returns (hf_model, dir)."""
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        initializer_range=0.1,  # top-2 logit gaps >= 5e-3, errors ~2e-6: no greedy ties
        bos_token_id=None,
        eos_token_id=None,  # generate all 32 tokens
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path


TINY_VARIANTS = {
    "untied": dict(tie=False),
    "tied": dict(tie=True),
    "llama3-rope": dict(tie=False, rope_scaling=LLAMA3_ROPE),
}


@pytest.fixture(params=list(TINY_VARIANTS))
def tiny_pair(request, tmp_path):
    hf_model, model_dir = tiny_hf_llama(tmp_path, **TINY_VARIANTS[request.param])
    ours, config = load_model(model_dir)
    return hf_model, ours, config


@torch.no_grad()
def test_packed_logits_equal_hf_per_prompt(tiny_pair):
    hf_model, ours, _ = tiny_pair
    ours_logits = packed_prefill(ours, ContiguousAttention(), PROMPTS)
    for prompt, logits in zip(PROMPTS, ours_logits):
        expected = hf_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_packed_greedy_equals_hf_generate(tiny_pair):
    hf_model, ours, _ = tiny_pair
    ours_tokens = packed_greedy(ours, PROMPTS, max_new_tokens=32)
    for prompt, tokens in zip(PROMPTS, ours_tokens):
        out = hf_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=0
        )
        assert tokens == out[0, len(prompt) :].tolist()


def test_tied_model_shares_the_embedding(tmp_path):
    _, model_dir = tiny_hf_llama(tmp_path, tie=True)
    ours, config = load_model(model_dir)
    assert config.tie_word_embeddings and ours.lm_head is None
    hidden = torch.randn(2, 64)
    expected = hidden @ ours.model.embed_tokens.weight.T
    torch.testing.assert_close(ours.compute_logits(hidden), expected)


def test_bf16_load_keeps_rope_table_fp32(tmp_path):
    _, model_dir = tiny_hf_llama(tmp_path, tie=False)
    ours, _ = load_model(model_dir, dtype=torch.bfloat16)
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert ours.model.rotary_emb.cos_sin.dtype == torch.float32
    hidden = ours(torch.tensor([1, 2, 3]), torch.arange(3), _fresh_attention())
    assert ours.compute_logits(hidden).dtype == torch.float32


def _fresh_attention() -> ContiguousAttention:
    attn = ContiguousAttention()
    attn.begin([0], [3])
    return attn


def test_missing_and_unexpected_weights_are_named(tmp_path):
    hf_model, model_dir = tiny_hf_llama(tmp_path, tie=False)
    state = {k: v for k, v in hf_model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as excinfo:
        load_model(model_dir)
    message = str(excinfo.value)
    assert "model.layers.1.mlp.up_proj.weight" in message
    assert "model.layers.0.self_attn.extra.weight" in message


def test_wrong_shape_is_named(tmp_path):
    hf_model, model_dir = tiny_hf_llama(tmp_path, tie=False)
    state = dict(hf_model.state_dict())
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(16, 64\), .* \(32, 64\)"):
        load_model(model_dir)


def test_unsupported_rope_type_is_refused(tmp_path):
    linear = {"rope_type": "linear", "factor": 2.0}
    _, model_dir = tiny_hf_llama(tmp_path, tie=False, rope_scaling=linear)
    with pytest.raises(ValueError, match="rope_type 'linear' is not supported"):
        load_model(model_dir)


# --- SmolLM2-135M-Instruct, the embedded default ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    """(our model, transformers model, chat prompt ids) for the converted default model."""
    model_dir = smollm2_dir
    ours, _ = load_model(model_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return ours, hf_model, tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_logits_equal_hf(smollm2):
    ours, hf_model, prompt = smollm2
    [logits] = packed_prefill(ours, ContiguousAttention(), [prompt])
    expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_greedy_equals_hf_generate(smollm2):
    ours, hf_model, prompt = smollm2
    [tokens] = packed_greedy(ours, [prompt], max_new_tokens=12)
    out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    expected = out[0, len(prompt) :].tolist()  # "The capital of France is Paris.<|im_end|>"
    assert expected[-1] == 2  # HF stopped at eos; ours decodes on, so compare up to it
    assert tokens[: len(expected)] == expected
