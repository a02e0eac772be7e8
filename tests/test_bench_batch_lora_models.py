"""Benchmark helpers without a GPU: bench.batch_bench's deployment file with more engine args,
bench.batch_workload's kinds of line, bench.scripts.blend_model's steps, and
bench.scripts.lora_slot_model's bound on routing under LoRA slot pressure."""

import pytest

from bench.batch_bench import with_engine_args
from bench.scripts import lora_slot_model as model


def test_every_engine_gets_the_extra_args_first(tmp_path):
    config = tmp_path / "two.toml"
    config.write_text('model = "m"\n\n[[engines]]\nname = "a"\nargs = ["--device", "cuda:0"]\n'
                      '\n[[engines]]\nname = "b"\nargs = []\n')
    out = with_engine_args(str(config), ["--num-pages", "8192"], tmp_path / "out.toml")
    text = open(out).read()
    assert 'args = ["--num-pages", "8192", "--device", "cuda:0"]' in text
    assert 'args = ["--num-pages", "8192", ]' in text
    import tomllib
    engines = tomllib.loads(text)["engines"]
    assert [e["args"] for e in engines] == [["--num-pages", "8192", "--device", "cuda:0"],
                                            ["--num-pages", "8192"]]


def test_an_engine_without_its_args_line_is_refused(tmp_path):
    config = tmp_path / "one.toml"
    config.write_text('[[engines]]\nname = "a"\n')
    with pytest.raises(SystemExit, match="1 \\[\\[engines\\]\\] tables but 0"):
        with_engine_args(str(config), ["--x"], tmp_path / "out.toml")


def test_the_slot_model_orders_the_policies_and_repeats_itself():
    """8 slots an engine, 32 adapters of Zipf(1.0): no slot limit > a popularity partition >
    round robin, and the same seed gives the same figure."""
    speed = {p: model.run(p, 8, 1.0, seed=0) for p in
             ("rr", "affinity", "partition", "no-slot-limit")}
    assert speed["no-slot-limit"] > speed["partition"] > speed["rr"]
    assert speed["affinity"] > speed["rr"]
    assert model.run("affinity", 8, 1.0, seed=0) == speed["affinity"]
    # with a slot for every adapter, routing cannot matter for the slots
    assert model.run("rr", 32, 1.0, seed=0) == pytest.approx(speed["no-slot-limit"])


def test_the_batch_workload_adds_document_lines_only_when_asked():
    from collections import Counter

    from bench.batch_workload import workload
    plain = workload(200, 4, 1000, seed=1)
    assert len(plain) == 200
    assert sum(r["body"]["max_tokens"] >= 256 for r in plain) == 100  # multi-turn: half
    mixed = workload(200, 4, 1000, seed=1, documents=0.25)
    heads = Counter(tuple(r["body"]["prompt"][:512]) for r in mixed)
    # a document's first 512 tokens are its own; a few-shot line's are its template's
    docs = [r["body"] for r in mixed if r["body"]["max_tokens"] <= 64
            and heads[tuple(r["body"]["prompt"][:512])] == 1]
    assert len(mixed) == 200 and len(docs) == 50
    assert len({tuple(d["prompt"][:64]) for d in docs}) == 1  # one task instruction
    assert all(d["max_tokens"] <= 64 and len(d["prompt"]) <= 64 + 4096 for d in docs)
    assert sum(r["body"]["max_tokens"] >= 256 for r in mixed) == 75  # the rest split in two
    with pytest.raises(ValueError, match="documents 1.5 must be a share"):
        workload(10, 1, 1000, seed=1, documents=1.5)


def test_the_blend_model_steps_a_batch_as_its_docstring_says():
    """One-second steps unless 10 tokens are computed: A's 8-token prompt takes two steps of
    4 (the second samples its only token), B's 2-token prompt the third (its first token),
    then B decodes its other two: 5 steps. Cached tokens are what an earlier prompt shares."""
    from bench.scripts.blend_model import Roofline, cached_tokens, run
    prompts, outputs = [[1] * 8, [1, 2]], [1, 3]
    model = Roofline(read_s=1.0, per_seq_s=0.0, per_ctx_token_s=0.0, per_token_s=0.1)
    assert run(prompts, outputs, [0, 1], seats=2, budget=4, model=model) == 5.0
    assert cached_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9]], [0, 1, 2, 3]) == [0, 2, 3, 0]
    # a step computing more than 10 tokens costs their compute
    assert model.step(0, 0, 30) == pytest.approx(3.0)


def test_alternate_takes_one_line_from_each_end_in_turn():
    from router.batches.order import alternate
    assert alternate([1, 2, 3, 4, 5]) == [1, 5, 2, 4, 3]
    assert alternate([]) == []
