"""The HTTP server: one uvicorn configuration for `metering serve`, the demo, the tests and bench,
and the connection-level limits that protect a replica from slow and hostile clients.

uvicorn alone keeps a connection open for as long as its client trickles the request line and
headers, waits on a trickled body without end and accepts any number of connections. The
protocol here adds, per connection:

- a header deadline (METERING_HEADER_TIMEOUT_S) from the connection's opening, and from the
  first byte of each further request on a kept-alive connection, to the end of the headers;
- a body deadline (METERING_BODY_TIMEOUT_S) from the end of the headers to the end of the body;
- a cap on the request line and headers (METERING_MAX_HEADER_BYTES);
- a cap on open connections per process (METERING_MAX_CONNECTIONS): a connection beyond it is
  answered 503 once its headers arrive, and closed.

Each limit answers an OpenAI-shaped error (408, 431, 503) and closes the connection; so does a
request the HTTP parser refuses (malformed framing: 400), where uvicorn would answer plain text.
"""

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from metering.errors import error_body, retry_headers
from metering.settings import Settings

PROTOCOL = "metering.server:GuardedProtocol"
HEADERS_TOO_LARGE = ("headers_too_large", "the request line and headers are too large")
OVER_CAPACITY = ("server_busy", "too many open connections; retry later")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    max_header_bytes: int = 64 * 1024

    @classmethod
    def of(cls, settings: Settings) -> "EdgeLimits":
        return cls(
            header_timeout_s=settings.header_timeout_s,
            body_timeout_s=settings.body_timeout_s,
            max_connections=settings.max_connections,
            max_header_bytes=settings.max_header_bytes,
        )


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config carrying the limits to every connection (and to every worker process,
    which receives the configuration pickled)."""

    def __init__(self, app: Any, *, limits: EdgeLimits, **options: Any) -> None:
        super().__init__(app, **options)
        self.limits = limits


def server_config(app: Any, settings: Settings, *, host: str, port: int, **options: Any):
    """The one uvicorn configuration every way of serving the app uses."""
    defaults: dict[str, Any] = {
        "http": PROTOCOL,
        "ws": "none",
        "lifespan": "on",
        "access_log": False,
        "timeout_keep_alive": settings.keep_alive_s,
        "forwarded_allow_ips": settings.forwarded_allow_ips,
    }
    return EdgeConfig(
        app, limits=EdgeLimits.of(settings), host=host, port=port, **{**defaults, **options}
    )


def error_bytes(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-shaped error, closing the connection."""
    body = json.dumps(error_body(status, code, message)).encode()
    head = (
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n"
    )
    return STATUS_LINE[status] + head + body


def answer(status: int, code: str, message: str, retry_after: int | None = None):
    """An ASGI app that answers every request with this error and closes the connection."""
    body = json.dumps(error_body(status, code, message)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    waits = {"retry-after": str(retry_after)} if retry_after is not None else None
    headers += [(k.encode(), v.encode()) for k, v in retry_headers(status, waits).items()]

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class _HeldHead:
    """The transport a response cycle writes to between its status line and headers and its
    first body bytes: the head is kept and written with the body, in one write. Anything else
    asked of it writes the head first."""

    __slots__ = ("cycle", "transport", "head")

    def __init__(self, cycle: "JoinedCycle", transport) -> None:
        self.cycle = cycle
        self.transport = transport
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.head is None:  # uvicorn's one write of the status line and headers
            self.head = data
            return
        self._restore()
        self.transport.writelines((self.head, data))

    def flush(self) -> None:
        self._restore()
        if self.head and not self.transport.is_closing():
            self.transport.write(self.head)

    def _restore(self) -> None:
        if self.cycle.transport is self:
            self.cycle.transport = self.transport

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


def _has_length(headers) -> bool:
    return any(name.lower() == b"content-length" for name, _ in headers)


class JoinedCycle(RequestResponseCycle):
    """uvicorn's response cycle, writing a response whose length is known (Content-Length: a
    whole body, every error) as one write of its head and its first body bytes, where uvicorn
    writes the status line and headers, then the body: one syscall and one TCP segment less
    per answer, for the server and for the client that reads it."""

    async def send(self, message) -> None:
        if (
            message["type"] == "http.response.start"
            and not self.response_started
            and not self.disconnected
            and self.scope["method"] != "HEAD"
            and _has_length(message.get("headers", ()))
        ):
            held = _HeldHead(self, self.transport)
            # Not an asyncio.Transport: it has the methods the response cycle calls on one.
            self.transport = held  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                if held.head is None:  # nothing was written (refused, or disconnected)
                    held.flush()
            return
        try:
            await super().send(message)
        finally:
            if isinstance(self.transport, _HeldHead):  # the body did not write: the head goes
                self.transport.flush()


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines and caps (see the module's docstring)."""

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: EdgeLimits = getattr(config, "limits", None) or EdgeLimits()
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.header_bytes = 0
        self.refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.refused = len(self.connections) > self.limits.max_connections
        self.header_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._headers_timed_out
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.header_timer is not None:  # headers under way: the parser buffers them
            self.header_bytes += len(data)
        super().data_received(data)
        if self.header_timer is not None and self.header_bytes > self.limits.max_header_bytes:
            self._refuse(431, *HEADERS_TOO_LARGE)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid_request", f"malformed HTTP request: {msg}")

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(
                self.limits.header_timeout_s, self._headers_timed_out
            )

    def on_headers_complete(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        self.header_bytes = 0
        # Headers that arrived in one piece were never counted while under way.
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if size > self.limits.max_header_bytes:
            self.app = answer(431, *HEADERS_TOO_LARGE)
        elif self.refused:
            self.app = answer(503, *OVER_CAPACITY, retry_after=1)
        super().on_headers_complete()
        self.body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        cycle.__class__ = JoinedCycle  # made by uvicorn's on_headers_complete; not started yet
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        super().on_message_complete()

    # Limits
    def _headers_timed_out(self) -> None:
        self.header_timer = None
        self._refuse(408, "request_timeout", "the request headers did not arrive in time")

    def _body_timed_out(self) -> None:
        self.body_timer = None
        if self.cycle is not None and self.cycle.response_complete:
            # Answered without its whole body (a 401, say): only the rest of the body is late.
            self._cancel_timers()
            self.transport.close()
            return
        self._refuse(408, "request_timeout", "the request body did not arrive in time")

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer with an error if no answer has started on this connection, then close it; a
        request still in the app sees its client gone (http.disconnect)."""
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(error_bytes(status, code, message))
        if cycle is not None and not cycle.response_complete:
            cycle.response_started = True
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self.header_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.header_timer = self.body_timer = None
