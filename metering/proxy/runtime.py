"""The proxy's long-lived objects in the process's container (metering.container.Services),
typed with the budgets' and auth's it reads: the proxy's functions take the container as a
ProxyServices, which it satisfies."""

from typing import Protocol

from metering.auth.runtime import AuthServices
from metering.budgets.refusals import RefusalLog
from metering.budgets.runtime import BudgetRuntime
from metering.proxy.live import LiveHolds
from metering.proxy.routing import Breakers
from metering.proxy.upstreams import Upstreams
from metering.settings import Catalog


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
