"""The OpenAI-compatible request bodies the server takes, with every field's type enforced.

Parsing is strict: a string where a number belongs, a number where a list belongs, or `1` for a
boolean is refused, never coerced, because a benchmark that silently reads `"max_tokens": "8"` as
something else measures the wrong thing. Values are held to the ranges OpenAI documents
(temperature 0..2, at most 4 stop strings, the five chat roles). OpenAI fields this server does not
implement (`logprobs`, `tools`, `logit_bias`, ... in UNSUPPORTED) are refused by name unless they
carry their no-op value (`"logprobs": false`), because a client that asked for them would otherwise
get a reply that silently lacks them; other unknown fields are ignored (clients send many we do not
use). A refusal is a `BadRequest` naming the field (`messages[0].content`) and what is wrong; the
server turns it into HTTP 400 (404 for an unknown model).

The JSON itself is read before any field is: a lone surrogate (escaped, or its raw bytes), nesting
past MAX_DEPTH, an integer of more than MAX_INT_DIGITS digits or a NaN is refused naming where it
is, so no such value reaches the tokenizer, pydantic or the chat template (each would fail with an
exception that is not a refusal).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_DEPTH = 32  # OpenAI's fields need 5 levels (messages[i].content[j].text); templates' kwargs a few more
MAX_INT_DIGITS = 32  # seeds (below 2**64) have 20 digits; a longer integer fits no field
MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_TOP_K = 1 << 20  # past any vocabulary this server loads (a larger top_k would filter nothing anyway)
ROLES = ("system", "user", "assistant", "tool", "developer")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadRequest(ValueError):
    """A request the server refuses with HTTP `status` (400 unless said); `param` names the field
    (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400,
                 **extra: Any):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.extra = message, param, code, status, extra

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
    role: Literal[ROLES]  # what chat templates render; a template given another role may render it silently
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


# OpenAI fields (and the sampling extras of vLLM and llama.cpp's servers) this server does not act on,
# each with the values that ask for nothing; any other value is refused naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "verbosity": (None,), "repetition_penalty": (None, 1, 1.0), "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
    "stop_token_ids": (None, []), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "grammar": (None, ""), "json_schema": (None,),
}


class _Generation(_Strict):
    """The sampling and reply fields shared by completions and chat completions."""

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED
    model: str | None = None  # None or absent: the one model served (server.py's Served.read checks the id)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # 0 or -1: no top-k
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
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
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

    @property
    def limit_param(self) -> str | None:
        """The field `limit` came from, for refusals that name it."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None


class TokenizeRequest(_Strict):
    """Exactly one of `prompt` (tokenized as a completion prompt is) or `messages` (the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" (a string) or "messages" (a list)')
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=BaseModel)


def parse(model: type[Body], raw: bytes) -> Body:
    """The request body as `model`, or BadRequest naming the first field that is wrong."""
    data = read_json(raw)
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    for name, noop in getattr(model, "unsupported", {}).items():
        if name in data and not any(type(data[name]) is type(v) and data[name] == v for v in noop):
            raise BadRequest(f"{name}: not supported by this server (send it as {json.dumps(noop[-1])} or leave it "
                             f"out)", name, "unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _bad_request(err) from None


class _HugeInt:
    """An integer literal too long to hold: read_json names where it is."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _constant(name: str) -> Any:
    raise BadRequest(f"the body is not valid JSON ({name} is not a JSON number)", code="invalid_json")


def read_json(raw: bytes) -> Any:
    """The body's JSON value, refused whole (not valid UTF-8 outside strings, not JSON, deeper than
    json's own recursion limit, NaN) or at the value at fault (too deep, a lone surrogate, a huge integer).
    Invalid UTF-8 inside a string becomes lone surrogates (surrogateescape), so raw surrogate bytes are
    refused naming their field just as their escaped form is."""
    try:
        data = json.loads(raw.decode("utf-8", "surrogateescape"), parse_constant=_constant,
                          parse_int=lambda s: int(s) if len(s.lstrip("-")) <= MAX_INT_DIGITS else _HugeInt(len(s)))
    except json.JSONDecodeError as err:
        raise BadRequest(f"the body is not valid JSON ({err})", code="invalid_json") from None
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:  # iterative: a recursive walk would itself hit the recursion limit
        value, loc = stack.pop()
        if len(loc) > MAX_DEPTH:
            raise _at(loc, f"nests deeper than {MAX_DEPTH} levels", "invalid_json")
        if isinstance(value, str) and _SURROGATE.search(value):
            raise _at(loc, "contains a lone surrogate or bytes that are not UTF-8", "invalid_value")
        if isinstance(value, _HugeInt):
            raise _at(loc, f"an integer of {value.digits} digits is out of range", "invalid_value")
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    raise _at(loc, "a key contains a lone surrogate or bytes that are not UTF-8", "invalid_value")
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))
    return data


def _at(loc: tuple[str | int, ...], what: str, code: str) -> BadRequest:
    param = _path(loc) or None
    return BadRequest(f"{param}: {what}" if param else f"the body {what}", param, code)


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
