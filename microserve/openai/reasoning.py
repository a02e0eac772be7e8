"""Reasoning models' thinking, split from their answer (`--reasoning-parser`, as vLLM's option).

`deepseek_r1`: DeepSeek-R1 and its distillations into Llama (DeepSeek-R1-Distill-Llama-8B,
-70B) think first and close their thinking with `</think>`; the opening `<think>` may be in
the output or already in the prompt (newer chat templates end the assistant's opening with
it). So everything up to the first `</think>` is reasoning (a leading `<think>` dropped) and
everything after it the answer; an output that never closes its thinking is all reasoning.
Chat answers carry it as `reasoning_content` (and `reasoning`, vLLM's newer name) beside
`content`; tool calls and stop strings are read from the answer only.

`ThinkSplitter` does it on a stream: text that may be the start of a tag (`</th...`) is held
back until the next piece says whether it is one.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1",)
START, END = "<think>", "</think>"


class ThinkSplitter:
    """One generation's text, piece by piece, into (reasoning, answer) pieces."""

    def __init__(self):
        self._thinking = True
        self._at_start = True  # nothing but whitespace so far: a <think> here is dropped
        self._held = ""  # text that may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        if not self._thinking:
            return "", text
        text = self._held + text
        self._held = ""
        if self._at_start:
            stripped = text.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                self._held = text  # maybe the opening tag, not all here yet
                return "", ""
            if stripped.startswith(START):
                text = stripped[len(START):]
            self._at_start = False
        end = text.find(END)
        if end >= 0:
            self._thinking = False
            return text[:end], text[end + len(END):]
        keep = _partial_suffix(text, END)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        """The end of the generation: what was held back is reasoning (no tag came)."""
        held, self._held = self._held, ""
        return (held, "") if self._thinking else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(text: str) -> tuple[str, str]:
    """A whole output's (reasoning, answer)."""
    splitter = ThinkSplitter()
    reasoning, answer = splitter.feed(text)
    more_reasoning, more_answer = splitter.flush()
    return reasoning + more_reasoning, answer + more_answer
