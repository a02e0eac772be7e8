"""Tool calls: the request models, rendering tools into the prompt, and what a tool choice forces.

    tools        [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice  "none" | "auto" | "required" | {"type": "function", "function": {"name"}}

Rendering: a chat template that mentions `tools` gets them as transformers passes them
(`tools=[...]`, assistant `tool_calls` with `arguments` as an object, `tool` messages with
`tool_call_id`). A template that does not (SmolLM2's) gets them through the tool-call parser's
own format (tool_parsers.py): the tool definitions appended to the system prompt, earlier calls
written into the assistant turns, and tool results as user turns.

Enforcement: "required" and a named function compile, through the parser, to a grammar whose
only outputs are well-formed calls whose arguments follow the function's JSON schema (nested
definitions resolved, undeclared keys refused unless the function says `"strict": false`:
tool_schemas.py); "auto" leaves the model free and the parser reads whatever calls it wrote;
"none" parses nothing (the tools are still rendered, as OpenAI does).

History: an assistant turn's call arguments are JSON text; JSON past bounded_json's bounds is a
400 naming the field, text that is not JSON goes to the template as it is.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from microserve import bounded_json
from microserve.bounded_json import JSONBoundsError


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: the function takes no arguments
    # A forced call's arguments follow the schema either way; false: objects that do not say
    # otherwise take undeclared keys (tool_schemas.py)
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _bounded(cls, value: str) -> str:
        """JSON past bounded_json's bounds is refused (a 400 naming the field); text that is
        not JSON at all goes to the template as it is."""
        try:
            bounded_json.loads(value)
        except JSONBoundsError as e:
            raise ValueError(str(e)) from None
        except json.JSONDecodeError:
            pass
        return value


class AssistantToolCall(BaseModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def arguments(self) -> dict | str:
        """The arguments as an object (what templates expect), or the text if it is not one."""
        try:
            value = bounded_json.loads(self.function.arguments)  # within bounds: validated
        except json.JSONDecodeError:
            return self.function.arguments
        return value if isinstance(value, dict) else self.function.arguments

    def template_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.arguments()}}


def forced_functions(tools: list[Tool], choice: ToolChoice | None) -> list[FunctionDefinition]:
    """The functions the output must call one of: none unless the choice forces a call."""
    if choice == "required":
        return [tool.function for tool in tools]
    if isinstance(choice, NamedToolChoice):
        return [tool.function for tool in tools if tool.function.name == choice.function.name]
    return []


def forces_calls(choice: ToolChoice | None) -> bool:
    """Whether the output is forced to be calls (a grammar allows nothing else)."""
    return choice == "required" or isinstance(choice, NamedToolChoice)


def parses_calls(tools: list[Tool] | None, choice: ToolChoice | None) -> bool:
    """Whether the output is read for tool calls: tools given and the choice is not "none"."""
    return bool(tools) and choice != "none"
