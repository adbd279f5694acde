"""The usage chunk the proxy ends a stream with when its client asked for usage
(`stream_options.include_usage`) and the upstream sent none (Genesis and NIM never do; a stream
cut mid-way never got to it): the counts of the ledger event as it was charged, marked with the
event's `usage_source` (`estimated`), so that what the client reads is what the ledger says.

It goes after the last event relayed and before the stream's tail (`[DONE]`, or an error event
that cuts the stream): a client that reads chunk by chunk gets it before an error is raised."""

import json
from typing import Any

from metering.ledger.event import DETAIL_FIELDS, Event
from metering.proxy.attempt import Attempt
from metering.proxy.reported import StreamObserver


def usage_of(event: Event) -> dict[str, Any]:
    """The event's counts as a chat completion's `usage` object, with its `usage_source`."""
    usage: dict[str, Any] = {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.total_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }
    details = {name: n for name in DETAIL_FIELDS if (n := getattr(event, name)) is not None}
    if details:
        usage["completion_tokens_details"] = details
    usage["usage_source"] = event.usage_source
    return usage


def usage_tail(attempt: Attempt, observer: StreamObserver) -> bytes:
    """The usage chunk as an SSE event, or b"" when none is due: the client did not ask, the
    upstream's usage was relayed (`observer.usage`), or no event was settled here (the database
    could not be reached: the hold is charged on expiry, with counts not known yet)."""
    event = attempt.charged
    if event is None or observer.usage is not None or not attempt.chat.wants_usage:
        return b""
    if attempt.provider.response_model == "requested":
        model = attempt.chat.model
    else:
        model = observer.model or event.upstream_model
    chunk = {
        # Genesis' chunks carry no id: the event's, which is the answer's x-request-id.
        "id": observer.upstream_id or event.id,
        "object": "chat.completion.chunk",
        "created": observer.created
        if observer.created is not None
        else int(event.started_at.timestamp()),
        "model": model,
        "choices": [],
        "usage": usage_of(event),
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
