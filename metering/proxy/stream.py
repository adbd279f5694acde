"""Reading an upstream's SSE stream: the one relay loop (StreamRelay), and the response that
relays it to a streaming client byte for byte (MeteredStream).

The loop reads within the limits (event size, response size, time), reads each event's data
on the side (usage, finish reason, delivered text, an error event) and stops at `[DONE]`; its
outcome says how the stream ended: `ok` only when `[DONE]` came.
"""

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from metering.errors import error_body
from metering.ledger.outcome import Outcome
from metering.proxy.answer_bounds import (
    EVENT_TOO_LARGE,
    RESPONSE_TOO_LARGE,
    RESPONSE_TOO_LONG,
    AnswerBound,
)
from metering.proxy.attempt import Attempt
from metering.proxy.rename import requested_model, with_model
from metering.proxy.reported import StreamObserver, is_usage_only_chunk
from metering.proxy.sse import SSEEvent, SSEParser
from metering.proxy.transport import limit_message
from metering.proxy.upstreams import failure_kind
from metering.proxy.usage_chunk import usage_tail

log = logging.getLogger("metering.proxy")

DONE = b"data: [DONE]\n\n"


class StreamRelay:
    """One pass over an upstream stream. `run(pass_on)` hands `pass_on` the raw bytes of the
    events a client gets (a usage chunk the client did not ask for held back, `[DONE]` kept
    for the end; with `rename`, a JSON string, each event's `model` replaced by it:
    metering.proxy.rename); `on_chunk`, if given, sees every parsed chunk; `on_data` every
    event's data, as text."""

    __slots__ = (
        "attempt",
        "upstream",
        "observer",
        "withhold_usage",
        "on_chunk",
        "on_data",
        "rename",
        "done",
        "limit",
        "failure",
        "ttft_ms",
    )

    def __init__(
        self,
        attempt: Attempt,
        upstream: httpx.Response,
        withhold_usage: bool = False,
        on_chunk: Callable[[dict[str, Any]], None] | None = None,
        rename: bytes | None = None,
        on_data: Callable[[str], None] | None = None,
    ) -> None:
        self.attempt, self.upstream = attempt, upstream
        # Every event is read when it comes only for a caller that is handed each one.
        self.observer = StreamObserver(lazy=on_chunk is None)
        self.withhold_usage = withhold_usage
        self.on_chunk = on_chunk
        # Handed every event's data as text (the observer may leave it unparsed): a caller that
        # reads each event its own way (metering.proxy.responses.answer).
        self.on_data = on_data
        self.rename = rename
        self.done: bytes | None = None  # the raw [DONE] event, once it came
        self.limit: AnswerBound | None = None  # the bound the answer passed, if any
        self.failure: BaseException | None = None  # the connection's failure, if any
        self.ttft_ms: int | None = None  # when the first bytes were passed on

    async def run(self, pass_on: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        settings = self.attempt.services.settings
        parser = SSEParser(settings.max_sse_event_bytes)
        max_bytes = settings.max_response_bytes
        received = 0
        try:
            with anyio.CancelScope(
                deadline=self.attempt.deadline(settings.max_response_s)
            ) as scope:
                async for chunk in self.upstream.aiter_raw():
                    received += len(chunk)
                    if received > max_bytes:
                        self.limit = RESPONSE_TOO_LARGE
                        break
                    out = self._select(parser.feed(chunk))
                    if out and pass_on is not None:
                        if self.ttft_ms is None:
                            self.ttft_ms = self.attempt.elapsed_ms()
                        await pass_on(out)
                    if parser.too_large:
                        self.limit = EVENT_TOO_LARGE
                        break
                    if self.done is not None:
                        break
                else:
                    out = self._select(parser.flush())
                    if out and pass_on is not None:
                        await pass_on(out)
            if scope.cancelled_caught:
                self.limit = RESPONSE_TOO_LONG
        except (httpx.HTTPError, OSError) as exc:
            self.failure = exc

    def _select(self, events: list[SSEEvent]) -> bytes:
        out = []
        observer, rename = self.observer, self.rename
        for event in events:
            data = event.data
            if data is not None:
                if data == "[DONE]":
                    self.done = event.raw
                    break
                obj = observer.observe(data)
                if self.on_data is not None:
                    self.on_data(data)
                if observer.finished:
                    # A Responses stream's last event (metering.proxy.responses.native): kept
                    # for the end, as [DONE] is.
                    self.done = event.raw
                    break
                if obj is not None:
                    if self.on_chunk is not None:
                        self.on_chunk(obj)
                    if self.withhold_usage and is_usage_only_chunk(obj):
                        continue
                if rename is not None:
                    out.append(with_model(event.raw, rename))
                    continue
            out.append(event.raw)
        return b"".join(out)

    def outcome(self, client_gone: bool = False) -> Outcome:
        """How the stream ended, what it reported and delivered."""
        observer = self.observer
        usage = observer.usage
        outcome = Outcome(
            http_status=self.upstream.status_code,
            usage=usage,
            finish_reason=observer.finish_reason,
            upstream_id=observer.upstream_id,
            # An estimate's, needed only when the usage cannot be used: not counted otherwise.
            delivered_tokens=None
            if usage is not None and usage.usable
            else observer.delivered_tokens(),
            ttft_ms=self.ttft_ms,
        )
        if self.limit is not None:
            outcome.status = self.limit.status
            outcome.error = limit_message(self.attempt, self.limit)
        elif client_gone and self.done is None:
            outcome.status = "client_disconnected"
        elif observer.error is not None:
            outcome.status = "stream_error"
            outcome.error = json.dumps(observer.error)[:2000]
        elif self.failure is not None and not client_gone:
            # A client that left breaks the relay too: that is not the upstream failing.
            outcome.status = failure_kind(self.failure)
            outcome.error = repr(self.failure)
        elif self.done is None:
            outcome.status = "upstream_disconnected"
        return outcome


class MeteredStream(Response):
    """Relays SSE events byte for byte, reading usage on the side, and ends its attempt when
    the stream is done (the upstream finished or failed, a limit was passed, the client left)."""

    def __init__(self, attempt: Attempt, upstream: httpx.Response) -> None:
        attempt.hand_over()
        self.status_code = upstream.status_code
        self.background = None
        self.attempt, self.upstream = attempt, upstream
        self.relay = StreamRelay(
            attempt,
            upstream,
            withhold_usage=not attempt.chat.wants_usage,
            rename=requested_model(attempt),
        )
        headers = {
            "content-type": upstream.headers.get("content-type", "text/event-stream"),
            "cache-control": "no-cache",
            "x-accel-buffering": "no",
            **attempt.headers,
        }
        # No content-length: the body is a stream of unknown length.
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.client_gone = False

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

    async def _relay(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        translate = self.translate

        async def write(body: bytes) -> None:
            try:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            except OSError:
                self.client_gone = True
                raise

        async def pass_on(body: bytes) -> None:
            assert translate is not None
            body = translate(body)
            if body:
                await write(body)

        head = self.head()
        if head:
            await write(head)
        await self.relay.run(write if translate is None else pass_on)

    # What another API's stream (metering.proxy.responses.stream) changes: its first events,
    # each relayed part in its terms (None: the upstream's bytes as they came), and its end.
    translate: Callable[[bytes], bytes] | None = None

    def head(self) -> bytes:
        return b""

    async def _finish(self, send: Send) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.upstream.aclose()
            except Exception:
                log.debug("closing upstream stream failed", exc_info=True)
            relay = self.relay
            outcome = relay.outcome(self.client_gone)
            self.attempt.outcome = outcome
            await self.attempt.end()
            if self.client_gone:
                return
            tail = await self.tail(relay, outcome)
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def tail(self, relay: StreamRelay, outcome: Outcome) -> bytes:
        """The stream's last bytes, once its attempt has ended (its event settled)."""
        if relay.limit is not None:
            # The answer is cut: an error event, and no [DONE], which would say it ended.
            error = error_body(502, relay.limit.code, outcome.error or "")
            tail = b"data: " + json.dumps(error).encode() + b"\n\n"
        elif outcome.status in ("upstream_disconnected", "timeout"):
            error = error_body(502, "upstream_error", "the upstream stream ended early")
            tail = b"data: " + json.dumps(error).encode() + b"\n\n" + DONE
        else:
            tail = relay.done or DONE
        # The ledger's usage, when the client asked for usage and the upstream sent none:
        # ahead of the tail, an error event included (a client reads it before it raises).
        return usage_tail(self.attempt, relay.observer) + tail
