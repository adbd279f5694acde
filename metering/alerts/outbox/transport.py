"""The webhook worker's connections, each to an address checked when it is opened: the host is
resolved once, every address it resolves to is checked (one internal address refuses them all),
and the socket is opened to one of those very addresses. TLS is still negotiated, and its
certificate verified, for the URL's host, and the pool keeps connections by that host: a DNS
answer that changes between the check and the connect (rebinding) reaches nothing internal."""

import asyncio
import socket
import ssl
import typing

import httpcore
import httpx

from metering.alerts.targets import IPAddress, Reach, Refused, literal


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address of `host`, once, in the resolver's order."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpcore.ConnectError(f"{host} does not resolve: {exc}") from None
    addresses = [literal(str(info[4][0])) for info in infos]
    return list(dict.fromkeys(a for a in addresses if a is not None))


class Guard(httpcore.AsyncNetworkBackend):
    """Opens a connection only to addresses `reach` allows; raises `Refused` otherwise."""

    def __init__(self, reach: Reach) -> None:
        self.reach = reach
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                addresses = await resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
        for ip in addresses:
            reason = self.reach.refusal(ip)
            if reason is not None:
                raise Refused(f"{host} points to an internal address: {reason}")
        error: Exception = httpcore.ConnectError(f"{host} has no address")
        for ip in addresses:
            try:
                return await self.inner.connect_tcp(
                    str(ip),
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:
                error = exc  # the next address, as a resolver's caller does
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("webhooks are not sent over unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a pool whose connections `Guard` opens. httpx takes no network
    backend, so the pool it builds is replaced by one with the same limits and TLS checks."""

    def __init__(
        self, reach: Reach, limits: httpx.Limits, verify: ssl.SSLContext | bool = True
    ) -> None:
        super().__init__(trust_env=False, limits=limits)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=Guard(reach),
        )
