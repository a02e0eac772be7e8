"""The field types the messages share, and the check where a message enters from outside."""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import ConfigDict, Field, TypeAdapter, with_config

from microserve.bounds import INT32_MAX, INT64_MAX, INT64_MIN, TokenId


T = TypeVar("T")

# Where a message enters from outside: unknown fields and Infinity/NaN are refused.
CHECKED = with_config(ConfigDict(extra="forbid", allow_inf_nan=False))


def validator(message: type[T]) -> TypeAdapter[T]:
    """The pydantic validator of `message` for a body from outside (`.validate_json(raw)`,
    `.validate_python(obj)`); raises pydantic.ValidationError naming the field."""
    return TypeAdapter(message)


RequestId = Annotated[str, Field(min_length=1, max_length=256)]
CHANNEL_ID = r"^[A-Za-z0-9_-]{1,64}$"
ChannelId = Annotated[str, Field(pattern=CHANNEL_ID)]
Prompt = Annotated[list[TokenId], Field(min_length=1)]
Slot = Annotated[int, Field(ge=0, le=INT64_MAX)]  # checked against the receiver's pool
Position = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowIndex = Annotated[int, Field(ge=0, le=INT32_MAX)]
WindowTag = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]  # the window's secret
