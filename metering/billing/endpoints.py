"""POST /v1/events (admin, or a credential for its own usage), POST /v1/rerate and
POST /v1/adjustments (admin)."""

from fastapi import APIRouter, Depends

from metering.auth.principal import RULE_ERRORS, Principal, admin_only, any_principal
from metering.billing import ingest, rerate
from metering.billing.schemas import (
    AdjustmentIn,
    AdjustmentOut,
    EventsIn,
    EventsOut,
    RerateIn,
    RerateOut,
)
from metering.db import utcnow
from metering.errors import error_responses
from metering.money import format_usd
from metering.services import Services, get_services
from metering.timefmt import rfc3339

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


@router.post(
    "/rerate",
    responses=error_responses(400, 404, *RULE_ERRORS["admin"]),
    description="Correct the usage events of one model at one provider in [start, end) to the "
    "price history (a catalog entry's `effective_from` records a back-dated price): each event "
    "charged otherwise gets one adjustment event with the difference and the reason, in its "
    "own hour and budget window; original rows never change. A second rerate adds nothing.",
)
async def post_rerate(
    body: RerateIn,
    _: Principal = Depends(admin_only),
    services: Services = Depends(get_services),
) -> RerateOut:
    start = rerate.parse_moment(body.start, "start")
    end = rerate.parse_moment(body.end, "end") or utcnow()
    result = await rerate.rerate(
        services.db,
        provider=body.provider,
        model=body.model,
        start=start,
        end=end,
        reason=body.reason,
    )
    return RerateOut(**result.out())


@router.post(
    "/adjustments",
    status_code=201,
    responses=error_responses(400, 404, *RULE_ERRORS["admin"]),
    description="A manual adjustment (negative: a credit, e.g. for an outage) of a team, user, "
    "token or one event, with its reason: appended to the ledger as an adjustment event and "
    "charged to the budget window of `at` (default now; the event's own when it corrects one).",
)
async def post_adjustment(
    body: AdjustmentIn,
    _: Principal = Depends(admin_only),
    services: Services = Depends(get_services),
) -> AdjustmentOut:
    event = await rerate.adjust(
        services.db,
        amount=rerate.parse_amount(body.amount),
        reason=body.reason,
        team_id=body.team_id,
        user_id=body.user_id,
        token_id=body.token_id,
        corrects_event_id=body.corrects_event_id,
        at=rerate.parse_moment(body.at, "at"),
    )
    return AdjustmentOut(
        id=event.id,
        kind="adjustment",
        created_at=rfc3339(event.created_at),
        team_id=event.team_id,
        user_id=event.user_id,
        token_id=event.token_id,
        corrects_event_id=event.corrects_event_id,
        cost=format_usd(event.cost),
        reason=event.reason,
    )
