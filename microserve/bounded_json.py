"""JSON text that a client or a model wrote, read within bounds. No torch.

Python's `json` takes anything: nesting until the interpreter's recursion limit (a
RecursionError), integers past the int-string limit (a ValueError that is not a
JSONDecodeError), `NaN`, `Infinity` and `1e999` (floats that `json.dumps` writes back as text no
JSON parser takes), and `"\\ud800"` (a lone surrogate, which cannot be encoded as UTF-8 when
the answer is sent). `loads` refuses each of these with a `JSONBoundsError` that says which:

    MAX_JSON_DEPTH          arrays and objects nested at most this deep
    MAX_JSON_NUMBER_CHARS   a number written in at most this many characters (Python's default
                            int-string limit: every integer we accept can be written back)

Text that is not JSON at all is still a `json.JSONDecodeError`, so callers can tell "not JSON"
(a model's prose, a client's free-form arguments) from "JSON we will not hold". Whatever
`loads` returns, `json.dumps(value, ensure_ascii=False)` writes as valid JSON and UTF-8.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

MAX_JSON_DEPTH = 100  # llguidance compiles schemas up to about 128 levels of JSON
MAX_JSON_NUMBER_CHARS = sys.int_info.default_max_str_digits  # 4,300

# A JSON string (its escapes included), and the brackets left once strings are gone.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


class JSONBoundsError(ValueError):
    """JSON that is well-formed but past a bound; the message says which bound and by how much."""


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in `text`, brackets inside strings not counted (an
    unterminated string's brackets are: an over-estimate, never an under-estimate)."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest


def _check_number(text: str) -> None:
    if len(text) > MAX_JSON_NUMBER_CHARS:
        raise JSONBoundsError(f"a JSON number of {len(text)} characters, more than the "
                              f"{MAX_JSON_NUMBER_CHARS} accepted")


def _parse_int(text: str) -> int:
    _check_number(text)
    try:
        return int(text)
    except ValueError as e:  # a process that lowered the int-string limit
        raise JSONBoundsError(str(e)) from None


def _parse_float(text: str) -> float:
    _check_number(text)
    value = float(text)
    if not math.isfinite(value):
        raise JSONBoundsError(f"the number {text[:20]} is out of a double's range")
    return value


def _refuse_constant(name: str) -> Any:
    raise JSONBoundsError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float,
                            parse_constant=_refuse_constant)


def _check_strings(value: Any) -> None:
    """Every string and key is valid Unicode (no lone surrogate from a `\\ud800` escape)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(item[e.start])
                raise JSONBoundsError(f"a lone surrogate (\\u{code:04x}) in a JSON string, "
                                      "which is not Unicode text") from None


def check_depth(text: str) -> None:
    """Raises JSONBoundsError if arrays and objects in `text` nest past MAX_JSON_DEPTH."""
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise JSONBoundsError(f"JSON nested {depth} deep, more than the {MAX_JSON_DEPTH} "
                              "accepted")


def loads(text: str) -> Any:
    """`json.loads(text)` within the bounds above.

    Raises:
        json.JSONDecodeError: `text` is not JSON.
        JSONBoundsError: it is, but past a bound (the message says which).
    """
    check_depth(text)
    value = _DECODER.decode(text)
    _check_strings(value)
    return value


def raw_decode(text: str, at: int = 0) -> tuple[Any, int]:
    """The JSON value starting at `text[at]` and where it ends, within the bounds above; raises
    as `loads` does. The caller checks the depth first, once for the whole text
    (`check_depth(text)`): values read one after another from it then cost no rescan."""
    value, end = _DECODER.raw_decode(text, at)
    _check_strings(value)
    return value, end
