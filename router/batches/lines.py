"""A batch input file read line by line: what is wrong with a line, the request it makes, and
the output and error lines OpenAI's Batch API writes.

    input   {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output  {"id": "batch_req_...", "custom_id": "r1",
             "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
    error   the same with a 4xx/5xx response, or "response": null and
            "error": {"code": "invalid_json", "message": "..."} for a line that never ran

No torch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from microserve.openai.protocol import DEFAULT_COMPLETION_TOKENS

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
DEFAULT_OUTPUT_TOKENS = 256  # the ordering's guess for a chat line without max_tokens


@dataclass(frozen=True)
class ParsedLine:
    idx: int  # its place among the file's non-empty lines
    custom_id: str | None
    body: dict | None  # None: the line is bad
    error: dict | None = None  # {"code", "message"} of a bad line
    raw_body: bytes | None = None  # the body's JSON as the file wrote it


# A line's keys stay undecoded JSON (msgspec.Raw): the body is kept as its bytes, with no
# re-encoding (json.dumps of a 3,000-token prompt takes ~0.4 ms) and no list of ints left for
# the garbage collector to walk; msgspec decodes such a line in half the time json takes.
_LINE = msgspec.json.Decoder(dict[str, msgspec.Raw])


def iter_lines(data: bytes, endpoint: str) -> Iterator[ParsedLine]:
    """Every non-empty line of an input file, each either a request body or why not, one at a
    time: a caller that keeps only `raw_body` holds no decoded body past its line."""
    seen: set[str] = set()
    for idx, raw in enumerate(line for line in data.splitlines() if line.strip()):
        yield _parse(idx, raw, endpoint, seen)


def parse_lines(data: bytes, endpoint: str) -> list[ParsedLine]:
    return list(iter_lines(data, endpoint))


def _parse(idx: int, raw: bytes, endpoint: str, seen: set[str]) -> ParsedLine:
    def bad(code: str, message: str, custom_id=None) -> ParsedLine:
        return ParsedLine(idx, custom_id, None, {"code": code,
                                                 "message": f"line {idx + 1}: {message}"})

    try:
        line = _LINE.decode(raw)
    except msgspec.ValidationError:  # JSON, but not an object
        return bad("invalid_json", "a line must be a JSON object, got "
                   f"{type(msgspec.json.decode(raw)).__name__}")
    except msgspec.DecodeError as e:
        return bad("invalid_json", f"not JSON ({e})")
    try:
        keys = {k: msgspec.json.decode(line[k]) for k in ("custom_id", "method", "url")
                if k in line}
    except msgspec.DecodeError as e:  # e.g. a lone surrogate escape
        return bad("invalid_json", f"not JSON ({e})")
    custom_id = keys.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "'custom_id' must be a non-empty string")
    if custom_id in seen:
        return bad("duplicate_custom_id", f"custom_id {custom_id!r} was used by an earlier "
                   "line", custom_id)
    seen.add(custom_id)
    if keys.get("method") != "POST":
        return bad("invalid_method", f"'method' must be \"POST\", got {keys.get('method')!r}",
                   custom_id)
    if keys.get("url") != endpoint:
        return bad("invalid_url", f"'url' {keys.get('url')!r} is not the batch's endpoint "
                   f"{endpoint!r}", custom_id)
    try:
        body = msgspec.json.decode(line["body"]) if "body" in line else None
    except msgspec.DecodeError as e:
        return bad("invalid_json", f"not JSON ({e})", custom_id)
    if not isinstance(body, dict):
        return bad("invalid_body", "'body' must be a JSON object", custom_id)
    if body.get("stream"):
        return bad("invalid_body", "'body.stream' must be false in a batch", custom_id)
    return ParsedLine(idx, custom_id, body, raw_body=bytes(line["body"]))


def expected_output_tokens(body: dict, endpoint: str) -> int:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > 0:
            return value
    if endpoint == "/v1/completions" and "max_tokens" not in body:
        return DEFAULT_COMPLETION_TOKENS  # what the API gives such a line
    return DEFAULT_OUTPUT_TOKENS


def output_line(custom_id: str | None, status: int | None, body: dict | None,
                error: dict | None = None) -> dict:
    """One line of the output or error file."""
    response = None
    if status is not None:
        request_id = body.get("id") if isinstance(body, dict) else None
        response = {"status_code": status, "request_id": request_id or uuid.uuid4().hex,
                    "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}
