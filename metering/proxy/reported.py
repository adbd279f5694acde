"""What an upstream reported: token usage, finish reason, id and delivered text, read out of
its responses.

Upstreams are not trusted to be well formed: every reader here tolerates missing
fields, nulls, wrong types and garbage, and never raises.

Every count is parsed with bounds. A count is a JSON integer (``bool`` is an ``int``
subclass and is refused explicitly; a float only when it is integral, e.g. ``12.0``)
from 0 to ``COUNT_CEILING``. A count above the ceiling is kept at the ceiling, so no
column can overflow; anything else (a string, a negative or fractional number) is
invalid. Then the counts are checked against each other (cached and the other prompt
details within prompt_tokens, each completion detail within completion_tokens). What
was found is the usage's ``anomaly``, a short reason code; usage whose prompt or
completion count is invalid or missing is not ``usable`` and the ledger estimates
instead. The checks against what the request allowed are the ledger's (metering.ledger.charge).
"""

import json
import re
from typing import Any

import orjson

from metering.ledger.charge import (
    CACHED_ABOVE_PROMPT,
    COUNT_ABOVE_CEILING,
    DETAILS_ABOVE_COMPLETION,
    DETAILS_ABOVE_PROMPT,
    INVALID_COUNT,
    INVALID_DETAIL,
    MISSING_COUNT,
    Usage,
    first_anomaly,
)
from metering.ledger.event import DETAIL_FIELDS
from metering.proxy.estimate import TextTokens

COUNT_CEILING = 10**9  # tokens in one count: far above any model's context or output

_MAX_PROMPT_DETAILS = 32  # prompt_tokens_details entries looked at


def parse_count(value: Any) -> tuple[int | None, str | None]:
    """(count, anomaly) of one reported count: None (not reported) gives (None, None); a count
    above the ceiling is kept at the ceiling; anything not a whole number >= 0 is invalid."""
    if value is None:
        return None, None
    if type(value) is float and value.is_integer():  # inf and nan are not integers
        value = int(value)
    if type(value) is not int or value < 0:
        return None, INVALID_COUNT
    if value > COUNT_CEILING:
        return COUNT_CEILING, COUNT_ABOVE_CEILING
    return value, None


def _detail(problem: str | None) -> str | None:
    """A detail's problem: an invalid detail is dropped, the usage is still used."""
    return INVALID_DETAIL if problem == INVALID_COUNT else problem


def usage_from_json(obj: Any) -> Usage | None:
    """A ``usage`` object as Usage, its anomaly found; None when it reports neither prompt nor
    completion."""
    if not isinstance(obj, dict):
        return None
    if obj.get("prompt_tokens") is None and obj.get("completion_tokens") is None:
        return None
    prompt, prompt_problem = parse_count(obj.get("prompt_tokens"))
    completion, completion_problem = parse_count(obj.get("completion_tokens"))
    if INVALID_COUNT in (prompt_problem, completion_problem):
        return Usage(anomaly=INVALID_COUNT)
    if prompt is None or completion is None:
        return Usage(anomaly=MISSING_COUNT)
    found = [prompt_problem, completion_problem]
    total, problem = parse_count(obj.get("total_tokens"))
    found.append(_detail(problem))
    cached = 0
    prompt_details = obj.get("prompt_tokens_details")
    if isinstance(prompt_details, dict):
        for i, (name, value) in enumerate(prompt_details.items()):
            if i == _MAX_PROMPT_DETAILS:
                break
            count, problem = parse_count(value)
            found.append(_detail(problem))
            if name == "cached_tokens":
                cached = count or 0
                if cached > prompt:
                    found.append(CACHED_ABOVE_PROMPT)
            elif count is not None and count > prompt:
                found.append(DETAILS_ABOVE_PROMPT)
    completion_details = obj.get("completion_tokens_details")
    if not isinstance(completion_details, dict):
        completion_details = {}
    details = {}
    for name in DETAIL_FIELDS:
        count, problem = parse_count(completion_details.get(name))
        found.append(_detail(problem))
        if count is not None and count > completion:
            found.append(DETAILS_ABOVE_COMPLETION)
        details[name] = count
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion if total is None else total,
        cached_tokens=cached,
        anomaly=first_anomaly(found),
        **details,
    )


def _bounded_int(text: str) -> int:
    """A JSON integer; one with more digits than Python converts (4300) stands for a number far
    above any ceiling (or below zero), so its document is still read."""
    if len(text) <= 4000:
        return int(text)
    return -1 if text.startswith("-") else COUNT_CEILING + 1


_LONG_TEXT = re.compile(r"[0-9]{19}")
_LONG_BYTES = re.compile(rb"[0-9]{19}")


def parse_json_object(data: str | bytes) -> dict[str, Any] | None:
    """The JSON object in ``data``; None if it is not valid JSON or not an object.

    Bytes that are not valid UTF-8 are read with the bad bytes replaced (U+FFFD): the usage of
    an answer with one broken character in its text is still found. An integer too long for
    Python to convert does not make the document unreadable (see _bounded_int).
    """
    # The fast parser reads strict UTF-8 JSON; anything else takes the path below, and so does
    # a run of 19 digits or more (the fast parser reads an integer beyond 64 bits as a float).
    if (
        _LONG_TEXT.search(data) is None
        if isinstance(data, str)
        else isinstance(data, bytes) and _LONG_BYTES.search(data) is None
    ):
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
        else:
            return obj if isinstance(obj, dict) else None
    try:
        obj = json.loads(data)
    except UnicodeDecodeError:
        assert not isinstance(data, str)  # only bytes are decoded
        return parse_json_object(data.decode("utf-8", "replace"))
    except (ValueError, TypeError, RecursionError):
        try:
            obj = json.loads(data, parse_int=_bounded_int)
        except (ValueError, TypeError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def is_usage_only_chunk(obj: dict[str, Any]) -> bool:
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


def _output_text(message: dict[str, Any]) -> list[str]:
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


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]


def _error(obj: dict[str, Any]) -> dict[str, Any] | None:
    error = obj.get("error")
    if isinstance(error, dict):
        return error
    if isinstance(error, str) and error:
        return {"message": error}
    return None


# What makes a stream event matter beyond its text: a non-null finish_reason, a usage object,
# an error; or an escape (\\u), which could spell any key. An event with none of these is read
# only if its text is ever needed (the usage cannot be used), and then in its turn. Two
# substring tests and two patterns that each start with a literal (which the regular
# expression engine finds by a fast scan): a third of the time of one alternation.
_FINISHED = re.compile(r'"finish_reason"\s*:\s*"').search
_USAGE = re.compile(r'"usage"\s*:\s*\{').search


def matters(data: str) -> bool:
    """Whether a stream event's data may hold more than text (see above)."""
    return (
        "\\u" in data
        or '"error"' in data
        or _FINISHED(data) is not None
        or _USAGE(data) is not None
    )


def _event_text(data: str) -> list[str]:
    """The generated text of one stream event's data (see StreamObserver)."""
    obj = parse_json_object(data)
    return _delta_text(obj) if obj is not None else []


def _delta_text(obj: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    for choice in _choices(obj):
        delta = choice.get("delta")
        # Legacy /v1/completions streams put the text on the choice itself.
        if isinstance(delta, dict):
            parts += _output_text(delta)
        if isinstance(text := choice.get("text"), str) and text:
            parts.append(text)
    return parts


class StreamObserver:
    """Reads the JSON of a chat completion stream's SSE data payloads.

    The delivered text is not kept: each part is counted as it comes (see TextTokens), so memory
    stays flat however long the stream runs. With `lazy`, an event that can only add text (the
    stream's id is known and it has no finish_reason, usage or error: most of a stream) is not
    parsed when it comes but handed to the count as it is, and parsed only if the count is asked
    for (bounded as the text is).
    """

    __slots__ = (
        "usage",
        "finish_reason",
        "upstream_id",
        "created",
        "model",
        "error",
        "lazy",
        "_tokens",
    )

    def __init__(self, lazy: bool = False) -> None:
        self.usage: Usage | None = None  # the last non-null usage seen
        self.finish_reason: str | None = None  # the last non-null finish_reason seen
        self.upstream_id: str | None = None  # the first non-empty id seen
        # The stream's `created` and `model`, from the first chunk that has them, read until
        # the id is known (for a chunk of the proxy's own: metering.proxy.usage_chunk).
        self.created: int | None = None
        self.model: str | None = None
        self.error: dict[str, Any] | None = None  # the error object, if an error event came
        self.lazy = lazy
        self._tokens = TextTokens()

    def observe(self, data: str | None) -> dict[str, Any] | None:
        """Take one event's data; returns the parsed object so callers parse it once (None for
        an event read lazily).

        None and the ``[DONE]`` sentinel are ignored (and return None).
        """
        if data is None or data == "[DONE]":
            return None
        if self.lazy and self.upstream_id is not None and not matters(data):
            self._tokens.add_later(data, _event_text)
            return None
        obj = parse_json_object(data)
        if obj is None:
            return None
        if self.upstream_id is None:
            upstream_id = obj.get("id")
            if isinstance(upstream_id, str) and upstream_id:
                self.upstream_id = upstream_id
            if self.model is None:
                model, created = obj.get("model"), obj.get("created")
                if isinstance(model, str) and model:
                    self.model = model
                if type(created) is int and 0 <= created < 2**53:
                    self.created = created
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
        for part in _delta_text(obj):
            self._tokens.add(part)
        return obj

    def delivered_tokens(self) -> int:
        """Estimated tokens of the generated text delivered so far (content, reasoning, tool
        calls), as estimate_text_tokens would give for all of it."""
        return self._tokens.total()


def summarize_completion(body: bytes) -> tuple[Usage | None, str | None, str | None, int]:
    """(usage, finish_reason, upstream id, estimated tokens of the generated text) of a
    non-streaming response.

    finish_reason is choice 0's, or else the last non-null one. Garbage gives
    ``(None, None, None, 0)``.
    """
    return summarize_object(parse_json_object(body))


def summarize_object(
    obj: dict[str, Any] | None, *, count: bool = True
) -> tuple[Usage | None, str | None, str | None, int]:
    """summarize_completion of a body already parsed (parse_json_object); without `count`, the
    generated text's tokens are not estimated (0): only an answer whose usage cannot be used
    needs them."""
    if obj is None:
        return None, None, None, 0
    upstream_id = obj.get("id")
    if not isinstance(upstream_id, str) or not upstream_id:
        upstream_id = None
    choices = _choices(obj)
    tokens = TextTokens()
    for choice in choices if count else ():
        message = choice.get("message")
        if isinstance(message, dict):
            for part in _output_text(message):
                tokens.add(part)
        if isinstance(text := choice.get("text"), str):
            tokens.add(text)
    reasons = [r for c in choices if isinstance(r := c.get("finish_reason"), str) and r]
    first = choices[0].get("finish_reason") if choices else None
    finish_reason = (
        first if isinstance(first, str) and first else (reasons[-1] if reasons else None)
    )
    return usage_from_json(obj.get("usage")), finish_reason, upstream_id, tokens.total()
