"""Genesis (docs/dialects.md, "Genesis").

Roles are system, user and assistant; content is a string or text blocks with
non-empty text. Its streams carry no usage at all, so streamed requests are
metered from an estimate of the request and the delivered text
(`usage_source: "estimated"`); its non-streamed answers report usage. Its parameters
table has no `user` nor `safety_identifier`: neither is sent up.
"""

from typing import Any

from metering.errors import InvalidRequest
from metering.proxy.dialects.base import Dialect, developer_as_system
from metering.settings import ModelRoute

ROLES = ("system", "user", "assistant")


class GenesisDialect(Dialect):
    name = "genesis"
    include_usage = False
    identifiers: frozenset[str] = frozenset()  # not in its parameters table

    def validate(self, body: dict[str, Any]) -> None:
        for i, message in enumerate(body["messages"]):
            role = message.get("role")
            if role not in (*ROLES, "developer"):
                raise InvalidRequest(
                    f"messages[{i}].role must be system, user or assistant for this model",
                    param=f"messages.{i}.role",
                )
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.get("type") == "text" and not (
                        isinstance(part.get("text"), str) and part["text"]
                    ):
                        raise InvalidRequest(
                            f"messages[{i}].content[{j}].text must be non-empty text",
                            param=f"messages.{i}.content.{j}.text",
                        )

    def prepare(
        self, body: dict[str, Any], route: ModelRoute, *, max_tokens: int | None
    ) -> dict[str, Any]:
        upstream = super().prepare(body, route, max_tokens=max_tokens)
        upstream["messages"] = developer_as_system(upstream["messages"])
        upstream.pop("stream_options", None)
        return upstream
