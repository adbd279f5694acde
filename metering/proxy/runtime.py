"""The proxy's long-lived objects in the process's container (metering.container.Services),
typed with the budgets' and auth's it reads: the proxy's functions take the container as a
ProxyServices, which it satisfies."""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

from metering.auth.runtime import AuthServices
from metering.budgets.refusals import RefusalLog
from metering.budgets.runtime import BudgetRuntime
from metering.proxy.live import LiveHolds
from metering.proxy.routing import Breakers
from metering.proxy.upstreams import Upstreams
from metering.settings import Catalog

if TYPE_CHECKING:
    from metering.proxy.tracing import Tracing


class ProxyServices(AuthServices, Protocol):
    @property
    def catalog(self) -> Catalog: ...
    @property
    def upstreams(self) -> Upstreams: ...
    @property
    def breakers(self) -> Breakers: ...
    @property
    def live_holds(self) -> LiveHolds: ...
    @property
    def budgets(self) -> BudgetRuntime: ...
    @property
    def refusals(self) -> RefusalLog: ...
    @property
    def tracing(self) -> "Tracing | None": ...


# ASGI's shapes, as the proxy's answers are called with them.
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Answer(Protocol):
    """What a chat completion is answered with: an ASGI response (built by
    metering.proxy.forward and metering.proxy.transport), called by whoever received the request."""

    async def __call__(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send
    ) -> None: ...
