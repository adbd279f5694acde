"""One pooled HTTP client per upstream provider, made at startup, and how its failures read."""

import asyncio
from http.cookiejar import DefaultCookiePolicy

import aiohttp
import httpx
from httpx_aiohttp import HttpxAiohttpClient

from metering.settings import Catalog


class Upstreams:
    def __init__(self, catalog: Catalog, max_connections: int) -> None:
        # The aiohttp transport keeps httpx's API but holds its throughput as concurrency grows.
        self.limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.ensure(catalog)

    def ensure(self, catalog: Catalog) -> None:
        """A client for every provider of the catalog (a reload may add providers)."""
        for name in catalog.providers:
            if name not in self.clients:
                client = HttpxAiohttpClient(
                    limits=self.limits, trust_env=False, follow_redirects=False
                )
                # One client serves every user: a cookie one upstream answer sets must never be
                # sent with another user's request.
                client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))
                self.clients[name] = client

    def client(self, provider: str) -> httpx.AsyncClient:
        return self.clients[provider]

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()), return_exceptions=True)


def _chain(exc: BaseException):
    seen = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def failure_kind(exc: BaseException) -> str:
    """'unreached' (no request went out), 'timeout', or 'upstream_disconnected' (it went out,
    then the connection failed)."""
    for cause in _chain(exc):
        if isinstance(cause, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
            return "unreached"
        if isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout) and cause.__cause__ is None:
            return "unreached"
        if isinstance(cause, ConnectionRefusedError):
            return "unreached"
    for cause in _chain(exc):
        if isinstance(cause, asyncio.TimeoutError | TimeoutError | httpx.TimeoutException):
            return "timeout"
        if isinstance(cause, aiohttp.ServerTimeoutError):
            return "timeout"
    return "upstream_disconnected"
