"""A bridged request's answer, at the far end of the proxy's one path: the upstream's chat
completion (one body, or a stream) turned into the Response object or its events, after the
attempt's event was settled, so that `usage` is the ledger's.

The metering on the side is the chat path's own (metering.proxy.stream.StreamRelay,
metering.proxy.completion): one ledger event per upstream request, however the answer ends."""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from metering.budgets.reserve import Reservation
from metering.ledger.outcome import Outcome
from metering.proxy.attempt import Attempt
from metering.proxy.dialects import Dialect
from metering.proxy.responses import native
from metering.proxy.responses.face import EventWriter, Face
from metering.proxy.stream import MeteredStream, StreamRelay
from metering.settings import ModelRoute, Provider

log = logging.getLogger("metering.proxy")

# Saves a finished response (metering.proxy.responses.service): awaited before the client
# gets the answer's end, so the next request may continue from it at once.
Save = Callable[[Face], Awaitable[None]]


class Bridge:
    """What a bridged request carries along the path: its face and how it is stored."""

    __slots__ = ("face", "save", "native", "history")

    def __init__(self, face: Face, save: Save | None) -> None:
        self.face, self.save = face, save
        # The attempt's provider serves the Responses API itself (metering.proxy.responses
        # .native): forwarded as sent, not bridged.
        self.native = False
        self.history: list[dict[str, Any]] = []  # the stored conversation put before the input

    def upstream(
        self,
        chat_body: dict[str, Any],
        provider: Provider,
        route: ModelRoute,
        reservation: Reservation,
        dialect: Dialect,
    ) -> dict[str, Any]:
        """What this attempt sends up: the client's Responses body to a provider that serves
        the Responses API, else the chat body (with what only some dialects take)."""
        self.native = provider.responses
        bridged = self.face.bridged
        if self.native:
            return native.upstream_body(
                bridged.body, self.history, route, reservation.max_tokens, dialect.withheld
            )
        bridged.upstream_extras(chat_body, dialect.reasoning_effort)
        return chat_body

    async def saved(self) -> None:
        """Store the finished response; one that cannot be stored (the database is gone) is
        logged and answered all the same: its event is settled, or its hold is charged."""
        if self.save is not None and self.face.stored is not None:
            try:
                await self.save(self.face)
            except Exception:
                log.exception("response %s could not be stored", self.face.id)


class ResponsesAnswer(Response):
    """A chat completion's body as a Response object, written once the attempt has ended."""

    def __init__(self, attempt: Attempt, bridge: Bridge, chat_answer: Response) -> None:
        self.attempt, self.bridge = attempt, bridge
        self.completion = bytes(chat_answer.body)
        self.status_code = 200
        self.background = None
        headers = {k: v for k, v in chat_answer.headers.items() if k.lower() != "content-length"}
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            completion = orjson.loads(self.completion)
        except orjson.JSONDecodeError:
            completion = {}
        if not isinstance(completion, dict):
            completion = {}
        body = self.bridge.face.from_completion(completion, self.attempt.charged)
        await self.bridge.saved()
        self.body = orjson.dumps(body)
        self.raw_headers = [
            (k, v) for k, v in self.raw_headers if k not in (b"content-length", b"content-type")
        ]
        self.raw_headers += [
            (b"content-length", str(len(self.body)).encode()),
            (b"content-type", b"application/json"),
        ]
        await super().__call__(scope, receive, send)


class ResponsesStream(MeteredStream):
    """The upstream's chat stream as Responses events, written as its chunks come (never held
    to the end); the last, `response.completed` with the ledger's usage, once the event is
    settled. A stream that fails ends with `response.failed`."""

    def __init__(self, attempt: Attempt, bridge: Bridge, upstream: httpx.Response) -> None:
        super().__init__(attempt, upstream)
        self.bridge = bridge
        self.writer = EventWriter(bridge.face)
        # The observer reads each event only where it must (usage, an error, the finish), as on
        # chat; the writer parses each one itself, once.
        self.relay = StreamRelay(attempt, upstream, on_data=self.writer.data)
        self.raw_headers = [
            (k, b"text/event-stream; charset=utf-8" if k == b"content-type" else v)
            for k, v in self.raw_headers
        ]
        self.translate = self._events

    def _events(self, _raw: bytes) -> bytes:
        return self.writer.take()

    def head(self) -> bytes:
        return self.writer.start()

    async def tail(self, relay: StreamRelay, outcome: Outcome) -> bytes:
        writer, event = self.writer, self.attempt.charged
        if outcome.status == "ok":
            out = writer.take() + writer.completed(event)
            await self.bridge.saved()
            return out
        error: dict[str, Any] = relay.observer.error or {}
        if relay.limit is not None:
            code, message = relay.limit.code, outcome.error or relay.limit.code
        elif error:
            code = str(error.get("code") or "server_error")
            message = str(error.get("message") or "the upstream failed mid-stream")
        else:
            code, message = "server_error", "the upstream stream ended early"
        return writer.take() + writer.failed(code, message, event)
