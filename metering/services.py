"""The app's long-lived services, held in one typed object built by create_app()'s lifespan.

Endpoints obtain it with `services: Services = Depends(get_services)` and pass what a service
function needs as arguments; service code never reads FastAPI's app or request state.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Depends
from starlette.requests import HTTPConnection

from metering.auth import invalidation
from metering.auth.failures import FailedCredentials
from metering.auth.invalidation import Credentials
from metering.auth.passwords import Passwords
from metering.auth.tokens import Signer
from metering.budgets.leases import LeaseBook
from metering.budgets.refusals import RefusalLog
from metering.clock import SYSTEM, Clock
from metering.db import Database
from metering.settings import Catalog, Settings

if TYPE_CHECKING:  # the proxy's own types, named here only for the annotations
    from metering.alerts.outbox.delivery import Outbox
    from metering.proxy.live import LiveHolds
    from metering.proxy.routing import Breakers
    from metering.proxy.upstreams import Upstreams


@dataclass(slots=True)
class Services:
    settings: Settings
    db: Database
    passwords: Passwords
    signer: Signer
    credential_failures: FailedCredentials
    # Credential -> principal, dropped on every replica when a credential's rights change.
    credentials: Credentials
    upstreams: "Upstreams"
    breakers: "Breakers"
    live_holds: "LiveHolds"
    # Slices of budgets' credit this process admits requests against in memory.
    leases: LeaseBook
    # Replaced when the catalog file changes; a request reads it once, when it starts.
    catalog: Catalog
    # Requests refused before anything was reserved (402, 429, 403), written in groups.
    refusals: RefusalLog
    # The webhook delivery worker of this process (None when background work is off).
    outbox: "Outbox | None" = None
    # The time of windows, rate minutes, expiries and holds' TTL (metering.clock).
    clock: Clock = SYSTEM


async def get_services(connection: HTTPConnection) -> Services:
    """The FastAPI dependency that hands an endpoint the app's services."""
    return connection.app.state.services


async def unit_of_work(services: Services = Depends(get_services)):
    """One transaction per call. Use it as Depends(unit_of_work, scope="function"): it then
    commits before the response leaves, so a client never sees a 201 for a row not yet there."""
    async with services.db.transaction() as session:
        yield session
    # Committed: a change to what a credential may do reaches every replica before the answer.
    await services.credentials.changed(invalidation.pending(session))
