"""The chat completion request's rules (metering.proxy.request's checks) as the JSON Schema of
its fields in /openapi.json: a request the document takes is one `validate` takes."""

from typing import Any

from metering.proxy.request import MAX_CHOICES, MAX_MESSAGES, MAX_MODEL_CHARS, MAX_TOKENS, ROLES

# A name with something besides spaces in it, and no control character (`validate`'s model).
NAME_PATTERN = r"^[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"


def _whole(low: int, high: int) -> dict[str, Any]:
    return {"type": ["integer", "null"], "minimum": low, "maximum": high}


def _number(low: float, high: float) -> dict[str, Any]:
    return {"type": ["number", "null"], "minimum": low, "maximum": high}


_PART = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}}}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": sorted(ROLES)},
        "content": {
            "anyOf": [{"type": ["string", "null"]}, {"type": "array", "items": _PART}],
            "description": "text, or a list of parts (each an object with a `type`)",
        },
        "name": {"type": "string"},
    },
}
FIELDS: dict[str, Any] = {
    "model": {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_MODEL_CHARS,
        "pattern": NAME_PATTERN,
    },
    "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": MESSAGE},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "max_tokens": _whole(1, MAX_TOKENS),
    "max_completion_tokens": _whole(1, MAX_TOKENS),
    "n": _whole(1, MAX_CHOICES),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
}
# max_tokens and max_completion_tokens, both sent and neither null: refused.
EXCLUSIVE: dict[str, Any] = {
    "not": {
        "required": ["max_tokens", "max_completion_tokens"],
        "properties": {
            "max_tokens": {"type": "integer"},
            "max_completion_tokens": {"type": "integer"},
        },
    }
}
