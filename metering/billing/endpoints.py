"""POST /v1/events (admin, or a credential for its own usage), POST /v1/rerate and
POST /v1/adjustments (admin)."""

from fastapi import APIRouter, Depends

from metering.auth.principal import RULE_ERRORS, Principal, any_principal
from metering.billing import ingest
from metering.billing.schemas import EventsIn, EventsOut
from metering.errors import error_responses
from metering.services import Services, get_services

router = APIRouter(prefix="/v1")


@router.post(
    "/events",
    responses=error_responses(400, 413, *RULE_ERRORS["user"]),
    description="Usage from outside the proxy, up to 1,000 events a batch, each recorded "
    "exactly once under its idempotency key (unique per team, kept for good): one answer per "
    "event, in the order sent (`created`, `duplicate` with the recorded event's id, "
    "`conflict`: the key was recorded with other content, `rejected` with the reason). Each "
    "event is priced at the catalog price in force when it happened and charged to the budget "
    "window it falls in.",
)
async def post_events(
    body: EventsIn,
    principal: Principal = Depends(any_principal),
    services: Services = Depends(get_services),
) -> EventsOut:
    data = await ingest.ingest(services.db, services.catalog, principal, body.events)
    return EventsOut(data=data)
