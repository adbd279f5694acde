"""Sending an attempt upstream and reading what came back: open the request (NIM's 202 polled
until the result is there; a request dropped unanswered on a stale pooled connection is sent
again by metering.proxy.upstreams), read a whole body within the limits, and turn an upstream
error status or a failure into the client's answer. Each failure records the attempt's outcome
first; the attempt settles it (or releases the hold) when it ends.

No database transaction or pooled connection is held while waiting on the upstream.
"""

import asyncio
import json
import time

import anyio
import httpx
from starlette.responses import Response

from metering import metrics
from metering.errors import MeteringError, error_body, retry_headers
from metering.ledger.outcome import Outcome
from metering.proxy.answer_bounds import (
    RESPONSE_TOO_LARGE,
    RESPONSE_TOO_LONG,
    AnswerBound,
    text_of_cut_body,
)
from metering.proxy.attempt import Attempt, Chosen
from metering.proxy.upstreams import failure_kind

PASSED_HEADERS = ("content-type", "retry-after")


class UpstreamFailed(MeteringError):
    status, code = 502, "upstream_error"


class UpstreamTimeout(MeteringError):
    status, code = 504, "upstream_timeout"


class FailedBeforeAnswer(Chosen):  # a signal to try the next provider
    """The attempt failed (connect error, timeout, 5xx, 429) before a byte reached the client,
    so another provider may be tried. `answer` is what the client gets if none is left."""

    def __init__(self, answer: Response | MeteringError) -> None:
        super().__init__(str(answer))
        self.answer = answer


def passed_headers(attempt: Attempt, upstream: httpx.Response) -> dict[str, str]:
    """The upstream's headers a client gets, with the attempt's own."""
    headers = {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}
    return {**headers, **attempt.headers}


async def open_upstream(attempt: Attempt) -> httpx.Response:
    """Send the request; on a failure before any answer, record it (if it went out) and raise."""
    services, provider = attempt.services, attempt.provider
    request = services.upstreams.chat_request(provider, attempt.dialect, attempt.upstream_body)
    if attempt.trace is not None:
        # Ended when the attempt ends; the upstream continues the trace from it.
        attempt.upstream_span = attempt.trace.upstream(provider, request.headers)
    response = None
    timer = asyncio.timeout_at(attempt.deadline(services.settings.max_response_s))
    try:
        async with timer:
            attempt.sent = True
            metrics.before_upstream(time.perf_counter() - attempt.t0)
            response = await services.upstreams.send(provider.name, request)
            if response.status_code == 202 and attempt.dialect.polls:
                response = await _poll(attempt, response)
    except (httpx.HTTPError, OSError) as exc:  # TimeoutError is an OSError
        if not timer.expired():
            raise _failed(attempt, exc) from exc
        # The request's time ran out before an answer: it went out, nothing came back.
        if response is not None:
            await response.aclose()  # a pending 202, already closed
        attempt.outcome = Outcome(
            status=RESPONSE_TOO_LONG.status, billable=False, error="no answer in time"
        )
        raise limit_error(attempt, RESPONSE_TOO_LONG) from None
    return response


def limit_error(attempt: Attempt, limit: AnswerBound) -> MeteringError:
    return limit.error(attempt.provider.name, limit.bound(attempt.services.settings))


def limit_message(attempt: Attempt, limit: AnswerBound) -> str:
    return limit.message(attempt.provider.name, limit.bound(attempt.services.settings))


async def _poll(attempt: Attempt, pending: httpx.Response) -> httpx.Response:
    """NVCF answers 202 with NVCF-REQID while the result is being made: poll until it is there."""
    provider, upstreams = attempt.provider, attempt.services.upstreams
    deadline = time.monotonic() + provider.poll_timeout_s
    # The provider's own timeouts, not the client's 5 s default: a status poll may be held.
    timeout = httpx.Timeout(provider.timeout_s, connect=provider.connect_timeout_s)
    headers = {k: v for k, v in attempt.dialect.headers(provider).items() if k != "content-type"}
    headers["accept-encoding"] = "identity"
    while pending.status_code == 202:
        request_id = pending.headers.get("nvcf-reqid")
        await pending.aclose()
        if not request_id:
            raise httpx.RemoteProtocolError("202 without NVCF-REQID")
        if time.monotonic() >= deadline:
            raise httpx.ReadTimeout(f"no result after {provider.poll_timeout_s} s of polling")
        await anyio.sleep(provider.poll_interval_s)
        url = attempt.dialect.status_url(provider, request_id)
        poll = upstreams.client(provider.name).build_request(
            "GET", url, headers=headers, timeout=timeout
        )
        pending = await upstreams.send(provider.name, poll)
    return pending


def _failed(
    attempt: Attempt, exc: BaseException, answered: int | None = None, text: str = ""
) -> FailedBeforeAnswer | UpstreamFailed:
    """The error for a connection that failed; the outcome recorded unless nothing went out.
    `answered`: the status the upstream had already sent when its body broke off; a 2xx answer
    was generated (and billed upstream), so it is metered at an estimate of the `text` that
    arrived, not for free."""
    kind = failure_kind(exc)
    name = attempt.provider.name
    if kind == "unreached" and answered is None:
        return FailedBeforeAnswer(UpstreamFailed(f"could not connect to provider {name}"))
    if kind == "unreached":
        kind = "upstream_disconnected"
    attempt.outcome = Outcome(
        status=kind,
        http_status=answered,
        billable=answered is not None and answered < 400,
        error=repr(exc),
        delivered_text=text,
    )
    if kind == "timeout":
        return FailedBeforeAnswer(UpstreamTimeout(f"provider {name} did not answer in time"))
    if answered is None:
        return UpstreamFailed(
            f"provider {name} closed the connection after the request was sent, without an answer"
        )
    return UpstreamFailed(f"provider {name} closed the connection in the middle of its answer")


async def read_all(attempt: Attempt, upstream: httpx.Response) -> bytes:
    """The whole body, read within the response size and time limits."""
    settings = attempt.services.settings
    status = upstream.status_code
    body = bytearray()
    limit = None
    timer = asyncio.timeout_at(attempt.deadline(settings.max_response_s))
    try:
        try:
            async with timer:
                async for chunk in upstream.aiter_bytes():
                    if len(body) + len(chunk) > settings.max_response_bytes:
                        body += chunk[: settings.max_response_bytes - len(body)]
                        limit = RESPONSE_TOO_LARGE
                        break
                    body += chunk
        except TimeoutError:
            if not timer.expired():
                raise
            limit = RESPONSE_TOO_LONG
    except (httpx.HTTPError, OSError) as exc:
        text = await text_of_cut_body(bytes(body)) if status < 400 and body else ""
        raise _failed(attempt, exc, answered=status, text=text) from None
    finally:
        await upstream.aclose()
    if limit is not None:
        billable = status < 400
        attempt.outcome = Outcome(
            status=limit.status,
            http_status=status,
            billable=billable,
            delivered_text=await text_of_cut_body(bytes(body)) if billable else "",
            error=limit_message(attempt, limit),
        )
        raise limit_error(attempt, limit)
    return bytes(body)


def error_answer(attempt: Attempt, upstream: httpx.Response, raw: bytes) -> Response:
    """An upstream error status: its 4xx goes to the client in the OpenAI shape; 5xx is a 502.
    Raises FailedBeforeAnswer for a 429 or a 5xx, so the next provider may be tried."""
    status = upstream.status_code
    attempt.outcome = Outcome(
        status="upstream_error",
        http_status=status,
        billable=False,
        error=raw[:2000].decode("utf-8", "replace"),
    )
    headers = passed_headers(attempt, upstream)
    headers.pop("content-type", None)
    message, code = attempt.dialect.error_message(status, raw)
    # The provider refusing our own key is the operator's problem, not the client's credential.
    if 400 <= status < 500 and status not in (401, 403):
        # What a client's retry logic reads: a refusal no retry changes says so.
        headers = retry_headers(status, headers)
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
        json.dumps(body).encode(),
        502,
        headers=retry_headers(502, headers),
        media_type="application/json",
    )
    if status >= 500:
        raise FailedBeforeAnswer(answer)
    return answer
