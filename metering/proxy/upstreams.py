"""One pooled HTTP client per upstream provider, made at startup, and how its failures read.

A request the upstream dropped on a kept-alive connection before answering a byte is sent once
more, on a new connection: that is the race of a server closing an idle connection just as it
is reused, and the request was never read. A connection refused or reset as it was being made
is tried once more too: nothing went out, and a listener whose queue overflowed for an instant
(a burst of connections at once) takes the next.
"""

import asyncio
import errno
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import aiohttp
import httpx
from httpx._client import BoundAsyncStream
from httpx_aiohttp import HttpxAiohttpClient
from httpx_aiohttp.transport import AiohttpTransport

from metering.proxy.dialects.base import Dialect
from metering.settings import Catalog, Provider

if TYPE_CHECKING:
    from aiohttp.client_reqrep import ConnectionKey
    from aiohttp.tracing import Trace

log = logging.getLogger("metering.proxy")

KEEPALIVE_S = 5.0  # how long an idle connection stays in the pool (httpx's default)
_DROPPED_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class _Send:
    """What the connection pool did for one send: set by `_Connector` in the same task."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


_SEND: ContextVar[_Send | None] = ContextVar("metering_upstream_send", default=None)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, noting in the sending task's `_Send` when it hands out a kept-alive
    connection (the race `dropped_unanswered` retries is only possible on one). aiohttp's trace
    signals would tell the same, at the cost of a trace and its signals on every request."""

    async def _get(
        self, key: "ConnectionKey", traces: list["Trace"]
    ) -> aiohttp.connector.Connection | None:
        connection = await super()._get(key, traces)
        if connection is not None:
            current = _SEND.get()
            if current is not None:
                current.reused = True
        return connection


def _session(max_connections: int, force_close: bool) -> aiohttp.ClientSession:
    connector = _Connector(
        limit=max_connections,
        keepalive_timeout=None if force_close else KEEPALIVE_S,
        force_close=force_close,
        ssl=httpx.create_ssl_context(trust_env=False),
    )
    # One session serves every user: a cookie one upstream answer sets must never be sent with
    # another user's request.
    return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())


class _NoCookies(httpx.Cookies):
    """A cookie jar that keeps nothing and sends nothing: one client serves every user, so a
    cookie one upstream answer sets must never go with another user's request; and reading
    an answer's cookies (a urllib request and response built for every answer) was 4% of the
    proxy's CPU per request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


_NO_COOKIES = _NoCookies()


class _UpstreamClient(HttpxAiohttpClient):
    """httpx's client on the aiohttp transport, with no cookie jar (_NoCookies)."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: object) -> None:
        pass  # httpx's constructor sets an empty jar: there is none to set


def _client(max_connections: int, force_close: bool = False) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    transport = AiohttpTransport(
        limits=limits, trust_env=False, client=lambda: _session(max_connections, force_close)
    )
    return _UpstreamClient(transport=transport, trust_env=False, follow_redirects=False)


def _unbound(response: httpx.Response) -> httpx.Response:
    """The response reading its transport's stream itself. httpx's client wraps that stream in
    one bound to the response (to set `elapsed` when it closes), which makes the response and
    the wrapper a reference cycle: every answer, with the aiohttp response, reader and headers
    behind it (about forty objects), was freed only by the garbage collector, whose young
    generation then held thousands of them at each pass. Nothing here reads `elapsed`."""
    stream = response.stream
    if isinstance(stream, BoundAsyncStream):
        response.stream = stream._stream
    return response


class Upstreams:
    def __init__(self, catalog: Catalog, max_connections: int) -> None:
        # The aiohttp transport keeps httpx's API but holds its throughput as concurrency grows.
        self.max_connections = max_connections
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.fresh: dict[str, httpx.AsyncClient] = {}  # new connection per request: retries
        # Per provider: what its chat requests share.
        self._made: dict[
            str, tuple[Provider, httpx.URL, httpx.Headers, dict[str, float | None]]
        ] = {}
        self.ensure(catalog)

    def ensure(self, catalog: Catalog) -> None:
        """A client for every provider of the catalog (a reload may add providers)."""
        for name in catalog.providers:
            if name not in self.clients:
                self.clients[name] = _client(self.max_connections)

    def client(self, provider: str) -> httpx.AsyncClient:
        return self.clients[provider]

    def chat_request(
        self, provider: Provider, dialect: Dialect, content: bytes, native: bool = False
    ) -> httpx.Request:
        """A chat completion's request to `provider`, built as its client's build_request would
        build it (the client's default headers, the dialect's, the provider's timeouts) from
        parts made once per provider: only the body is the request's own. `native`: a
        Responses API request to a provider that serves it (`{base_url}/responses`)."""
        if native:
            headers = httpx.Headers(self.clients[provider.name].headers)
            headers.update(dialect.headers(provider))
            headers["accept-encoding"] = "identity"
            limits = httpx.Timeout(provider.timeout_s, connect=provider.connect_timeout_s)
            return httpx.Request(
                "POST",
                f"{provider.base_url}/responses",
                content=content,
                headers=headers,
                extensions={"timeout": limits.as_dict()},
            )
        made = self._made.get(provider.name)
        if made is None or made[0] is not provider:
            headers = httpx.Headers(self.clients[provider.name].headers)
            headers.update(dialect.headers(provider))
            headers["accept-encoding"] = "identity"
            timeout = httpx.Timeout(
                provider.timeout_s, connect=provider.connect_timeout_s
            ).as_dict()
            url = httpx.URL(dialect.url(provider))
            made = self._made[provider.name] = (provider, url, headers, timeout)
        _, url, headers, timeout = made
        return httpx.Request(
            "POST", url, content=content, headers=headers, extensions={"timeout": timeout}
        )

    async def send(self, provider: str, request: httpx.Request) -> httpx.Response:
        """Send a request and return its response (headers read, body streamed)."""
        current = _Send()
        token = _SEND.set(current)
        try:
            return _unbound(await self.clients[provider].send(request, stream=True))
        except (httpx.HTTPError, OSError) as exc:
            if not (current.reused and dropped_unanswered(exc)) and not refused_at_connect(exc):
                raise
            log.warning("upstream %s: %r; sending once more on a new connection", provider, exc)
        finally:
            _SEND.reset(token)
        if provider not in self.fresh:
            self.fresh[provider] = _client(self.max_connections, force_close=True)
        return _unbound(await self.fresh[provider].send(request, stream=True))

    async def close(self) -> None:
        clients = [*self.clients.values(), *self.fresh.values()]
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def dropped_unanswered(exc: BaseException) -> bool:
    """The upstream closed (or reset) the connection while the request was being sent or
    before any byte of its answer: not a connect failure, not a timeout."""
    for cause in _chain(exc):
        if isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ServerTimeoutError):
            return False
        if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientConnectionResetError):
            return True
        if isinstance(cause, aiohttp.ClientOSError) and cause.errno is not None:
            return cause.errno in _DROPPED_ERRNOS
        # A ClientOSError with no errno ("Can not write request body") says what it is through
        # its cause: the connection closing as the request was written (a reset, above).
    return False


def refused_at_connect(exc: BaseException) -> bool:
    """The connection could not be made, at once (refused, reset, no address): no request went
    out. Not a connect timeout: the upstream's connect timeout is not to be paid twice."""
    for cause in _chain(exc):
        if isinstance(cause, aiohttp.ConnectionTimeoutError | aiohttp.ServerTimeoutError):
            return False
        if isinstance(cause, aiohttp.ClientConnectorError):
            return True
    return False


def failure_kind(exc: BaseException) -> str:
    """'unreached' (no request went out), 'timeout', or 'upstream_disconnected' (it went out,
    then the connection failed)."""
    for cause in _chain(exc):
        # aiohttp's own error says what happened; the httpx error it is mapped to may not
        # (a server closing the connection reads as httpx.ConnectTimeout).
        if isinstance(cause, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
            return "unreached"
        if isinstance(cause, aiohttp.ServerTimeoutError):
            return "timeout"
        if isinstance(cause, aiohttp.ClientError):
            return "upstream_disconnected"
    for cause in _chain(exc):
        if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout) and cause.__cause__ is None:
            return "unreached"
        if isinstance(cause, ConnectionRefusedError):
            return "unreached"
    for cause in _chain(exc):
        if isinstance(cause, asyncio.TimeoutError | TimeoutError | httpx.TimeoutException):
            return "timeout"
    return "upstream_disconnected"
