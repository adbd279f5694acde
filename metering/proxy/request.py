"""Reading and validating a chat completion request before it can cost anything."""

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import orjson
from fastapi import Request

from metering.budgets.ceilings import END_USER, TAGS
from metering.errors import InvalidRequest, TooLarge
from metering.ledger import attribution as attributed
from metering.text import first_problem

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_MESSAGES = 100_000
MAX_CHOICES = 16
MAX_MODEL_CHARS = 256
MAX_TOKENS = 10_000_000  # max_tokens' and max_completion_tokens' bound
# Control characters in a model name: NUL cannot be stored by PostgreSQL, none is a name.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


@dataclass(slots=True)
class ChatRequest:
    body: dict[str, Any]
    size: int  # bytes of the body as received
    model: str
    stream: bool
    wants_usage: bool  # the client asked for stream_options.include_usage
    max_tokens: int | None
    choices: int
    # A Responses API request bridged to chat (metering.proxy.responses.answer.Bridge): its
    # answer is written in Responses terms. None: a chat completion, answered as it came.
    bridge: Any = None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("request body is empty: send a JSON object")
    # The fast parser reads strict RFC 8259 UTF-8 JSON. What it refuses (a BOM, NaN, a lone
    # surrogate escape, deep nesting) takes the path below, which accepts or refuses it, with
    # its message, as before; so does a body with a run of 19 digits or more, since the fast
    # parser reads an integer beyond 64 bits as a float.
    if _LONG_DIGITS.search(raw) is None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        else:
            if not isinstance(body, dict):
                raise InvalidRequest("request body must be a JSON object")
            return body
    try:
        # JSON on the wire is UTF-8 (RFC 8259); json.loads would also guess UTF-16 and -32.
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    # JSON's escapes can spell a lone surrogate (\ud800), which the fast parser refuses: no
    # text to look up, record or send upstream. Refused here, naming the field, before any hold.
    bad = first_problem(body, controls=False)
    if bad is not None:
        raise InvalidRequest(str(bad), param=bad.where or None)
    return body


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        # 5.0 is the JSON number 5 (an `integer` to JSON Schema): sent on as 5
        value = body[key] = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer", param=key)
    if not low <= value <= high:
        raise InvalidRequest(f"{key} must be between {low} and {high}", param=key)
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{key} must be a number", param=key)
    # An int compares with the bounds exactly; math.isfinite would convert it to a float and
    # overflow on one of 309 digits or more.
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(f"{key} must be a number", param=key)
    if not low <= value <= high:
        raise InvalidRequest(f"{key} must be between {low:g} and {high:g}", param=key)


def _content(message: dict[str, Any], i: int) -> None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(
            f"messages[{i}].content must be a string or a list of parts",
            param=f"messages.{i}.content",
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(
                f"messages[{i}].content[{j}] must be an object with a type",
                param=f"messages.{i}.content.{j}",
            )


def _messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"messages may hold at most {MAX_MESSAGES} entries", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param=f"messages.{i}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}",
                param=f"messages.{i}.role",
            )
        _content(message, i)
        if "name" in message and not isinstance(message["name"], str):
            raise InvalidRequest(f"messages[{i}].name must be a string", param=f"messages.{i}.name")


def validate(body: dict[str, Any], size: int) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequest("model is required and must be a string", param="model")
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequest(
            f"model name is longer than {MAX_MODEL_CHARS} characters", param="model"
        )
    if _CONTROL.search(model):
        raise InvalidRequest("model name must not contain control characters", param="model")
    _messages(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    wants_usage = bool(options and options.get("include_usage") is True)
    if options and "include_usage" in options and not isinstance(options["include_usage"], bool):
        raise InvalidRequest(
            "stream_options.include_usage must be a boolean", param="stream_options"
        )
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS)
    max_completion = _int(body, "max_completion_tokens", 1, MAX_TOKENS)
    if max_tokens is not None and max_completion is not None:
        raise InvalidRequest(
            "send max_tokens or max_completion_tokens, not both", param="max_tokens"
        )
    choices = _int(body, "n", 1, MAX_CHOICES) or 1
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    _number(body, "presence_penalty", -2, 2)
    _number(body, "frequency_penalty", -2, 2)
    return ChatRequest(
        body=body,
        size=size,
        model=model,
        stream=stream,
        wants_usage=wants_usage,
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        choices=choices,
    )


def attribution(headers: Mapping[str, str], body: dict[str, Any]) -> tuple[str | None, str]:
    """The request's end user (the header, else `user`, else `safety_identifier`: each one sent
    is checked) and its tags (`metadata` with the header's on top, key by key), checked before
    anything is held. A request with none of them reads four keys and parses nothing."""
    end_user: str | None = None
    sent = headers.get(END_USER)
    if sent is not None:
        end_user = attributed.end_user(attributed.header_text(sent, END_USER), END_USER)
    for field in ("user", "safety_identifier"):
        value = body.get(field)
        if value is not None:
            value = attributed.end_user(value, field)
            end_user = end_user or value
    metadata = body.get("metadata")
    tagged = headers.get(TAGS)
    if metadata is None and tagged is None:
        return end_user, attributed.NO_TAGS
    tags = attributed.tags(metadata, "metadata") if metadata is not None else {}
    if tagged is not None:
        tags = attributed.merged(tags, attributed.tags_header(tagged, TAGS), TAGS)
    return end_user, attributed.encode(tags)
