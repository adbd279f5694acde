"""POST /v1/events (admin, or a credential for its own usage), POST /v1/rerate and
POST /v1/adjustments (admin)."""

from fastapi import APIRouter, Query, Request, Response

from metering.auth.principal import RULE_ERRORS, AdminPrincipal, IngestingPrincipal
from metering.billing import ingest, keys, rerate
from metering.billing.keys import IngestKeyCreate, IngestKeyCreated, IngestKeyList, IngestKeyOut
from metering.billing.schemas import (
    AdjustmentIn,
    AdjustmentOut,
    EventsIn,
    EventsOut,
    RerateIn,
    RerateOut,
)
from metering.budgets.ceilings import RUN, run_of, unknown_run
from metering.budgets.runs import UnknownRun
from metering.container import ServicesDep, SessionDep
from metering.db import utcnow
from metering.errors import InvalidRequest, error_responses
from metering.money import format_usd
from metering.timefmt import rfc3339

router = APIRouter(prefix="/v1")


@router.post(
    "/events",
    responses=error_responses(400, 413, *RULE_ERRORS["ingest"]),
    description="Usage from outside the proxy, up to 1,000 events a batch, each recorded "
    "exactly once under its idempotency key (unique per team, kept for good): one answer per "
    "event, in the order sent (`created`; `duplicate` with the recorded event's id; "
    "`conflict`: the key was recorded with other content; `rejected` with the `error`, a "
    "`reason` and, for a limit, its `scope`; `retry`: it could not be written now, send it "
    "again). Each event is priced at the catalog price in force when it happened and charged "
    "to the budget window it falls in. With the admin key or a team's ingestion key (its own "
    "team only) it is charged in full; with a user's own API or access token each event is "
    "admitted like a request of that credential (allowed_models, rpm and tpm: one request and "
    "its tokens, credit at token, user, team and the `x-metering-run` run's scope) and one "
    "that does not fit is `rejected` (`model_not_allowed`, `rate_limit_exceeded`, "
    "`budget_exceeded`) and recorded as a refusal, never charged. No event may take a counter "
    "past its ceiling (`counter_ceiling`); an invalid one is `invalid_event`.",
)
async def post_events(
    request: Request,
    body: EventsIn,
    principal: IngestingPrincipal,
    services: ServicesDep,
) -> EventsOut:
    run = None
    if not principal.charged_in_full:
        assert principal.team_id is not None  # a user's credential
        run = run_of(request.headers, principal.team_id, services.settings.run_idle_s)
    elif RUN in request.headers:
        raise InvalidRequest(
            f"{RUN} applies to usage a user's own credential reports; the admin key and "
            "ingestion keys report usage charged in full",
            param=RUN,
        )
    try:
        data = await ingest.ingest(
            services.db,
            services.catalog,
            principal,
            body.events,
            admissions=services.budgets.admissions,
            refusals=services.refusals,
            run=run,
        )
    except UnknownRun:
        assert run is not None  # only a run named in the request is unknown
        raise unknown_run(run) from None
    return EventsOut(data=data)


# What the clock and the budgets decide (the document cannot).
RERATE_RULES: dict[str | None, str] = {"end": "after start (default: now)"}
ADJUSTMENT_RULES: dict[str | None, str] = {
    "amount": "keeps every budget's spent it changes from 0 to 9,000,000 USD",
    "at": "not in the future, at most 35 days back (less with METERING_RETENTION_DAYS)",
}


@router.post(
    "/rerate",
    responses=error_responses(400, 404, *RULE_ERRORS["admin"], rules=RERATE_RULES),
    description="Correct the usage events of one model at one provider in [start, end) to the "
    "price history (a catalog entry's `effective_from` records a back-dated price): each event "
    "charged otherwise gets one adjustment event with the difference and the reason, in its "
    "own hour and budget window; original rows never change. A second rerate adds nothing. "
    "A rerate is never refused for the budgets it charges (the price was wrong): the budget "
    "windows it charges more and leaves above their `credit_limit` are listed in `over_limit` "
    "and raise `budget.exhausted`.",
)
async def post_rerate(
    body: RerateIn,
    _: AdminPrincipal,
    services: ServicesDep,
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
    responses=error_responses(400, 404, *RULE_ERRORS["admin"], rules=ADJUSTMENT_RULES),
    description="A manual adjustment (negative: a credit, e.g. for an outage) of a team, user, "
    "token or one event, with its reason: appended to the ledger as an adjustment event and "
    "charged to the budget window of `at` (default now; the event's own when it corrects one). "
    "400 naming `amount` when it is beyond 1,000,000 USD either way, or would take a budget's "
    "`spent` it changes (current or closed window) below zero or past 9,000,000 USD, or a "
    "rollup's sum past 9,000,000 USD either way; 400 naming `at` when `at` is in the future or "
    "more than 35 days back (fewer when METERING_RETENTION_DAYS is shorter). Checked and "
    "written in one transaction, the budgets locked: concurrent adjustments cannot together "
    "pass a bound.",
)
async def post_adjustment(
    body: AdjustmentIn,
    _: AdminPrincipal,
    services: ServicesDep,
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
        retention_days=services.settings.retention_days,
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


# A team's ingestion keys (admin)


@router.post(
    "/teams/{team_id}/ingest-keys",
    status_code=201,
    responses=error_responses(400, 404, 409, *RULE_ERRORS["admin"]),
    description="A new ingestion key of the team: it may report usage (POST /v1/events) for "
    "the team's tokens, users and team only, charged in full, and call nothing else. The "
    "secret is in this answer only. At most 20 active keys per team.",
)
async def create_ingest_key(
    team_id: str,
    body: IngestKeyCreate,
    _: AdminPrincipal,
    session: SessionDep,
) -> IngestKeyCreated:
    key, secret = await keys.create(session, team_id, body.name)
    return IngestKeyCreated(**IngestKeyOut.of(key).model_dump(), key=secret)


@router.get(
    "/teams/{team_id}/ingest-keys",
    responses=error_responses(400, 404, *RULE_ERRORS["admin"]),
    description="The team's ingestion keys, never their secrets.",
)
async def list_ingest_keys(
    team_id: str,
    _: AdminPrincipal,
    session: SessionDep,
    include_revoked: bool = Query(False),
) -> IngestKeyList:
    found = await keys.listed(session, team_id, include_revoked)
    return IngestKeyList(data=[IngestKeyOut.of(k) for k in found])


@router.delete(
    "/teams/{team_id}/ingest-keys/{key_id}",
    status_code=204,
    responses=error_responses(400, 404, *RULE_ERRORS["admin"]),
    description="Revoke an ingestion key: its next use, on any replica, is a 401.",
)
async def revoke_ingest_key(
    team_id: str,
    key_id: str,
    _: AdminPrincipal,
    session: SessionDep,
) -> Response:
    await keys.revoke(session, team_id, key_id)
    return Response(status_code=204)
