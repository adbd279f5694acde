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
from metering.ledger.outcome import Outcome
from metering.proxy.assemble import CompletionAssembler
from metering.proxy.attempt import Attempt, release, settle
from metering.proxy.limits import (
    EVENT_TOO_LARGE,
    RESPONSE_TOO_LARGE,
    RESPONSE_TOO_LONG,
    Limit,
    bound_of,
    text_of_cut_body,
)
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
    timeout = httpx.Timeout(attempt.provider.timeout_s, connect=attempt.provider.connect_timeout_s)
    headers = attempt.dialect.headers(attempt.provider)
    headers["accept-encoding"] = "identity"
    request = state.upstreams.client(attempt.provider.name).build_request(
        "POST",
        attempt.dialect.url(attempt.provider),
        content=attempt.upstream_body,
        headers=headers,
        timeout=timeout,
    )
    response = None
    try:
        with anyio.CancelScope(deadline=attempt.deadline(state.settings.max_response_s)) as scope:
            response = await state.upstreams.send(attempt.provider.name, request)
            if response.status_code == 202 and attempt.dialect.polls:
                response = await _poll(state, attempt, response, headers)
    except (httpx.HTTPError, OSError) as exc:
        await _fail_before_answer(state, attempt, exc)
        raise AssertionError("unreachable") from exc
    if scope.cancelled_caught:
        # The request's time ran out before an answer: it went out, nothing came back.
        if response is not None:
            await response.aclose()  # a pending 202, already closed
        await settle(
            state,
            attempt,
            Outcome(status=RESPONSE_TOO_LONG.status, billable=False, error="no answer in time"),
        )
        raise _limit_error(state, attempt, RESPONSE_TOO_LONG)
    return response


def _limit_error(state, attempt: Attempt, limit: Limit) -> MeteringError:
    return limit.error(attempt.provider.name, bound_of(limit, state.settings))


async def _poll(state, attempt: Attempt, pending: httpx.Response, headers: dict) -> httpx.Response:
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
        client = state.upstreams.client(provider.name)
        poll = client.build_request("GET", url, headers=headers, timeout=timeout)
        pending = await state.upstreams.send(provider.name, poll)
    return pending


async def _fail_before_answer(
    state, attempt: Attempt, exc: BaseException, answered: int | None = None, partial: bytes = b""
) -> None:
    """`answered`: the status the upstream had already sent when its body broke off; a 2xx
    answer was generated (and billed upstream), so it is metered at an estimate of what
    arrived (`partial`), not for free."""
    kind = failure_kind(exc)
    name = attempt.provider.name
    if kind == "unreached" and answered is None:
        await release(state, attempt)
        raise FailedBeforeAnswer(UpstreamFailed(f"could not connect to provider {name}"))
    if kind == "unreached":
        kind = "upstream_disconnected"
    billable = answered is not None and answered < 400
    text = await text_of_cut_body(partial) if billable and partial else ""
    outcome = Outcome(
        status=kind, http_status=answered, billable=billable, error=repr(exc), delivered_text=text
    )
    await settle(state, attempt, outcome)
    if kind == "timeout":
        raise FailedBeforeAnswer(UpstreamTimeout(f"provider {name} did not answer in time"))
    if answered is None:
        raise UpstreamFailed(
            f"provider {name} closed the connection after the request was sent, without an answer"
        ) from None
    raise UpstreamFailed(f"provider {name} closed the connection in the middle of its answer")


async def read_all(state, attempt: Attempt, upstream: httpx.Response) -> bytes:
    """The whole body, read within the response size and time limits."""
    settings = state.settings
    body = bytearray()
    limit = None
    try:
        with anyio.CancelScope(deadline=attempt.deadline(settings.max_response_s)) as scope:
            async for chunk in upstream.aiter_bytes():
                if len(body) + len(chunk) > settings.max_response_bytes:
                    body += chunk[: settings.max_response_bytes - len(body)]
                    limit = RESPONSE_TOO_LARGE
                    break
                body += chunk
        if scope.cancelled_caught:
            limit = RESPONSE_TOO_LONG
    except (httpx.HTTPError, OSError) as exc:
        await _fail_before_answer(
            state, attempt, exc, answered=upstream.status_code, partial=bytes(body)
        )
        raise AssertionError("unreachable") from exc
    finally:
        await upstream.aclose()
    if limit is not None:
        await _settle_limit(state, attempt, limit, upstream.status_code, bytes(body))
    return bytes(body)


async def _settle_limit(state, attempt: Attempt, limit: Limit, status: int, body: bytes) -> None:
    billable = status < 400
    outcome = Outcome(
        status=limit.status,
        http_status=status,
        billable=billable,
        delivered_text=await text_of_cut_body(body) if billable else "",
        error=limit.message(attempt.provider.name, bound_of(limit, state.settings)),
    )
    await settle(state, attempt, outcome)
    raise _limit_error(state, attempt, limit)


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
    usage, finish, upstream_id, tokens = summarize_completion(raw)
    outcome = Outcome(
        http_status=upstream.status_code,
        usage=usage,
        finish_reason=finish,
        upstream_id=upstream_id,
        delivered_tokens=tokens,
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
    settings = state.settings
    observer, assembler = StreamObserver(), CompletionAssembler()
    parser = SSEParser(settings.max_sse_event_bytes)
    outcome = Outcome(http_status=upstream.status_code, status="upstream_disconnected")
    limit, received = None, 0
    try:
        with anyio.CancelScope(deadline=attempt.deadline(settings.max_response_s)) as scope:
            async for chunk in upstream.aiter_raw():
                received += len(chunk)
                if received > settings.max_response_bytes:
                    limit = RESPONSE_TOO_LARGE
                    break
                for event in parser.feed(chunk):
                    if event.data == "[DONE]":
                        outcome.status = "ok"
                    obj = observer.observe(event.data)
                    if obj is not None:
                        assembler.add(obj)
                if parser.too_large:
                    limit = EVENT_TOO_LARGE
                    break
        if scope.cancelled_caught:
            limit = RESPONSE_TOO_LONG
    except (httpx.HTTPError, OSError) as exc:
        outcome.status, outcome.error = failure_kind(exc), repr(exc)
    finally:
        await upstream.aclose()
    outcome.usage, outcome.finish_reason = observer.usage, observer.finish_reason
    outcome.upstream_id = observer.upstream_id
    outcome.delivered_tokens = observer.delivered_tokens()
    outcome.ttft_ms = attempt.elapsed_ms()
    if observer.error is not None:
        outcome.status, outcome.error = "stream_error", json.dumps(observer.error)[:2000]
    if limit is not None:
        outcome.status = limit.status
        outcome.error = limit.message(attempt.provider.name, bound_of(limit, settings))
    await settle(state, attempt, outcome)
    if limit is not None:
        raise _limit_error(state, attempt, limit)
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
        usage, finish, upstream_id, tokens = summarize_completion(raw)
        await settle(
            state,
            attempt,
            Outcome(
                http_status=upstream.status_code,
                usage=usage,
                finish_reason=finish,
                upstream_id=upstream_id,
                delivered_tokens=tokens,
                ttft_ms=attempt.elapsed_ms(),
            ),
        )
        return Response(raw, upstream.status_code, headers=_headers(attempt, upstream))
    return MeteredStream(state, attempt, upstream)
