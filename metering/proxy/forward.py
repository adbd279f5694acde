"""Forward one attempt to its upstream and meter it: reserve happened before, settle happens here.

No database transaction or pooled connection is held while waiting on the upstream.
"""

import json
import logging
import time

import anyio
import httpx
from starlette.responses import Response

from metering.errors import MeteringError, error_body
from metering.proxy.assemble import CompletionAssembler
from metering.proxy.attempt import Attempt, keep_hold, release, settle
from metering.proxy.ledger import Outcome
from metering.proxy.sse import SSEParser
from metering.proxy.stream import MeteredStream
from metering.proxy.upstreams import failure_kind
from metering.proxy.usage import (
    StreamObserver,
    parse_json_object,
    summarize_completion,
)

log = logging.getLogger("metering.proxy")

DONE = b"data: [DONE]\n\n"
PASSED_HEADERS = ("content-type", "retry-after")


class UpstreamFailed(MeteringError):
    status, code = 502, "upstream_error"


class UpstreamTimeout(MeteringError):
    status, code = 504, "upstream_timeout"


class FailedBeforeAnswer(Exception):  # noqa: N818 - a signal to try the next provider
    """The attempt failed (connect error, timeout, 5xx, 429) before a byte reached the client,
    so another provider may be tried. `answer` is what the client gets if none is left."""

    def __init__(self, answer: Response | MeteringError) -> None:
        super().__init__(str(answer))
        self.answer = answer


async def open_upstream(state, attempt: Attempt) -> httpx.Response:
    """Send the request; on a failure before any answer, meter it (if it went out) and raise."""
    client = state.upstreams.client(attempt.provider.name)
    timeout = httpx.Timeout(attempt.provider.timeout_s, connect=attempt.provider.connect_timeout_s)
    headers = attempt.dialect.headers(attempt.provider)
    headers["accept-encoding"] = "identity"
    request = client.build_request(
        "POST",
        attempt.dialect.url(attempt.provider),
        content=attempt.upstream_body,
        headers=headers,
        timeout=timeout,
    )
    try:
        response = await client.send(request, stream=True)
        if response.status_code == 202 and attempt.dialect.polls:
            response = await _poll(client, attempt, response, headers)
        return response
    except (httpx.HTTPError, OSError) as exc:
        await _fail_before_answer(state, attempt, exc)
        raise AssertionError("unreachable") from exc


async def _poll(client, attempt: Attempt, pending: httpx.Response, headers: dict) -> httpx.Response:
    """NVCF answers 202 with NVCF-REQID while the result is being made: poll until it is there."""
    provider = attempt.provider
    deadline = time.monotonic() + provider.poll_timeout_s
    # The provider's own timeouts, not the client's 5 s default: a status poll may be held.
    timeout = httpx.Timeout(provider.timeout_s, connect=provider.connect_timeout_s)
    headers = {k: v for k, v in headers.items() if k != "content-type"}
    while pending.status_code == 202:
        request_id = pending.headers.get("nvcf-reqid")
        await pending.aclose()
        if not request_id:
            raise httpx.RemoteProtocolError("202 without NVCF-REQID")
        if time.monotonic() >= deadline:
            raise httpx.ReadTimeout(f"no result after {provider.poll_timeout_s} s of polling")
        await anyio.sleep(provider.poll_interval_s)
        url = attempt.dialect.status_url(provider, request_id)
        poll = client.build_request("GET", url, headers=headers, timeout=timeout)
        pending = await client.send(poll, stream=True)
    return pending


async def _fail_before_answer(
    state, attempt: Attempt, exc: BaseException, answered: int | None = None
) -> None:
    """`answered`: the status the upstream had already sent when its body broke off; a 2xx
    answer was generated (and billed upstream), so it is metered at an estimate, not for free."""
    kind = failure_kind(exc)
    name = attempt.provider.name
    if kind == "unreached" and answered is None:
        await release(state, attempt)
        raise FailedBeforeAnswer(UpstreamFailed(f"could not connect to provider {name}"))
    if kind == "unreached":
        kind = "upstream_disconnected"
    billable = answered is not None and answered < 400
    outcome = Outcome(status=kind, http_status=answered, billable=billable, error=repr(exc))
    await settle(state, attempt, outcome)
    if kind == "timeout":
        raise FailedBeforeAnswer(UpstreamTimeout(f"provider {name} did not answer in time"))
    raise UpstreamFailed(f"provider {name} closed the connection without an answer") from None


async def read_all(state, attempt: Attempt, upstream: httpx.Response) -> bytes:
    try:
        return await upstream.aread()
    except (httpx.HTTPError, OSError) as exc:
        await _fail_before_answer(state, attempt, exc, answered=upstream.status_code)
        raise AssertionError("unreachable") from exc
    finally:
        await upstream.aclose()


def _headers(attempt: Attempt, upstream: httpx.Response) -> dict:
    headers = {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}
    return {**headers, **attempt.headers}


async def error_answer(state, attempt: Attempt, upstream: httpx.Response, raw: bytes) -> Response:
    """An upstream error status: its 4xx goes to the client in the OpenAI shape; 5xx is a 502."""
    status = upstream.status_code
    await settle(
        state,
        attempt,
        Outcome(
            status="upstream_error",
            http_status=status,
            billable=False,
            error=raw[:2000].decode("utf-8", "replace"),
        ),
    )
    headers = _headers(attempt, upstream)
    headers.pop("content-type", None)
    message, code = attempt.dialect.error_message(status, raw)
    # The provider refusing our own key is the operator's problem, not the client's credential.
    if 400 <= status < 500 and status not in (401, 403):
        if attempt.dialect.is_openai_error(raw):
            answer = Response(raw, status, headers=headers, media_type="application/json")
        else:
            body = error_body(status, code or "upstream_error", message)
            answer = Response(
                json.dumps(body).encode(), status, headers=headers, media_type="application/json"
            )
        if status == 429:
            raise FailedBeforeAnswer(answer)
        return answer
    body = error_body(502, "upstream_error", f"provider {attempt.provider.name}: {message}")
    answer = Response(
        json.dumps(body).encode(), 502, headers=headers, media_type="application/json"
    )
    if status >= 500:
        raise FailedBeforeAnswer(answer)
    return answer


async def complete(state, attempt: Attempt) -> Response:
    """Non-streaming: the upstream's body reaches the client as it was sent."""
    if attempt.dialect.stream_only:
        return await complete_from_stream(state, attempt)
    upstream = await open_upstream(state, attempt)
    raw = await read_all(state, attempt, upstream)
    if upstream.status_code >= 400:
        return await error_answer(state, attempt, upstream, raw)
    usage, finish, upstream_id, text = summarize_completion(raw)
    outcome = Outcome(
        http_status=upstream.status_code,
        usage=usage,
        finish_reason=finish,
        upstream_id=upstream_id,
        delivered_text=text,
        ttft_ms=attempt.elapsed_ms(),
    )
    if parse_json_object(raw.decode("utf-8", "replace")) is None:
        outcome.status, outcome.error = "malformed", raw[:2000].decode("utf-8", "replace")
        await settle(state, attempt, outcome)
        raise UpstreamFailed(f"provider {attempt.provider.name} sent a malformed answer")
    await settle(state, attempt, outcome)
    return Response(raw, upstream.status_code, headers=_headers(attempt, upstream))


async def complete_from_stream(state, attempt: Attempt) -> Response:
    """An upstream that only streams, asked by a non-streaming client: read the whole stream,
    answer one chat.completion. An error event mid-stream bills what was delivered, then 502."""
    upstream = await open_upstream(state, attempt)
    if upstream.status_code >= 400:
        raw = await read_all(state, attempt, upstream)
        return await error_answer(state, attempt, upstream, raw)
    observer, assembler, parser = StreamObserver(), CompletionAssembler(), SSEParser()
    outcome = Outcome(http_status=upstream.status_code, status="upstream_disconnected")
    try:
        async for chunk in upstream.aiter_raw():
            await keep_hold(state, attempt)
            for event in parser.feed(chunk):
                if event.data == "[DONE]":
                    outcome.status = "ok"
                obj = observer.observe(event.data)
                if obj is not None:
                    assembler.add(obj)
    except (httpx.HTTPError, OSError) as exc:
        outcome.status, outcome.error = failure_kind(exc), repr(exc)
    finally:
        await upstream.aclose()
    outcome.usage, outcome.finish_reason = observer.usage, observer.finish_reason
    outcome.upstream_id, outcome.delivered_text = observer.upstream_id, observer.delivered_text()
    outcome.ttft_ms = attempt.elapsed_ms()
    if observer.error is not None:
        outcome.status, outcome.error = "stream_error", json.dumps(observer.error)[:2000]
    await settle(state, attempt, outcome)
    if outcome.status != "ok":
        message = (observer.error or {}).get("message") or "the upstream stream ended early"
        raise UpstreamFailed(f"provider {attempt.provider.name}: {message}")
    body = json.dumps(assembler.completion(), ensure_ascii=False).encode()
    return Response(body, 200, headers=attempt.headers, media_type="application/json")


async def stream(state, attempt: Attempt) -> Response:
    upstream = await open_upstream(state, attempt)
    content_type = upstream.headers.get("content-type", "")
    if upstream.status_code >= 400:
        raw = await read_all(state, attempt, upstream)
        return await error_answer(state, attempt, upstream, raw)
    if "text/event-stream" not in content_type:
        # The upstream answered a stream request with one JSON body: pass it on as it came.
        raw = await read_all(state, attempt, upstream)
        usage, finish, upstream_id, text = summarize_completion(raw)
        await settle(
            state,
            attempt,
            Outcome(
                http_status=upstream.status_code,
                usage=usage,
                finish_reason=finish,
                upstream_id=upstream_id,
                delivered_text=text,
                ttft_ms=attempt.elapsed_ms(),
            ),
        )
        return Response(raw, upstream.status_code, headers=_headers(attempt, upstream))
    return MeteredStream(state, attempt, upstream)
