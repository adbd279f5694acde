"""Reading token usage, finish reason and delivered text out of upstream responses.

Upstreams are not trusted to be well formed: every reader here tolerates missing
fields, nulls, wrong types and garbage, and never raises. A count is accepted
only as a non-negative ``int`` (``bool`` is an ``int`` subclass, so it is
excluded explicitly); anything else is treated as "not reported".
"""

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Usage",
    "StreamObserver",
    "usage_from_json",
    "parse_json_object",
    "is_usage_only_chunk",
    "summarize_completion",
]

_DETAIL_FIELDS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # prompt_tokens_details.cached_tokens, within [0, prompt_tokens]
    # completion_tokens_details.*; None when the upstream did not report the field.
    text_tokens: int | None = None
    reasoning_tokens: int | None = None
    audio_tokens: int | None = None
    image_tokens: int | None = None
    video_tokens: int | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def usage_from_json(obj: Any) -> Usage | None:
    """A ``usage`` object as Usage; None when it reports neither prompt nor completion."""
    if not isinstance(obj, dict):
        return None
    prompt = _count(obj.get("prompt_tokens"))
    completion = _count(obj.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    prompt = prompt or 0
    completion = completion or 0
    total = _count(obj.get("total_tokens"))
    prompt_details = obj.get("prompt_tokens_details")
    cached = None
    if isinstance(prompt_details, dict):
        cached = _count(prompt_details.get("cached_tokens"))
    completion_details = obj.get("completion_tokens_details")
    if not isinstance(completion_details, dict):
        completion_details = {}
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion if total is None else total,
        cached_tokens=min(cached or 0, prompt),
        **{name: _count(completion_details.get(name)) for name in _DETAIL_FIELDS},
    )


def parse_json_object(data: str | bytes) -> dict | None:
    """The JSON object in ``data``; None if it is not valid JSON or not an object."""
    try:
        obj = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def is_usage_only_chunk(obj: dict) -> bool:
    """The trailing chunk that only carries usage (``stream_options.include_usage``).

    A client that did not ask for it must not receive it: OpenAI SDKs index
    ``choices[0]`` of every chunk.
    """
    choices = obj.get("choices")
    return obj.get("usage") is not None and (choices is None or choices == [])


def _block_text(content: Any) -> str:
    """Text of message content: a string, or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _output_text(message: dict) -> list[str]:
    """Generated text of a message or delta: what completion tokens pay for.

    Beyond content and reasoning this includes refusals and tool-call names and
    arguments, which are model output too and dominate some responses.
    """
    parts = [_block_text(message.get("content"))]
    # Some providers send the same reasoning under both names; count it once.
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = message.get("reasoning")
    if isinstance(reasoning, str):
        parts.append(reasoning)
    refusal = message.get("refusal")
    if isinstance(refusal, str):
        parts.append(refusal)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                parts += [v for k in ("name", "arguments") if isinstance(v := function.get(k), str)]
    return [p for p in parts if p]


def _choices(obj: dict) -> list[dict]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def _error(obj: dict) -> dict | None:
    error = obj.get("error")
    if isinstance(error, dict):
        return error
    if isinstance(error, str) and error:
        return {"message": error}
    return None


class StreamObserver:
    """Reads the JSON of each SSE data payload of a chat completion stream."""

    __slots__ = (
        "usage",
        "finish_reason",
        "upstream_id",
        "error",
        "delivered_chars",
        "chunks",
        "malformed",
        "_text",
    )

    def __init__(self) -> None:
        self.usage: Usage | None = None  # the last non-null usage seen
        self.finish_reason: str | None = None  # the last non-null finish_reason seen
        self.upstream_id: str | None = None  # the first non-empty id seen
        self.error: dict | None = None  # the error object, if an error event came
        self.delivered_chars = 0  # characters of generated text delivered so far
        self.chunks = 0  # data payloads parsed as JSON objects
        self.malformed = 0  # data payloads that were not JSON objects
        self._text: list[str] = []

    def observe(self, data: str | None) -> dict | None:
        """Take one event's data; returns the parsed object so callers parse it once.

        None and the ``[DONE]`` sentinel are ignored (and return None).
        """
        if data is None or data == "[DONE]":
            return None
        obj = parse_json_object(data)
        if obj is None:
            if data.strip() != "[DONE]":
                self.malformed += 1
            return None
        self.observe_object(obj)
        return obj

    def observe_object(self, obj: dict) -> None:
        """Like observe, for a payload the caller already parsed."""
        self.chunks += 1
        if self.upstream_id is None:
            upstream_id = obj.get("id")
            if isinstance(upstream_id, str) and upstream_id:
                self.upstream_id = upstream_id
        error = _error(obj)
        if error is not None:
            self.error = error
        usage = usage_from_json(obj.get("usage"))
        if usage is not None:
            self.usage = usage
        for choice in _choices(obj):
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason
            delta = choice.get("delta")
            # Legacy /v1/completions streams put the text on the choice itself.
            parts = _output_text(delta) if isinstance(delta, dict) else []
            if isinstance(text := choice.get("text"), str) and text:
                parts.append(text)
            for part in parts:
                self._text.append(part)
                self.delivered_chars += len(part)

    def delivered_text(self) -> str:
        """All generated text delivered so far (content, reasoning, tool calls)."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""


def summarize_completion(body: bytes) -> tuple[Usage | None, str | None, str | None, str]:
    """(usage, finish_reason, upstream id, generated text) of a non-streaming response.

    finish_reason is choice 0's, or else the last non-null one. Garbage gives
    ``(None, None, None, "")``.
    """
    obj = parse_json_object(body)
    if obj is None:
        return None, None, None, ""
    upstream_id = obj.get("id")
    if not isinstance(upstream_id, str) or not upstream_id:
        upstream_id = None
    choices = _choices(obj)
    texts: list[str] = []
    for choice in choices:
        message = choice.get("message")
        if isinstance(message, dict):
            texts += _output_text(message)
        if isinstance(text := choice.get("text"), str):
            texts.append(text)
    reasons = [r for c in choices if isinstance(r := c.get("finish_reason"), str) and r]
    first = choices[0].get("finish_reason") if choices else None
    finish_reason = (
        first if isinstance(first, str) and first else (reasons[-1] if reasons else None)
    )
    return usage_from_json(obj.get("usage")), finish_reason, upstream_id, "".join(texts)
