"""The streaming response: SSE events relayed byte for byte while usage is read on the side,
and exactly one settle however the stream ends (done, upstream cut, client gone)."""

import contextlib
import json
import logging

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from metering.errors import error_body
from metering.ledger.outcome import Outcome
from metering.proxy.attempt import Attempt, settle
from metering.proxy.limits import (
    EVENT_TOO_LARGE,
    RESPONSE_TOO_LARGE,
    RESPONSE_TOO_LONG,
    Limit,
    bound_of,
)
from metering.proxy.sse import SSEParser
from metering.proxy.upstreams import failure_kind
from metering.proxy.usage import StreamObserver, is_usage_only_chunk

log = logging.getLogger("metering.proxy")

DONE = b"data: [DONE]\n\n"


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
        self.limit: Limit | None = None  # the bound the answer passed, if any

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
        settings = self.state.settings
        parser = SSEParser(settings.max_sse_event_bytes)
        received = 0
        deadline = self.attempt.deadline(settings.max_response_s)
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                async for chunk in self.upstream.aiter_raw():
                    received += len(chunk)
                    if received > settings.max_response_bytes:
                        self.limit = RESPONSE_TOO_LARGE
                        break
                    out = self._select(parser.feed(chunk))
                    if out:
                        await self._first_byte()
                        await self._send(send, out)
                    if parser.too_large:
                        self.limit = EVENT_TOO_LARGE
                        break
                    if self.done_seen:
                        break
                else:
                    out = self._select(parser.flush())
                    if out:
                        await self._send(send, out)
            if scope.cancelled_caught:
                self.limit = RESPONSE_TOO_LONG
        except (httpx.HTTPError, OSError) as exc:
            if self.client_gone:
                return
            self.outcome.status = failure_kind(exc)
            self.outcome.error = repr(exc)
        if self.limit is not None:
            return
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
        if self.limit is not None:
            outcome.status = self.limit.status
            outcome.error = self._limit_message()
        elif self.client_gone and not self.done_seen:
            outcome.status = "client_disconnected"
        elif self.error_seen:
            outcome.status = "stream_error"
            outcome.error = json.dumps(observer.error)[:2000]
        outcome.usage = observer.usage
        outcome.finish_reason = observer.finish_reason
        outcome.upstream_id = observer.upstream_id
        outcome.delivered_tokens = observer.delivered_tokens()
        return outcome

    def _limit_message(self) -> str:
        limit = self.limit
        return limit.message(self.attempt.provider.name, bound_of(limit, self.state.settings))

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
            if self.limit is not None:
                # The answer is cut: an error event, and no [DONE], which would say it ended.
                error = error_body(502, self.limit.code, self._limit_message())
                tail = b"data: " + json.dumps(error).encode() + b"\n\n"
            elif self.outcome.status in ("upstream_disconnected", "timeout"):
                error = error_body(502, "upstream_error", "the upstream stream ended early")
                tail = b"data: " + json.dumps(error).encode() + b"\n\n" + DONE
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": tail, "more_body": False})
