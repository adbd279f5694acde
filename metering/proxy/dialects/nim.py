"""NVIDIA NIM (the OpenAPI part of shared/seeds/nvidia-nim-minimax-m2.5-catalog.txt).

Its documented ranges are checked before anything is spent: temperature 0..1,
top_p in (0, 1], max_tokens 1..16384, roles user and assistant (a system message
first). A 202 with `NVCF-REQID` means the result is pending: it is polled at
`/v2/nvcf/pexec/status/{id}` until it arrives (bounded by the provider's
`poll_timeout_s`). Its 422 and 500 problem-details become OpenAI-shaped errors.
"""

import math
from urllib.parse import urlsplit, urlunsplit

from metering.errors import InvalidRequest
from metering.proxy.dialects.base import Dialect
from metering.settings import ModelRoute, Provider

MAX_TOKENS = 16384


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> None:
    value = body.get(key)
    if value is None:
        return
    bad = isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    if bad or value > high or value < low or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise InvalidRequest(f"{key} must be in {bound} for this model", param=key)


class NimDialect(Dialect):
    name = "nim"
    include_usage = True
    polls = True

    def validate(self, body: dict) -> None:
        _number(body, "temperature", 0, 1)
        _number(body, "top_p", 0, 1, low_open=True)
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and value > MAX_TOKENS:
                raise InvalidRequest(
                    f"{key} must be at most {MAX_TOKENS} for this model", param=key
                )
        for i, message in enumerate(body["messages"]):
            role = message.get("role")
            if role in ("user", "assistant"):
                continue
            if role in ("system", "developer") and i == 0:
                continue
            raise InvalidRequest(
                f"messages[{i}].role must be user or assistant (system only first) for this model",
                param=f"messages.{i}.role",
            )

    def prepare(self, body: dict, route: ModelRoute, *, max_tokens: int | None) -> dict:
        if max_tokens is not None:
            # The model's catalog maximum may be set higher than NIM accepts.
            max_tokens = min(max_tokens, MAX_TOKENS)
        upstream = super().prepare(body, route, max_tokens=max_tokens)
        # NIM knows no `developer` role; first in the conversation it is the system prompt.
        upstream["messages"] = [
            {**m, "role": "system"} if m.get("role") == "developer" else m
            for m in upstream["messages"]
        ]
        return upstream

    def status_url(self, provider: Provider, request_id: str) -> str:
        """NVCF's polling endpoint: the provider's `status_url` template, else the same host."""
        if provider.status_url:
            return provider.status_url.replace("{request_id}", request_id)
        parts = urlsplit(provider.base_url)
        path = parts.path.rstrip("/").removesuffix("/v1")
        status_path = f"{path}/v2/nvcf/pexec/status/{request_id}"
        return urlunsplit((parts.scheme, parts.netloc, status_path, "", ""))
