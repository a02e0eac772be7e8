"""Tokenizer wrapper, chat templates, incremental detokenization and stop strings.

The tokenizers are built here (byte-level BPE trained on a few sentences), so the expected
ids and strings are exact and nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import SentencePieceBPETokenizer, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from microserve.tokenizer import (ASYNC_ENCODE_MIN_CHARS, ChatTemplateError,
                                  IncrementalDetokenizer, StopChecker, Tokenizer)

SPECIAL_TOKENS = ["<s>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld", "ab xa b"]


def train_byte_level_bpe() -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS * 3, trainer)
    return hf


def make_tokenizer_dir(path: Path, hf: HFTokenizer | None = None, **config) -> Path:
    """A model directory holding a tiny tokenizer; `config` overrides tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    (hf or train_byte_level_bpe()).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>", "special": True},
              "chat_template": CHATML, **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path))


def byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet has a token for each)."""
    by_bytes = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    return [by_bytes[bytes([b])] for b in text.encode()]


# -- Tokenizer -------------------------------------------------------------------------------

def test_special_tokens_from_config(tok):
    assert tok.bos_token_id == 0 and tok.eos_token_id == 2  # eos given as an AddedToken dict
    assert tok.vocab_size == tok.hf.get_vocab_size(with_added_tokens=True)
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>"}


def test_encode_decode_round_trip(tok):
    text = "héllo wörld 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>hello")[0] == 1  # special tokens in text are recognized
    assert tok.decode([1, *tok.encode("hello"), 2]) == "hello"
    assert tok.decode([1, *tok.encode("hello"), 2], skip_special_tokens=False) == (
        "<|im_start|>hello<|im_end|>")


def test_add_bos_token_from_config(tmp_path):
    plain = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "plain"))
    ids = plain.encode("hello")
    assert ids[0] != 0  # the byte-level post-processor adds nothing
    with_bos = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "bos", add_bos_token=True))
    assert with_bos.encode("hello") == [0, *ids]
    assert with_bos.encode("hello", add_special_tokens=False) == ids


@pytest.mark.parametrize("chars", [10, ASYNC_ENCODE_MIN_CHARS + 10])  # inline; off the GIL
async def test_encode_async_equals_encode(tmp_path, chars):
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, add_bos_token=True))
    text = ("the quick brown fox 😀 " * 200)[:chars]
    assert await tok.encode_async(text) == tok.encode(text)
    assert await tok.encode_async(text, add_special_tokens=False) == tok.encode(text)[1:]


def test_add_bos_token_false_overrides_post_processor(tmp_path):
    hf = train_byte_level_bpe()
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    ids = hf.encode("hello", add_special_tokens=False).ids
    default = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "default", hf))
    assert default.encode("hello") == [0, *ids]
    off = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "off", hf, add_bos_token=False))
    assert off.encode("hello") == ids


def test_chat_template_renders_like_transformers(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_chat_template_raise_exception_is_a_chat_template_error(tok):
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chat_template_environment_trims_blocks_and_tojson_keeps_text(tmp_path):
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "U: {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{{ messages[0] | tojson }}|{{ {'b': 1, 'a': 2} | tojson(indent=1, sort_keys=true) }}"
    )
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, chat_template=template))
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}])
    # trim_blocks + lstrip_blocks drop the tag lines; tojson neither escapes HTML nor non-ASCII.
    assert out == 'U: <é>\n{"role": "user", "content": "<é>"}|{\n "a": 2,\n "b": 1\n}'


def test_chat_template_file_and_named_templates(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "named", chat_template=named))
    assert tok.apply_chat_template([]) == "D"
    model_dir = make_tokenizer_dir(tmp_path / "file")
    (model_dir / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user"}]) == "F1"


def test_a_given_chat_template_replaces_the_models(tmp_path):
    """vLLM's --chat-template: a file's path or the template itself, compiled up front."""
    model_dir = make_tokenizer_dir(tmp_path / "m", chat_template="MODEL")
    assert Tokenizer.from_dir(model_dir).apply_chat_template([]) == "MODEL"
    inline = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert Tokenizer.from_dir(model_dir, inline).apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"
    path = tmp_path / "t.jinja"
    path.write_text("FILE {{ messages | length }}")
    tok = Tokenizer.from_dir(model_dir, str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "FILE 1"
    with pytest.raises(ValueError, match="not a readable file"):
        Tokenizer.from_dir(model_dir, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer.from_dir(model_dir, "{% for m in messages %}")


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_token_bytes_and_text(tok):
    first_byte_of_emoji = byte_token_ids(tok, "😀")[0]
    assert tok.token_bytes(first_byte_of_emoji) == b"\xf0"
    assert tok.token_text(first_byte_of_emoji) == "\ufffd"
    assert tok.token_bytes(2) == b"<|im_end|>"
    (world,) = [i for i in tok.encode(" world") if tok.token_bytes(i) == b" world"]
    assert tok.token_text(world) == " world"


def test_token_bytes_of_sentencepiece_pieces(tmp_path):
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS * 5, vocab_size=100, special_tokens=["<s>", "</s>"])
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, sp._tokenizer, chat_template=None))
    assert [tok.token_text(i) for i in tok.encode("hello world")] == [" hello", " world"]


# -- IncrementalDetokenizer ------------------------------------------------------------------

def test_detokenizer_waits_for_whole_characters(tok):
    detok = IncrementalDetokenizer(tok)
    steps = [detok.step([t]) for t in byte_token_ids(tok, "a😀é")]
    assert steps == ["a", "", "", "", "😀", "", "é"]


def test_detokenizer_matches_full_decode(tok):
    ids = tok.encode("héllo wörld, the quick 😀 fox") + [2]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.step(ids[i:i + 2]) for i in range(0, len(ids), 2)]  # two ids per step
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == "héllo wörld, the quick 😀 fox"


def test_detokenizer_flush_reports_an_unfinished_character(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.step(tok.encode("ok")) == "ok"
    assert detok.step(byte_token_ids(tok, "😀")[:2]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_detokenizer_prompt_context_keeps_a_leading_space(tmp_path):
    # SentencePiece strips the space of a text's first piece; mid-text it is kept.
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS * 5, vocab_size=100, special_tokens=["<s>", "</s>"])
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, sp._tokenizer, chat_template=None))
    hello, world = tok.encode("hello world")
    assert IncrementalDetokenizer(tok).step([world]) == "world"
    assert IncrementalDetokenizer(tok, prompt_ids=[hello]).step([world]) == " world"


# -- StopChecker -----------------------------------------------------------------------------

@pytest.mark.parametrize("stops, chunks, released, stopped", [
    (["ab"], ["xa", "b", "more"], ["x", "", ""], True),  # "a" held, then the stop completes
    (["ab"], ["xa", "c"], ["x", "ac"], False),  # the held "a" was not a stop after all
    (["abc"], ["a", "b", "c"], ["", "", ""], True),
    (["aab"], ["a", "a", "a", "b"], ["", "", "a", ""], True),  # overlapping prefixes
    (["yz", "b"], ["xyab"], ["xya"], True),  # the earliest stop string wins
    (["yz", "ya"], ["xya"], ["x"], True),
    ([], ["ab"], ["ab"], False),
    ([""], ["ab"], ["ab"], False),  # an empty stop string never matches
])
def test_stop_checker(stops, chunks, released, stopped):
    checker = StopChecker(stops)
    assert [checker.feed(c) for c in chunks] == released
    assert checker.stopped == stopped


@pytest.mark.parametrize("stops, chunks, released", [
    (["ab"], ["xa", "b", "more"], ["x", "ab", ""]),  # held "a", then the stop, kept whole
    (["yz", "b"], ["xyab"], ["xyab"]),  # the earliest stop string, up to its end
    (["abc", "ab"], ["xabcd"], ["xab"]),  # two at one place: the shorter ends the text
])
def test_stop_checker_can_keep_the_stop_string(stops, chunks, released):
    """vLLM's include_stop_str_in_output: the text ends after the stop string."""
    checker = StopChecker(stops, include=True)
    assert [checker.feed(c) for c in chunks] == released
    assert checker.stopped


def test_chat_template_kwargs_continue_and_no_generation_prompt(tmp_path):
    """More variables for the template (never replacing the messages or the generation
    prompt flag); the last message continued (cut where its content ends); and a content the
    template does not write cannot be continued."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
                "{% if think is defined %}[think={{ think }}]{% endif %}")
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path, chat_template=template))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " Hello "}]
    assert tok.apply_chat_template(chat[:1]) == "<user>hi</user><assistant>"
    assert tok.apply_chat_template(chat[:1], template_kwargs={"think": False}) == (
        "<user>hi</user><assistant>[think=False]")
    assert tok.apply_chat_template(
        chat[:1], add_generation_prompt=False,
        template_kwargs={"messages": [], "add_generation_prompt": True}) == "<user>hi</user>"
    assert tok.apply_chat_template(chat, add_generation_prompt=False,
                                   continue_final_message=True) == (
        "<user>hi</user><assistant> Hello")
    counts = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "n", chat_template="n={{ messages"
                                                   " | length }}"))  # fmt: skip
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        counts.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)


def test_stop_checker_flush_releases_held_text():
    checker = StopChecker(["</end>"])
    assert checker.feed("done </e") == "done "
    assert checker.flush() == "</e"
    assert not checker.stopped
