"""The long-lived objects of one process, in one object (`Services`) built by create_app()'s
lifespan, and the dependencies that hand it to endpoints.

The container imports no domain: the domains register into it. What the foundation gives every
domain (settings, database, catalog, clock) is typed here; each domain's own long-lived objects
sit in a slot named here and typed by that domain, through a Protocol of its own that the
container satisfies (metering.auth.runtime.AuthServices, metering.proxy.runtime.ProxyServices).
Reading a slot stays a plain attribute read.

Endpoints declare it in their signature, `services: ServicesDep` (or a domain's view of it), and
their unit of work, `session: SessionDep`, and pass what a service function needs as
arguments. This module is the one place that reads FastAPI's app state.
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.requests import HTTPConnection

from metering.clock import SYSTEM, Clock
from metering.db import Database
from metering.settings import Catalog, Settings


@dataclass(slots=True)
class Services:
    settings: Settings
    db: Database
    # auth's (metering.auth.runtime): the password hasher, the token signer, the failed
    # credentials counted per address, and credential -> principal, dropped on every replica
    # when a credential's rights change.
    passwords: Any
    signer: Any
    credential_failures: Any
    credentials: Any
    # The proxy's (metering.proxy.runtime): upstream clients, breakers, the live holds.
    upstreams: Any
    breakers: Any
    live_holds: Any
    # budgets' (metering.budgets.runtime.BudgetRuntime): the settle and admission queues, the
    # exhausted budgets recorded, the credit leases this process admits requests against.
    budgets: Any
    # Replaced when the catalog file changes; a request reads it once, when it starts.
    catalog: Catalog
    # budgets': requests refused before anything was reserved (402, 429, 403), written in
    # groups.
    refusals: Any
    # The proxy's: the traces of proxied requests (metering.proxy.tracing), None when off.
    tracing: Any = None
    # alerts': the webhook delivery worker of this process (None when background work is off).
    outbox: Any = None
    # The time of windows, rate minutes, expiries and holds' TTL (metering.clock).
    clock: Clock = SYSTEM
    # Called with each unit of work's session once it has committed (auth registers the
    # credential changes it made, so they reach every replica before the answer).
    after_commit: Callable[[AsyncSession], Awaitable[None]] | None = None


def install(app: FastAPI, services: Services) -> None:
    """Make `services` the container endpoints get (create_app's lifespan)."""
    app.state.services = services


async def get_services(connection: HTTPConnection) -> Services:
    """The FastAPI dependency that hands an endpoint the app's services."""
    services: Services = connection.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def unit_of_work(services: ServicesDep) -> AsyncIterator[AsyncSession]:
    """One transaction per call, taken as SessionDep (scope "function"): it then commits before
    the response leaves, so a client never sees a 201 for a row not yet there."""
    async with services.db.transaction() as session:
        yield session
    if services.after_commit is not None:
        await services.after_commit(session)


SessionDep = Annotated[AsyncSession, Depends(unit_of_work, scope="function")]
