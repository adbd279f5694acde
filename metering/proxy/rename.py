"""The model name a client sees, for a provider whose catalog entry says `response_model =
"requested"`: the value of the `model` member of an answer's top-level object (a body, or each
stream chunk) becomes the name the client asked for; every other byte stays as the upstream
sent it. The default, `upstream`, touches nothing.

The member is found in one match when the members ahead of it are all strings, numbers or
literals (`id`, `object`, `created`: what OpenAI-compatible upstreams send ahead of `choices`),
which are then all top-level; otherwise by a scan that steps from string to bracket with one
regular expression (strings skipped whole, in C), counting depth so that only the top-level
object's member matches. Either stops at that member: about 1.5 microseconds a chunk."""

import json
import re

from metering.proxy.attempt import Attempt

_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
# A JSON string (escapes included), or one bracket.
_TOKEN = re.compile(_STRING + rb"|[{}\[\]]")
# After a key: the colon and a string value (the one to replace).
_STRING_VALUE = re.compile(rb"\s*:\s*(" + _STRING + rb")")
# The common case in one match: the object's opening, members whose values are strings, numbers
# or literals (so all of them top-level), then `model` and its string value.
_SCALAR_MEMBER = _STRING + rb"\s*:\s*(?:" + _STRING + rb"|[-+.0-9eE]+|true|false|null)\s*,\s*"
_LEADING = re.compile(rb"\{\s*(?:" + _SCALAR_MEMBER + rb')*?"model"\s*:\s*(' + _STRING + rb")")
_KEY = b'"model"'
_QUOTE = ord('"')
_OPENING = frozenset(b"{[")


def requested_model(attempt: Attempt) -> bytes | None:
    """The name to write into answers, as a JSON string; None to leave them as they came."""
    if attempt.provider.response_model != "requested":
        return None
    return json.dumps(attempt.chat.model).encode()


def with_model(data: bytes, name: bytes) -> bytes:
    """`data` (a JSON object, or an SSE event carrying one) with the string value of its
    top-level object's `model` member replaced by `name` (a JSON string); `data` itself when
    it has no such member."""
    start = data.find(b"{")  # past an SSE event's field names
    if start < 0:
        return data
    leading = _LEADING.match(data, start)
    if leading is not None:
        return data[: leading.start(1)] + name + data[leading.end(1) :]
    depth = 0
    for token in _TOKEN.finditer(data, start):
        first = data[token.start()]
        if first == _QUOTE:
            if depth == 1 and token.group() == _KEY:
                value = _STRING_VALUE.match(data, token.end())
                if value is not None:
                    return data[: value.start(1)] + name + data[value.end(1) :]
        elif first in _OPENING:
            depth += 1
        else:
            depth -= 1
            if depth <= 0:  # the top-level object ended
                return data
    return data
