"""Exascale (docs/dialects.md, "Exascale").

OpenAI-compatible, plus `developer` role, `reasoning_content`, `reasoning_details`,
`name` and `sla_metrics`, all passed through untouched. Its documented ranges (top_k
-1..200, repetition_penalty 0.01..2) are checked before anything is spent, and so is the
content every message must carry. `stream`, listed as required, is always sent. Its
streams always end with a usage chunk, asked for or not; the proxy withholds it from
clients that did not ask for include_usage. Its body parameters table has no `user` nor
`safety_identifier`: neither is sent up.
"""

from typing import Any

from metering.errors import InvalidRequest
from metering.proxy.dialects.base import Dialect
from metering.settings import ModelRoute


def _check_range(body: dict[str, Any], key: str, low: float, high: float, integer: bool) -> None:
    value = body.get(key)
    if value is None:
        return
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise InvalidRequest(
            f"{key} must be {kind} between {low:g} and {high:g} for this model", param=key
        )


class ExascaleDialect(Dialect):
    name = "exascale"
    include_usage = True
    identifiers: frozenset[str] = frozenset()  # not in its body parameters table

    def validate(self, body: dict[str, Any]) -> None:
        _check_range(body, "top_k", -1, 200, integer=True)
        _check_range(body, "repetition_penalty", 0.01, 2, integer=False)
        for i, message in enumerate(body["messages"]):
            if "content" not in message:
                raise InvalidRequest(
                    f"messages[{i}] must have a content for this model",
                    param=f"messages.{i}.content",
                )

    def prepare(
        self, body: dict[str, Any], route: ModelRoute, *, max_tokens: int | None
    ) -> dict[str, Any]:
        upstream = super().prepare(body, route, max_tokens=max_tokens)
        upstream["stream"] = bool(body.get("stream"))
        return upstream
