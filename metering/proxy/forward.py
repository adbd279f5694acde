"""Forward one attempt to its upstream and meter it: reserve happened before, settle happens here.

No database transaction or pooled connection is held while waiting on the upstream.
"""

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from metering import metrics
from metering.budgets import service as budgets
from metering.budgets.service import HoldSpec, Reservation
from metering.errors import MeteringError, error_body
from metering.proxy.assemble import CompletionAssembler
from metering.proxy.dialects import Dialect
from metering.proxy.ledger import Outcome, event_for
from metering.proxy.request import ChatRequest
from metering.proxy.sse import SSEParser
from metering.proxy.upstreams import failure_kind
from metering.proxy.usage import (
    StreamObserver,
    is_usage_only_chunk,
    parse_json_object,
    summarize_completion,
)
from metering.settings import Provider

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


@dataclass(slots=True)
class Attempt:
    spec: HoldSpec
    chat: ChatRequest
    provider: Provider
    dialect: Dialect
    upstream_body: bytes
    started_at: datetime
    t0: float
    headers: dict  # response headers we add (x-request-id, x-max-tokens-clamped)

    last_extended: float = 0.0
    reservation: Reservation | None = None

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)


async def keep_hold(state, attempt: Attempt) -> None:
    """A request still streaming keeps its hold from being swept as unsettled."""
    ttl = state.settings.hold_ttl_s
    now = time.monotonic()
    if not attempt.last_extended:
        attempt.last_extended = now
    elif now - attempt.last_extended > ttl / 3:
        attempt.last_extended = now
        try:
            await budgets.extend(state.db, attempt.spec.hold_id, ttl)
        except Exception:
            log.warning("could not extend hold %s", attempt.spec.hold_id, exc_info=True)


async def settle(state, attempt: Attempt, outcome: Outcome) -> None:
    """Write the attempt's one ledger event. Shielded: a client going away must not cancel it."""
    event = event_for(
        attempt.spec, attempt.chat.body, attempt.started_at, attempt.elapsed_ms(), outcome
    )
    with anyio.CancelScope(shield=True):
        try:
            settled = await budgets.settle(
                state.db, attempt.spec.hold_id, event, attempt.reservation
            )
        except Exception:
            # The hold stays; the sweeper charges it as unsettled, so nothing is lost.
            log.exception(
                "settle failed for %s; its hold will be charged on expiry", attempt.spec.hold_id
            )
        else:
            if settled:
                metrics.observe_event(event)


async def release(state, attempt: Attempt) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await budgets.release(state.db, attempt.spec.hold_id)
        except Exception:
            log.exception("release failed for %s", attempt.spec.hold_id)


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


class MeteredStream(Response):
    """Relays SSE events byte for byte, reading usage on the side, and settles exactly once."""

    def __init__(self, state, attempt: Attempt, upstream: httpx.Response) -> None:
        self.status_code = upstream.status_code
        self.background = None
        self.state, self.attempt, self.upstream = state, attempt, upstream
        self.observer = StreamObserver()
        self.outcome = Outcome(http_status=upstream.status_code)
        headers = {
            "content-type": upstream.headers.get("content-type", "text/event-stream"),
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **attempt.headers,
        }
        # No content-length: the body is a stream of unknown length.
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.client_gone = False
        self.done_seen = False
        self.done_raw = DONE
        self.error_seen = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def relay() -> None:
                    await self._relay(send)
                    group.cancel_scope.cancel()

                group.start_soon(relay)
                await self._wait_for_disconnect(receive)
                self.client_gone = True
                group.cancel_scope.cancel()
        finally:
            await self._finish(send)

    async def _wait_for_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _send(self, send: Send, body: bytes, more: bool = True) -> None:
        try:
            await send({"type": "http.response.body", "body": body, "more_body": more})
        except OSError:
            self.client_gone = True
            raise

    async def _relay(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        parser = SSEParser()
        try:
            async for chunk in self.upstream.aiter_raw():
                await keep_hold(self.state, self.attempt)
                out = self._select(parser.feed(chunk))
                if out:
                    await self._first_byte()
                    await self._send(send, out)
                if self.done_seen:
                    break
            else:
                out = self._select(parser.flush())
                if out:
                    await self._send(send, out)
        except (httpx.HTTPError, OSError) as exc:
            if self.client_gone:
                return
            self.outcome.status = failure_kind(exc)
            self.outcome.error = repr(exc)
        if not self.done_seen and not self.error_seen and self.outcome.status == "ok":
            self.outcome.status = "upstream_disconnected"

    async def _first_byte(self) -> None:
        if self.outcome.ttft_ms is None:
            self.outcome.ttft_ms = self.attempt.elapsed_ms()

    def _select(self, events) -> bytes:
        """The raw bytes to pass on: everything but a usage chunk the client did not ask for.
        The [DONE] event is held back until the event is settled."""
        out = []
        for event in events:
            data = event.data
            if data is not None:
                if data == "[DONE]":
                    self.done_seen, self.done_raw = True, event.raw
                    break
                obj = self.observer.observe(data)
                if (
                    not self.attempt.chat.wants_usage
                    and obj is not None
                    and is_usage_only_chunk(obj)
                ):
                    continue
                if self.observer.error is not None and not self.error_seen:
                    self.error_seen = True
            out.append(event.raw)
        return b"".join(out)

    def _outcome(self) -> Outcome:
        outcome, observer = self.outcome, self.observer
        if self.client_gone and not self.done_seen:
            outcome.status = "client_disconnected"
        elif self.error_seen:
            outcome.status = "stream_error"
            outcome.error = json.dumps(observer.error)[:2000]
        outcome.usage = observer.usage
        outcome.finish_reason = observer.finish_reason
        outcome.upstream_id = observer.upstream_id
        outcome.delivered_text = observer.delivered_text()
        return outcome

    async def _finish(self, send: Send) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.upstream.aclose()
            except Exception:
                log.debug("closing upstream stream failed", exc_info=True)
            await settle(self.state, self.attempt, self._outcome())
            if self.client_gone:
                return
            tail = self.done_raw
            if self.outcome.status in ("upstream_disconnected", "timeout"):
                error = error_body(502, "upstream_error", "the upstream stream ended early")
                tail = b"data: " + json.dumps(error).encode() + b"\n\n" + DONE
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": tail, "more_body": False})
