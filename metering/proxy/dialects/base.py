"""A dialect says how to talk to one kind of upstream: URL, headers, request shape, errors."""

import json
from typing import Any

from metering.settings import ModelRoute, Provider

OWN_FIELDS = frozenset({"max_input_usd_per_mtok", "max_output_usd_per_mtok"})
# The request's attribution (metering.ledger.attribution): `metadata` (its tags) is ours and
# never sent up; `user` and `safety_identifier` (its end user) only to an upstream whose
# document takes them (a dialect's `identifiers`).
TAGS_FIELD = "metadata"
IDENTIFIERS = frozenset({"user", "safety_identifier"})
OPENAI_ERROR_FIELDS = frozenset({"message", "type", "code", "param"})


def developer_as_system(messages: list[Any]) -> list[Any]:
    """The messages with `developer` turned into `system`, for an upstream that knows only the
    older name of the system prompt."""
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


class Dialect:
    name = "openai"
    # Whether the upstream honours stream_options.include_usage (then the proxy always asks).
    include_usage = True
    # The upstream only streams: non-streaming clients get the stream assembled into one answer.
    stream_only = False
    # The upstream may answer 202 and want its result polled for (NVCF).
    polls = False
    # The upstream has endpoints a client may pin with `<model>/ep/<endpoint>` (TokenChange).
    pins_endpoints = False
    # The output limit's name upstream; None: the client's own (max_tokens or
    # max_completion_tokens). An upstream that documents only max_tokens gets max_tokens, so
    # the limit the hold was sized for is the one it honours.
    max_tokens_key: str | None = "max_tokens"
    # The most output tokens the upstream takes in one request, whatever the catalog says.
    max_output_tokens: int | None = None
    # Which of `user` and `safety_identifier` the upstream's document takes: the others are
    # left out of what is sent up.
    identifiers: frozenset[str] = frozenset()
    # Whether the upstream's document takes `reasoning_effort` (a bridged Responses request's
    # `reasoning.effort` goes only to one that does).
    reasoning_effort = False

    def __init__(self) -> None:
        # The client's fields never sent up, as one set: the body is copied once, without them.
        self.withheld = OWN_FIELDS | {TAGS_FIELD} | (IDENTIFIERS - self.identifiers)

    def output_ceiling(self, route: ModelRoute) -> int:
        """The most output tokens a request may ask of this route: the one bound on max_tokens
        (a client asking more is refused; a hold without max_tokens is sized for it)."""
        if self.max_output_tokens is None:
            return route.max_output_tokens
        return min(route.max_output_tokens, self.max_output_tokens)

    def validate(self, body: dict[str, Any]) -> None:
        """Refuse, before anything is spent, what this upstream documents it refuses."""

    def url(self, provider: Provider) -> str:
        return f"{provider.base_url}/chat/completions"

    def headers(self, provider: Provider) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if provider.api_key:
            headers["authorization"] = f"Bearer {provider.api_key}"
        return headers

    def prepare(
        self, body: dict[str, Any], route: ModelRoute, *, max_tokens: int | None
    ) -> dict[str, Any]:
        """The body sent upstream: the client's, with the upstream's model name and our limits."""
        # Our own fields (routing, tags, an end user the upstream does not take) stay here;
        # everything else goes on as the client sent it.
        withheld = self.withheld
        upstream = {k: v for k, v in body.items() if k not in withheld}
        upstream["model"] = route.upstream_model
        if max_tokens is not None:
            key = self.max_tokens_key
            if key is None:
                key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            upstream.pop("max_tokens", None)
            upstream.pop("max_completion_tokens", None)
            upstream[key] = max_tokens
        if not body.get("stream"):
            # Meaningless without a stream, and refused by OpenAI itself.
            upstream.pop("stream_options", None)
        elif self.include_usage:
            options = body.get("stream_options")
            if not isinstance(options, dict):
                options = {}
            upstream["stream_options"] = {**options, "include_usage": True}
        return upstream

    def status_url(self, provider: Provider, request_id: str) -> str:
        """Where an upstream that `polls` serves the answer it deferred (a 202)."""
        raise NotImplementedError(f"dialect {self.name} does not poll")

    def error_message(self, status: int, raw: bytes) -> tuple[str, str | None]:
        """(message, upstream code) from an upstream error body, whatever its shape."""
        try:
            payload = json.loads(raw)
        except ValueError:
            text = raw.decode("utf-8", "replace").strip()
            return (text[:500] or f"upstream answered HTTP {status}"), None
        if isinstance(payload, dict):
            error = payload.get("error")
            if isinstance(error, dict):
                return str(error.get("message") or f"upstream answered HTTP {status}"), error.get(
                    "code"
                )
            if isinstance(error, str):
                return error, None
            for key in ("detail", "message", "title"):
                if isinstance(payload.get(key), str):
                    return payload[key], None
        return f"upstream answered HTTP {status}", None

    def is_openai_error(self, raw: bytes) -> bool:
        """Whether the body is already in the full OpenAI shape (and may reach the client as
        sent); one missing a field (Genesis: no `param`, maybe no `type`) is rebuilt."""
        try:
            payload = json.loads(raw)
        except ValueError:
            return False
        error = payload.get("error") if isinstance(payload, dict) else None
        return (
            isinstance(error, dict)
            and set(payload) == {"error"}
            and set(error) >= OPENAI_ERROR_FIELDS
            and isinstance(error["message"], str)
        )
