"""Two benchmark helpers without a GPU: bench.batch_bench's deployment file with more engine
args, and bench.scripts.lora_slot_model's bound on routing under LoRA slot pressure."""

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
