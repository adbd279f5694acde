"""Forward one attempt to its upstream: which of the three ways its answer takes.

- a completion relayed as one body (metering.proxy.completion);
- a stream relayed event by event (metering.proxy.stream);
- a stream assembled into one completion, for a non-streaming client of an upstream that only
  streams (metering.proxy.assemble).

A Responses API request bridged to chat takes the same ways, its answer written in Responses
terms at the end (metering.proxy.responses.answer).

Each way records the attempt's outcome; the attempt settles it when it ends.
"""

from starlette.responses import Response

from metering.proxy.assemble import answer_from_stream
from metering.proxy.attempt import Attempt
from metering.proxy.completion import relay_completion
from metering.proxy.responses.answer import ResponsesAnswer, ResponsesStream
from metering.proxy.responses.native import NativeStream, relay_response
from metering.proxy.stream import MeteredStream
from metering.proxy.transport import open_upstream


async def forward(attempt: Attempt) -> Response:
    bridge = attempt.chat.bridge  # a Responses API request: answered in its terms
    if bridge is not None and bridge.native:
        return await forward_native(attempt)
    if not attempt.chat.stream and attempt.dialect.stream_only:
        answer = await answer_from_stream(attempt)
        return answer if bridge is None else ResponsesAnswer(attempt, bridge, answer)
    upstream = await open_upstream(attempt)
    if (
        attempt.chat.stream
        and upstream.status_code < 400
        and "text/event-stream" in upstream.headers.get("content-type", "")
    ):
        if bridge is not None:
            return ResponsesStream(attempt, bridge, upstream)
        return MeteredStream(attempt, upstream)
    # A completion; or a stream request the upstream refused, or answered with one JSON body
    # (passed on as it came).
    answer = await relay_completion(attempt, upstream)
    if bridge is None or answer.status_code >= 400:
        return answer
    return ResponsesAnswer(attempt, bridge, answer)


async def forward_native(attempt: Attempt) -> Response:
    """A Responses request to a provider that serves it: relayed as it comes."""
    upstream = await open_upstream(attempt)
    if (
        attempt.chat.stream
        and upstream.status_code < 400
        and "text/event-stream" in upstream.headers.get("content-type", "")
    ):
        return NativeStream(attempt, upstream)
    return await relay_response(attempt, upstream)
