"""Who a request was made for and what it was for: its end user and its tags, checked as the
contract bounds them and kept on the event (and the hold) in one canonical form.

The proxy reads them from a request's headers and body, POST /v1/events from each event; both
refuse what is out of bounds with a 400 (or the event's rejection) naming the field it came in.
Tags are kept as compact JSON text of an object of strings, its keys sorted, so that equal tags
are equal text; NO_TAGS when there are none (the common case costs nothing)."""

import re
from typing import Any

import orjson

from metering.errors import InvalidRequest

MAX_END_USER_CHARS = 256
MAX_TAGS = 16  # OpenAI's bounds on `metadata`
MAX_TAG_KEY_CHARS = 64
MAX_TAG_VALUE_CHARS = 512
NO_TAGS = "{}"


# What an end user may not hold: control characters (C0, DEL, C1), line and paragraph
# separators, and the invisible ones that make two ids look alike (zero-width characters, bidi
# controls, word joiners, the byte-order mark). END_USER_PATTERN is the rule: the check below and
# /openapi.json's declaration of every end user (header, body, path, query) are the same text.
_NOT_IN_END_USER = (
    "\\x00-\\x1f\\x7f-\\x9f\\u00ad\\u200b-\\u200f\\u2028-\\u202e\\u2060-\\u2064"
    "\\u2066-\\u206f\\ufeff"
)
END_USER_PATTERN = f"^[^{_NOT_IN_END_USER}]{{1,{MAX_END_USER_CHARS}}}$"
# A report's `tag=<key>:<value>` filter (split at the first colon), as /openapi.json declares it.
TAG_FILTER_PATTERN = f"^[^:\\x00-\\x1f\\x7f]{{1,{MAX_TAG_KEY_CHARS}}}:[^\\x00-\\x1f\\x7f]{{0,{MAX_TAG_VALUE_CHARS}}}$"
_END_USER = re.compile(END_USER_PATTERN)


def end_user(value: object, param: str) -> str:
    """An end user as sent in `param`: 1 to 256 characters, none of them invisible (above)."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{param} must be a string", param=param)
    if not 1 <= len(value) <= MAX_END_USER_CHARS:
        raise InvalidRequest(
            f"{param} must be 1 to {MAX_END_USER_CHARS} characters (got {len(value)})",
            param=param,
        )
    if _END_USER.fullmatch(value) is None:
        raise InvalidRequest(
            f"{param} must not hold control, line-break, zero-width or bidi-control characters",
            param=param,
        )
    return value


def tags(value: object, param: str) -> dict[str, str]:
    """Tags as sent in `param`: an object of at most 16 pairs, keys of 1 to 64 characters,
    values strings of at most 512."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON object of string values", param=param)
    if len(value) > MAX_TAGS:
        raise InvalidRequest(
            f"{param} may hold at most {MAX_TAGS} pairs (got {len(value)})", param=param
        )
    for key, item in value.items():
        _pair(key, item, param)
    return value


def _pair(key: Any, item: object, param: str) -> None:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_TAG_KEY_CHARS:
        raise InvalidRequest(
            f"{param}: each key must be 1 to {MAX_TAG_KEY_CHARS} characters (got "
            f"{len(key) if isinstance(key, str) else type(key).__name__})",
            param=param,
        )
    # NUL is no text PostgreSQL keeps (nor reads back as JSON): refused, as in every field.
    if "\x00" in key:
        raise InvalidRequest(f"{param}: a key must not hold NUL", param=param)
    if not isinstance(item, str):
        raise InvalidRequest(f"{param}[{key!r}] must be a string (got {_kind(item)})", param=param)
    if len(item) > MAX_TAG_VALUE_CHARS:
        raise InvalidRequest(
            f"{param}[{key!r}] must be at most {MAX_TAG_VALUE_CHARS} characters (got {len(item)})",
            param=param,
        )
    if "\x00" in item:
        raise InvalidRequest(f"{param}[{key!r}] must not hold NUL", param=param)


def _kind(value: object) -> str:
    """A JSON value's kind, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def header_text(value: str, param: str) -> str:
    """A header's value as the UTF-8 text a client sent (the server reads header bytes as
    Latin-1)."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise InvalidRequest(f"{param} must be UTF-8 text", param=param) from None


def tags_header(text: str, param: str) -> dict[str, str]:
    """Tags sent as a header: the text of a JSON object."""
    try:
        value = orjson.loads(header_text(text, param))
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            f"{param} must be a JSON object: it is not valid JSON", param=param
        ) from None
    return tags(value, param)


def merged(base: dict[str, str], over: dict[str, str], param: str) -> dict[str, str]:
    """`over`'s tags on top of `base`'s, key by key; the result within the bounds too (a merge
    past 16 pairs names `param`, the one that added the pairs)."""
    both = {**base, **over}
    if len(both) > MAX_TAGS:
        raise InvalidRequest(
            f"{param} and metadata together hold {len(both)} tags: at most {MAX_TAGS}",
            param=param,
        )
    return both


def encode(value: dict[str, str]) -> str:
    """Tags as the event keeps them: compact JSON, keys sorted; NO_TAGS for none."""
    if not value:
        return NO_TAGS
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
