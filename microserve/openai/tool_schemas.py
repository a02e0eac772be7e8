"""The JSON schema a forced tool call is generated from: one call of any of the functions.

    {"anyOf": [{"type": "object",
                "properties": {"name": {"const": "f"}, "arguments": <f's parameters>},
                "required": ["name", "arguments"], "additionalProperties": false},
               ...one such option per function...]}

(a single function's option is the root itself). Each function's `parameters` is a whole JSON
schema of its own, written as if it were a document's root; nested under the call it needs two
changes:

- References. `#/$defs/Address` (what pydantic writes for a nested model), `#/definitions/X`
  (zod), `#` (a recursive model) and any other local pointer meant the parameters' own root;
  each is rewritten to the same place under the function's option:
  `#/anyOf/1/properties/arguments/$defs/Address`. Every function's definitions stay in its own
  subtree, so two tools that both define `Address` do not clash. A root `$id` is dropped (it
  would make the rewritten pointers relative to the parameters again); remote references are
  left to llguidance, which refuses them. A root without `type` gets `"type": "object"`, and
  no parameters (or `{}`) means no arguments.
- Undeclared keys (`strict`). An object schema that declares `properties` (or
  `patternProperties`) and says nothing of `additionalProperties` takes no other keys, as
  vLLM's grammar backends (xgrammar's strict mode) have it: a model cannot invent an argument
  the function never declared. A function sent with `"strict": false` keeps its schema as
  written. Objects combined through `allOf` are left as written (llguidance intersects the
  branches, so a closed branch would refuse the properties the others declare).

Only schema positions are walked (`properties`, `items`, `anyOf`, `$defs`, ...): the values of
`const`, `enum`, `default` and `examples`, and property names, are never touched.
"""

from __future__ import annotations

from typing import Any

from microserve.openai.guided import JSON_OPTIONS
from microserve.openai.tools import FunctionDefinition

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

# keyword -> how its value holds subschemas
_SCHEMA = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def calls_schema(functions: list[FunctionDefinition], arguments_key: str) -> dict:
    """One call of any of `functions`: {"name": <its name>, <arguments_key>: <its schema>}."""
    options = []
    for i, function in enumerate(functions):
        where = f"/properties/{arguments_key}"
        if len(functions) > 1:
            where = f"/anyOf/{i}{where}"
        options.append({
            "type": "object",
            "properties": {"name": {"const": function.name},
                           arguments_key: arguments_schema(function, where)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def arguments_schema(function: FunctionDefinition, where: str) -> dict | bool:
    """`function`'s parameters as a subschema at JSON pointer `where` of a bigger schema
    (a copy: the request's own schema is rendered into the prompt as sent)."""
    if not function.parameters:  # none, or {}: no arguments (as OpenAI reads it)
        return NO_ARGUMENTS
    # Arguments are an object where the root does not say (OpenAI's calls are objects); a root
    # $id would make the rewritten refs relative to the parameters again.
    parameters = {"type": "object", **function.parameters}
    parameters.pop("$id", None)
    return _rewritten(parameters, where, close=function.strict is not False)


def _rewritten(schema: Any, where: str, close: bool) -> Any:
    """A copy of `schema` with local references moved under `where` and, with `close`, object
    schemas closed to undeclared keys (see the module's docstring)."""
    if not isinstance(schema, dict):  # true / false, or something llguidance will refuse
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or
                                                         value.startswith("#/")):
            out[key] = "#" + where + value[1:]
        elif key in _SCHEMA or key == "items" and isinstance(value, dict):
            out[key] = _rewritten(value, where, close)
        elif key in _SCHEMA_LIST or key == "items" and isinstance(value, list):
            # allOf's branches are intersected by llguidance: none of them is closed.
            branch_close = close and key != "allOf"
            out[key] = ([_rewritten(v, where, branch_close) for v in value]
                        if isinstance(value, list) else value)
        elif key in _SCHEMA_MAP or key == "dependencies":
            out[key] = ({name: _rewritten(v, where, close) for name, v in value.items()}
                        if isinstance(value, dict) else value)
        else:
            out[key] = value
    declares = "properties" in schema or "patternProperties" in schema
    if close and declares and "additionalProperties" not in schema and "allOf" not in schema:
        out["additionalProperties"] = False
    return out
