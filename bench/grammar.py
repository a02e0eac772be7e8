"""Constrained decoding on the host: llguidance against xgrammar, per token and per grammar.

    python -m bench.grammar [--model smollm2-135m-instruct] [--repeats 20]

For one JSON schema (nested objects, an enum, an array; what an extraction request sends) and
the model's tokenizer (SmolLM2: 49,152 tokens), each library:

  tokenizer   building its tokenizer view once per engine (vocabulary scan);
  compile     turning the schema into a matcher ready for its first mask, cold (no cache),
              median of `--repeats`;
  mask        filling the next-token bitmask, per token, while walking a schema-valid answer
              token by token (the mask, then accepting the token): p50, p99 and mean over
              every token of every repeat;
  accept      accepting one token.

Single-threaded, on the CPU this runs on. Prints a Markdown block for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                              "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "address", "role", "tags"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "12345"},
          "role": "admin", "tags": ["math", "engines", "poetry"]}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_llguidance(tokenizer_json: str, eos: int, answer_ids: list[int], repeats: int):
    import llguidance
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    tokenizer_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
    compiles, masks, accepts = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        fill_next_token_bitmask(matcher, bitmask)
        compiles.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        matcher.reset()
        for token in answer_ids:
            start = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask)
            masks.append(time.perf_counter() - start)
            assert np.bitwise_and(bitmask[0, token // 32] >> (token % 32), 1), token
            start = time.perf_counter()
            assert matcher.consume_token(token), matcher.get_error()
            accepts.append(time.perf_counter() - start)
        assert matcher.is_accepting()
    return tokenizer_s, compiles, masks, accepts


def bench_xgrammar(hf_tokenizer, answer_ids: list[int], repeats: int):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer,
                                                   vocab_size=len(hf_tokenizer))
    tokenizer_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    compiles, masks, accepts = [], [], []
    for _ in range(repeats):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False, max_threads=1)
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                separators=(",", ":"))
        matcher = xgrammar.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(bitmask)
        compiles.append(time.perf_counter() - start)
        matcher.reset()
        for token in answer_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter() - start)
            assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, token
            start = time.perf_counter()
            assert matcher.accept_token(token)
            accepts.append(time.perf_counter() - start)
        assert matcher.is_terminated() or matcher.accept_token(hf_tokenizer.eos_token_id)
    return tokenizer_s, compiles, masks, accepts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model name or directory")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from microserve.model_files import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answer = json.dumps(ANSWER, separators=(",", ":"))
    answer_ids = hf_tokenizer.encode(answer, add_special_tokens=False)
    tokenizer_json = (model_dir / "tokenizer.json").read_text()
    results = {
        "llguidance": bench_llguidance(tokenizer_json, hf_tokenizer.eos_token_id, answer_ids,
                                       args.repeats),
        "xgrammar": bench_xgrammar(hf_tokenizer, answer_ids, args.repeats),
    }
    print(f"vocabulary {len(hf_tokenizer)} tokens; answer {len(answer_ids)} tokens; "
          f"{args.repeats} repeats; 1 thread\n")
    print("| library | tokenizer init | compile (cold, p50) | mask p50 | mask p99 | mask mean "
          "| accept mean |")
    print("|---|---|---|---|---|---|---|")
    for name, (tokenizer_s, compiles, masks, accepts) in results.items():
        print(f"| {name} | {tokenizer_s * 1e3:.0f} ms | "
              f"{statistics.median(compiles) * 1e3:.2f} ms | "
              f"{_percentile(masks, 0.5) * 1e6:.0f} us | {_percentile(masks, 0.99) * 1e6:.0f} us "
              f"| {statistics.mean(masks) * 1e6:.0f} us | {statistics.mean(accepts) * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
