"""NVIDIA NIM (docs/dialects.md, "NVIDIA NIM").

NIM's OpenAPI schema closes both the request and each message (additionalProperties:
false), so the body sent up is built from what the schema allows, never copied: model,
messages (role and content only), temperature 0..1, top_p in (0, 1], frequency and
presence penalties -2..2, max_tokens 1..16384, stream and stop. Its role enum is user and
assistant: a first system (or developer) message is folded into the first user message.
Text parts are joined into the string content the schema wants. Fields that change nothing
in the answer (`stream_options`, `user`, `seed`, ...) are left out; any other field is
refused before anything is spent. With no `stream_options`, NIM streams carry no usage:
streamed requests are metered from an estimate (`usage_source: "estimated"`), non-streamed
answers report usage. A 202 with `NVCF-REQID` means the result is pending: it is polled at
`/v2/nvcf/pexec/status/{id}` until it arrives (bounded by the provider's `poll_timeout_s`).
Its 422 and 500 problem details become OpenAI-shaped errors.
"""

import math
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from metering.errors import InvalidRequest
from metering.proxy.dialects.base import OWN_FIELDS, Dialect, developer_as_system
from metering.settings import ModelRoute, Provider

MAX_TOKENS = 16384
# The schema's optional fields sent up as the client gave them (max_tokens and stream apart).
PASSED = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "stop")
# Fields the schema lacks that change nothing in what is answered or metered: left out.
LEFT_OUT = frozenset(
    {
        "stream_options",  # the proxy meters NIM streams itself
        "user",
        "seed",  # in NIM's own examples, yet not in its schema
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)
HANDLED = frozenset({"model", "messages", "stream", "max_tokens", "max_completion_tokens"})
SYSTEM_ROLES = ("system", "developer")


def _number(
    body: dict[str, Any], key: str, low: float, high: float, low_open: bool = False
) -> None:
    value = body.get(key)
    if value is None:
        return
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    if bad or value > high or value < low or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise InvalidRequest(f"{key} must be in {bound} for this model", param=key)


def _left_out(key: str, value: object) -> bool:
    """Whether a field outside the schema can be left out without changing the answer."""
    if key in LEFT_OUT or key in OWN_FIELDS or value is None:
        return True
    # The defaults, said out loud.
    if key == "n":
        return value == 1 and not isinstance(value, bool)
    return key == "logprobs" and value is False


def _check_fields(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in HANDLED or key in PASSED or _left_out(key, value):
            continue
        raise InvalidRequest(f"{key} is not supported for this model", param=key)
    stop = body.get("stop")
    valid_list = isinstance(stop, list) and all(isinstance(item, str) for item in stop)
    if stop is not None and not isinstance(stop, str) and not valid_list:
        raise InvalidRequest("stop must be a string or a list of strings", param="stop")


def _check_message(i: int, message: dict[str, Any]) -> None:
    role = message.get("role")
    if role not in ("user", "assistant") and not (role in SYSTEM_ROLES and i == 0):
        raise InvalidRequest(
            f"messages[{i}].role must be user or assistant (system only first) for this model",
            param=f"messages.{i}.role",
        )
    for key, value in message.items():
        # `name` has no place in NIM's message; empty leftovers of a previous answer
        # (tool_calls: [], refusal: null) mean nothing.
        if key in ("role", "content", "name") or value is None or value == []:
            continue
        raise InvalidRequest(
            f"messages[{i}].{key} is not supported for this model", param=f"messages.{i}.{key}"
        )
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"messages[{i}].content[{j}]: only text parts are supported for this model",
                    param=f"messages.{i}.content.{j}",
                )


def _text(content: object) -> str | None:
    """NIM's content is a string or null: text parts are joined."""
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return content if isinstance(content, str) else None


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Role and content only; a first system message folded into the first user message."""
    out = [{"role": m["role"], "content": _text(m.get("content"))} for m in messages]
    out = developer_as_system(out)
    if out[0]["role"] != "system":
        return out
    system, rest = out[0]["content"] or "", out[1:]
    if rest and rest[0]["role"] == "user":
        question = rest[0]["content"] or ""
        folded = f"{system}\n\n{question}" if system and question else system or question
        return [{"role": "user", "content": folded}, *rest[1:]]
    if not system and rest:
        return rest
    return [{"role": "user", "content": system}, *rest]


class NimDialect(Dialect):
    name = "nim"
    include_usage = False  # the schema has no stream_options: streams are estimated
    polls = True
    max_output_tokens = MAX_TOKENS  # the catalog's maximum may be set higher than NIM takes
    # Its closed schema has neither (nor `metadata`): prepare() builds the body from the schema.
    identifiers: frozenset[str] = frozenset()

    def validate(self, body: dict[str, Any]) -> None:
        _number(body, "temperature", 0, 1)
        _number(body, "top_p", 0, 1, low_open=True)
        _check_fields(body)
        for i, message in enumerate(body["messages"]):
            _check_message(i, message)

    def prepare(
        self, body: dict[str, Any], route: ModelRoute, *, max_tokens: int | None
    ) -> dict[str, Any]:
        upstream: dict[str, Any] = {
            "model": route.upstream_model,
            "messages": _messages(body["messages"]),
        }
        upstream.update((key, body[key]) for key in PASSED if body.get(key) is not None)
        upstream["stream"] = bool(body.get("stream"))
        if max_tokens is not None:
            upstream["max_tokens"] = max_tokens
        return upstream

    def status_url(self, provider: Provider, request_id: str) -> str:
        """NVCF's polling endpoint: the provider's `status_url` template, else the same host."""
        if provider.status_url:
            return provider.status_url.replace("{request_id}", request_id)
        parts = urlsplit(provider.base_url)
        path = parts.path.rstrip("/").removesuffix("/v1")
        status_path = f"{path}/v2/nvcf/pexec/status/{request_id}"
        return urlunsplit((parts.scheme, parts.netloc, status_path, "", ""))
