"""The OpenAI-compatible request bodies the server takes, with every field's type enforced.

Parsing is strict: a string where a number belongs, a number where a list belongs, or `1` for a
boolean is refused, never coerced, because a benchmark that silently reads `"max_tokens": "8"` as
something else measures the wrong thing. Unknown fields are ignored (clients send many we do not
use). A refusal is a `BadRequest` naming the field (`messages[0].content`) and what is wrong; the
server turns it into HTTP 400.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; `param` names the field (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", **extra: Any):
        super().__init__(message)
        self.message, self.param, self.code, self.extra = message, param, code, extra

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code, **self.extra}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    """One chat message; extra keys (name, tool_calls, ...) reach the chat template as sent."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        """Content as a string, or OpenAI's list of {"type": "text", "text": ...} parts joined."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
        ):
            return "".join(p["text"] for p in value)
        raise ValueError('must be a string or a list of {"type": "text", "text": string} parts')


class _Generation(_Strict):
    """The sampling and reply fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no top-k
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = Field(1, ge=1, le=1)
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    draft: bool = True
    return_token_ids: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return items or None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Generation):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _text_or_ids(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            return value
        raise ValueError("must be a string or a list of token ids (integers)")


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """Exactly one of `prompt` (tokenized as a completion prompt is) or `messages` (the chat template)."""

    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" (a string) or "messages" (a list)')
        return self


class DetokenizeRequest(_Strict):
    tokens: list[int]


Body = TypeVar("Body", bound=BaseModel)


def parse(model: type[Body], raw: bytes) -> Body:
    """The request body as `model`, or BadRequest naming the first field that is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _bad_request(err) from None


def _bad_request(err: ValidationError) -> BadRequest:
    first = err.errors(include_url=False)[0]
    param = _path(first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    kind = first["type"]
    code = "missing_field" if kind == "missing" else "invalid_type" if kind.endswith("_type") else "invalid_value"
    if kind != "missing" and "input" in first and not isinstance(first["input"], (dict, list)):
        message += f" (got {json.dumps(first['input'])[:80]})"
    return BadRequest(f"{param}: {message}" if param else message, param, code)


def _path(loc: tuple[str | int, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
