"""The text side of serving: tokenizer, chat template, incremental detokenizer, stop strings.

Wraps Hugging Face `tokenizers` (the Rust library, no transformers and no torch) over a model
directory's `tokenizer.json`, `tokenizer_config.json` and optional `chat_template.jinja`.
Everything here runs in the frontend's event loop, never in an engine's step loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (or the model has none): a 400 for the client."""


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    byte_values, code_points = list(printable), list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            code_points.append(256 + len(code_points) - len(printable))
    return {chr(c): b for b, c in zip(byte_values, code_points)}


_BYTE_LEVEL_DECODE = _bytes_to_unicode()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte tokens (Llama 2)
ASYNC_ENCODE_MIN_CHARS = 2000


def _token_content(value: str | dict | None) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as a serialized AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile the template in the environment transformers renders chat templates with."""

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' tojson: unlike jinja's own, no HTML escaping and non-ASCII kept as is.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _given_template(value: str) -> str:
    """--chat-template's value: the text of the file it names, or the template itself (a
    value with a template's braces, or no such file); checked by compiling it."""
    path = Path(value)
    looks_like_template = "{{" in value or "{%" in value
    if not looks_like_template and len(value) < 4096:
        try:
            value = path.read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {value!r}: not a readable file ({e.strerror}) "
                             "nor a template") from None
    try:
        _compile_chat_template(value)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from None
    return value


class Tokenizer:
    """A model's tokenizer: text <-> token ids, chat formatting, token strings for logprobs."""

    def __init__(self, hf: HFTokenizer, config: dict, chat_template: str | None = None):
        self.hf = hf
        self.special_tokens = {  # bos_token, eos_token, ... as the chat template sees them
            key: content for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(config.get(key))) is not None
        }
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        # add_bos_token in the config overrides whatever tokenizer.json's post-processor does.
        self._add_bos: bool | None = config.get("add_bos_token")
        self._post_processor_adds_bos = (
            self.bos_token_id is not None
            and hf.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id])
        self._template = _compile_chat_template(chat_template) if chat_template else None
        # A template that reads `tools` renders them (and tool calls) itself; for one that does
        # not, the frontend writes them into the messages (microserve/openai/tool_parsers.py).
        self.renders_tools = chat_template is not None and "tools" in chat_template
        self._byte_level = isinstance(hf.decoder, decoders.ByteLevel)
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, model_dir: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template from a model dir.

        The template comes from `chat_template` when given (vLLM's --chat-template: a file's
        path, or the template itself), else from `chat_template.jinja` when present (newer
        transformers saves it there), else from the config's `chat_template` (a string, or a
        list of named templates of which "default" is used).

        Raises:
            ValueError: a given template that does not compile (or an unreadable file).
        """
        model_dir = Path(model_dir)
        hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = model_dir / "chat_template.jinja"
        template = config.get("chat_template")
        if template_path.exists():
            template = template_path.read_text()
        elif isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        if chat_template is not None:
            template = _given_template(chat_template)
        return cls(hf, config, template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognized as such.

        Args:
            add_special_tokens: add the BOS (and whatever else the post-processor adds). Off for
                text rendered by the chat template, which writes its own BOS.
        """
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return self._bos_as_configured(ids, add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` for an event loop: long texts are encoded without holding the GIL.

        tokenizers' `encode` holds the GIL (an 8k-token prompt stalled a loop for 30 ms here,
        and a thread does not help); `async_encode` releases it but costs ~0.2 ms more, which
        pays off from about ASYNC_ENCODE_MIN_CHARS characters.
        """
        if len(text) < ASYNC_ENCODE_MIN_CHARS:
            return self.encode(text, add_special_tokens)
        encoding = await self.hf.async_encode(text, add_special_tokens=add_special_tokens)
        return self._bos_as_configured(encoding.ids, add_special_tokens)

    def _bos_as_configured(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens or self._add_bos is None or self.bos_token_id is None:
            return ids
        if self._add_bos and not self._post_processor_adds_bos:
            return [self.bos_token_id, *ids]
        if not self._add_bos and self._post_processor_adds_bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> str:
        """Render a conversation to prompt text (encode it with add_special_tokens=False).

        `tools` (OpenAI's tool definitions) are passed to the template as transformers does;
        `template_kwargs` are more variables for it (they cannot replace the messages, the
        tools, add_generation_prompt or the special tokens). `continue_final_message`: the text
        ends where the last message's content does (what the template writes after it, such
        as an end-of-turn token, is cut), so the model continues that message, as
        transformers does it.

        Raises:
            ChatTemplateError: no chat template, the template refused the messages, or (to
            continue it) the last message's content is not found in the rendered text.
        """
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            variables = {**(template_kwargs or {}), **self.special_tokens,
                         "messages": messages, "add_generation_prompt": add_generation_prompt}
            if tools:
                variables["tools"] = tools
            text = self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        if not continue_final_message:
            return text
        final = str(messages[-1].get("content") or "").strip()
        at = text.rfind(final) if final else -1
        if at == -1:
            raise ChatTemplateError("continue_final_message: the last message's content is "
                                    "not in the rendered prompt, so it cannot be continued")
        return text[:at + len(final)]

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (part of a UTF-8 character for byte tokens)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._added.get(token_id)
        if piece is not None:
            raw = piece.encode()
        else:
            raw = self._vocab_piece_bytes(self.hf.id_to_token(token_id) or "")
        self._bytes_cache[token_id] = raw
        return raw

    def _vocab_piece_bytes(self, piece: str) -> bytes:
        if self._byte_level:
            return bytes(_BYTE_LEVEL_DECODE[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match[1], 16)])
        return piece.replace("▁", " ").encode()  # SentencePiece marks spaces with U+2581

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it; a partial UTF-8 character becomes U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, step by step.

    Text is only released once its UTF-8 characters are complete (tokenizers' DecodeStream
    holds back a split character until the token that finishes it arrives). A few prompt tokens
    seed the stream so that the first generated token decodes in context: SentencePiece
    decoders strip a leading space at the start of a text, not in its middle.
    """

    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids[-self.PROMPT_CONTEXT:]),
                                    skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # fed but not yet released: an unfinished character

    def step(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; return the text they complete ("" if none yet)."""
        if not token_ids:
            return ""
        self._held.extend(token_ids)
        text = self._stream.step(self._tokenizer.hf, list(token_ids))
        if text is None:
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """At the end of generation: held tokens that never completed a character (as U+FFFD)."""
        text = self._tokenizer.decode(self._held, self._skip_special) if self._held else ""
        self._held.clear()
        return text


class StopChecker:
    """Cuts generated text before the first stop string, as OpenAI does (stop string excluded;
    after it with `include`, vLLM's include_stop_str_in_output).

    While streaming, a tail that could still grow into a stop string is held back until later
    text resolves it: with stop "ab", text "xa" releases "x" and holds "a"; then "b" ends the
    text at "x", while "c" releases "ac". So no released text ever contains a stop string.
    """

    def __init__(self, stop: Sequence[str], include: bool = False):
        self._stops = [s for s in stop if s]  # an empty stop string would match everywhere
        self._include = include
        self._held = ""
        self.stopped = False  # set once a stop string was found; later text is ignored

    def feed(self, text: str) -> str:
        """Add newly generated text; return the part that is safe to release now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        found = [(i, len(s)) for s in self._stops if (i := buffer.find(s)) != -1]
        if found:
            cut, length = min(found)  # the first to start (the shorter of two at one place)
            self.stopped, self._held = True, ""
            return buffer[:cut + length] if self._include else buffer[:cut]
        keep = self._longest_partial_stop(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def _longest_partial_stop(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def flush(self) -> str:
        """Generation ended without a stop string: release what was held back."""
        text, self._held = self._held, ""
        return text
