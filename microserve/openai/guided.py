"""Structured outputs: request fields -> one llguidance grammar for the engine's sampler.

The fields, at most one of them per request (a 400 names both otherwise):

    response_format       {"type": "json_object"}: any JSON object
                          {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json           a JSON schema (object or string)            vLLM extensions, also
    guided_regex          a regular expression (Rust regex syntax)    as structured_outputs.
    guided_choice         a list of strings, output is exactly one    {json, regex, choice,
    guided_grammar        a Lark grammar (llguidance's dialect)       grammar} (vLLM >= 0.12)
    regex, json_schema    SGLang's names (json_schema: a string)

Each becomes an llguidance grammar (JSON text, plain data for SamplingParams.grammar) and is
checked here, in the frontend, so a bad schema or regex is a 400 naming its field before any
engine sees it. JSON is generated compactly with `", "` and `": "` separators and no free
whitespace, so a model cannot wander into endless blank lines. Runs in the frontend (no torch).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from microserve import bounded_json
from microserve.bounded_json import JSONBoundsError
from microserve.bounds import MAX_SCHEMA_CHARS
from microserve.errors import invalid_request

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def checked(grammar: str, field: str) -> str:
    """`grammar` if llguidance builds it, else a 400 naming `field` with llguidance's reason."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid_request(f"Invalid {field}: {error.strip()}", field)
    return grammar


def json_schema_grammar(schema: Any, field: str) -> str:
    """The grammar of JSON text valid against `schema` (a dict, or its JSON text)."""
    if isinstance(schema, str):
        _check_size(schema, field)
        try:
            schema = bounded_json.loads(schema)
        except json.JSONDecodeError as e:
            raise invalid_request(f"Invalid {field}: not JSON ({e})", field) from None
        except JSONBoundsError as e:
            raise invalid_request(f"Invalid {field}: {e}", field) from None
    if not isinstance(schema, dict):
        raise invalid_request(f"Invalid {field}: a JSON schema must be an object, got "
                              f"{type(schema).__name__}", field)
    text = json.dumps(schema)
    _check_size(text, field)
    try:  # llguidance reads the schema first: JSON it cannot hold (too deep) is a ValueError
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise invalid_request(f"Invalid {field}: {e}", field) from None
    return checked(grammar, field)


def regex_grammar(regex: str, field: str) -> str:
    _check_size(regex, field)
    return checked(llguidance.LLMatcher.grammar_from_regex(regex), field)


def choice_grammar(choices: list[str], field: str) -> str:
    if not choices:
        raise invalid_request(f"Invalid {field}: at least one choice is needed", field)
    _check_size(json.dumps(choices), field)
    # Lark string literals take JSON's escapes.
    lark = "start: " + " | ".join(json.dumps(choice) for choice in choices)
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), field)


def lark_grammar(lark: str, field: str) -> str:
    _check_size(lark, field)
    return checked(llguidance.LLMatcher.grammar_from_lark(lark), field)


def _check_size(text: str, field: str) -> None:
    if len(text) > MAX_SCHEMA_CHARS:
        raise invalid_request(f"Invalid {field}: {len(text)} characters, more than the "
                              f"{MAX_SCHEMA_CHARS} this server accepts", field)


def response_format_grammar(response_format: dict) -> str | None:
    """OpenAI's `response_format` (already shape-checked by protocol.ResponseFormat)."""
    kind = response_format["type"]
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        return json_schema_grammar(response_format["json_schema"]["schema"],
                                   "response_format.json_schema.schema")
    return None


_BUILDERS = {"json": json_schema_grammar, "regex": regex_grammar, "choice": choice_grammar,
             "grammar": lark_grammar}
# request field -> the kind of constraint it sets
GUIDED_FIELDS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar", "json_schema": "json", "regex": "regex",
}


def request_grammar(fields: dict[str, Any]) -> tuple[str | None, str | None]:
    """The grammar a request's structured-output fields ask for, and the field that set it.

    Args:
        fields: the request's values of `response_format`, the GUIDED_FIELDS and
            `structured_outputs` (a dict of json/regex/choice/grammar); None where unset.

    Returns:
        (grammar, field), or (None, None) when the output is free text.

    Raises:
        OpenAIError: a 400 naming the field (two constraints at once, a bad schema or regex).
    """
    asked = []  # (field, kind, value)
    response_format = fields.get("response_format")
    if response_format is not None and response_format["type"] != "text":
        asked.append(("response_format", "response_format", response_format))
    for field, kind in GUIDED_FIELDS.items():
        if fields.get(field) is not None:
            asked.append((field, kind, fields[field]))
    for kind, value in (fields.get("structured_outputs") or {}).items():
        if value is not None:
            asked.append((f"structured_outputs.{kind}", kind, value))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = ", ".join(field for field, _, _ in asked)
        raise invalid_request(f"Only one output constraint per request; got {names}",
                              asked[1][0])
    field, kind, value = asked[0]
    if kind == "response_format":
        return response_format_grammar(value), field
    return _BUILDERS[kind](value, field), field
