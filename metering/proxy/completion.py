"""Relaying a completion that is one JSON body: the upstream's bytes reach the client as they
were sent, its usage read on the side."""

import httpx
from starlette.responses import Response

from metering.ledger.outcome import Outcome
from metering.proxy.attempt import Attempt
from metering.proxy.rename import requested_model, with_model
from metering.proxy.reported import parse_json_object, summarize_object
from metering.proxy.transport import (
    UpstreamFailed,
    error_answer,
    passed_headers,
    read_all,
)


async def relay_completion(attempt: Attempt, upstream: httpx.Response) -> Response:
    """The upstream's answer, read whole (an error status becomes the client's error)."""
    raw = await read_all(attempt, upstream)
    if upstream.status_code >= 400:
        return error_answer(attempt, upstream, raw)
    parsed = parse_json_object(raw)  # None: not a JSON object (bad bytes read as U+FFFD)
    usage, finish, upstream_id, _ = summarize_object(parsed, count=False)
    # The delivered text's tokens are an estimate's, needed only when the usage is not usable.
    tokens = None if usage is not None and usage.usable else summarize_object(parsed)[3]
    outcome = attempt.outcome = Outcome(
        http_status=upstream.status_code,
        usage=usage,
        finish_reason=finish,
        upstream_id=upstream_id,
        delivered_tokens=tokens,
        ttft_ms=attempt.elapsed_ms(),
    )
    if not attempt.chat.stream and parsed is None:
        outcome.status, outcome.error = "malformed", raw[:2000].decode("utf-8", "replace")
        raise UpstreamFailed(f"provider {attempt.provider.name} sent a malformed answer")
    rename = requested_model(attempt)
    if rename is not None:
        raw = with_model(raw, rename)
    return Response(raw, upstream.status_code, headers=passed_headers(attempt, upstream))
