"""TokenChange (docs/dialects.md, "TokenChange").

The upstream only streams (`stream` must be true), so a non-streaming client
request is streamed upstream and answered as one `chat.completion`. Usage comes
in the final chunk with `stream_options.include_usage`, with
`prompt_tokens_details.cached_tokens` charged at the cached price. An error
after the stream started arrives as a `data: {"error": ...}` event and then
`[DONE]`; what was delivered before it is billed. `<model>/ep/<endpoint>`
pins one of its endpoints and passes through. Its document passes "other OpenAI chat
completion fields" to the endpoint unchanged: `user` and `safety_identifier` are sent up.
"""

from typing import Any

from metering.proxy.dialects.base import IDENTIFIERS, Dialect
from metering.settings import ModelRoute


class TokenChangeDialect(Dialect):
    name = "tokenchange"
    include_usage = True
    stream_only = True
    pins_endpoints = True
    identifiers = IDENTIFIERS

    def prepare(
        self, body: dict[str, Any], route: ModelRoute, *, max_tokens: int | None
    ) -> dict[str, Any]:
        upstream = super().prepare({**body, "stream": True}, route, max_tokens=max_tokens)
        return upstream
