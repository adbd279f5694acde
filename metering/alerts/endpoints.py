"""The webhooks API (admin) and GET /v1/alerts (admin: every event; a user: its own)."""

from typing import Literal

from fastapi import APIRouter, BackgroundTasks, Query, Response

from metering.alerts import record, service
from metering.alerts.schemas import (
    AlertList,
    DeliveryList,
    TestSent,
    WebhookCreate,
    WebhookCreated,
    WebhookList,
    alert_out,
)
from metering.alerts.targets import Reach
from metering.auth.principal import (
    RULE_ERRORS,
    AdminPrincipal,
    SelfPrincipal,
)
from metering.container import ServicesDep, SessionDep
from metering.errors import error_responses

router = APIRouter(prefix="/v1", tags=["alerts"])

ADMIN = RULE_ERRORS["admin"]
LIST_ERRORS = tuple(status for status in RULE_ERRORS["self"] if status != 404)
EventType = Literal[record.TYPES]  # type: ignore[valid-type]


# What the settings, the teams and the webhooks registered decide (the document cannot).
WEBHOOK_RULES: dict[str | None, str] = {
    "url": "http only to a loopback address, and a literal internal address, as the "
    "METERING_WEBHOOKS_ALLOW_* settings allow",
    "team_id": "a live team",
    None: f"at most {service.MAX_WEBHOOKS} webhooks",
}


@router.post(
    "/webhooks", status_code=201, responses=error_responses(400, *ADMIN, rules=WEBHOOK_RULES)
)
async def create_webhook(
    body: WebhookCreate,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> WebhookCreated:
    """Register a receiver of alert events (one team's, or global). The signing secret is
    generated when not given, and shown this once."""
    created = await service.create_webhook(
        session,
        url=body.url,
        events=body.events,
        team_id=body.team_id,
        secret=body.secret,
        reach=Reach.of(services.settings),
    )
    return WebhookCreated(**created)


@router.get("/webhooks", responses=error_responses(*ADMIN))
async def list_webhooks(_: AdminPrincipal, session: SessionDep) -> WebhookList:
    """The webhooks, oldest first, without their secrets."""
    return WebhookList(data=await service.list_webhooks(session))


@router.delete("/webhooks/{webhook_id}", status_code=204, responses=error_responses(404, *ADMIN))
async def delete_webhook(webhook_id: str, _: AdminPrincipal, session: SessionDep) -> Response:
    """Stop sending to this webhook; its pending deliveries are dropped (marked failed)."""
    await service.delete_webhook(session, webhook_id)
    return Response(status_code=204)


@router.post("/webhooks/{webhook_id}/test", status_code=202, responses=error_responses(404, *ADMIN))
async def test_webhook(
    webhook_id: str,
    background: BackgroundTasks,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> TestSent:
    """Send a `webhook.test` event to this webhook (signed, retried like any other)."""
    sent = await service.test_webhook(session, webhook_id)
    if services.outbox is not None:
        background.add_task(services.outbox.poke)  # after the commit
    return TestSent(**sent)


@router.get("/webhooks/{webhook_id}/deliveries", responses=error_responses(400, 404, *ADMIN))
async def list_deliveries(
    webhook_id: str,
    _: AdminPrincipal,
    session: SessionDep,
    limit: int = Query(50, ge=1, le=service.MAX_DELIVERIES_LISTED),
) -> DeliveryList:
    """Recent deliveries, newest first: status, attempts with their status codes, next retry."""
    return DeliveryList(data=await service.list_deliveries(session, webhook_id, limit))


@router.get("/alerts", responses=error_responses(400, *LIST_ERRORS))
async def list_alerts(
    principal: SelfPrincipal,
    services: ServicesDep,
    scope: Literal["token", "user", "team", "end_user", "reconciliation"] | None = None,
    type: EventType | None = None,  # the query parameter's name
    subject_id: str | None = Query(None, max_length=40),
    limit: int = Query(100, ge=1, le=1000),
) -> AlertList:
    """Recent alert events, newest first. The admin key sees all; a user's credential sees the
    events of its own user and tokens."""
    events = await service.list_alerts(
        services.db,
        user_id=None if principal.is_admin else principal.user_id,
        scope=scope,
        type_=type,
        subject_id=subject_id,
        limit=limit,
    )
    return AlertList(data=[alert_out(e) for e in events])
