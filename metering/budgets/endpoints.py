"""GET /v1/{tokens,users,teams}/{id}/budget: a budget as it stands now, and
GET /v1/{tokens,users,teams}/{id}/limits: the rate, parallel and model limits and their use
(admin, or self); the budgets of a team's end users (set by the admin, read by the admin or a
member of the team, as the team's own budget is)."""

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from metering.auth.principal import RULE_ERRORS, AdminPrincipal, SelfPrincipal
from metering.budgets import end_user_terms, queries
from metering.budgets.schemas import (
    BudgetOut,
    EndUserBudgetIn,
    EndUserBudgetOut,
    EndUserList,
    LimitsOut,
)
from metering.container import ServicesDep, SessionDep
from metering.errors import error_responses
from metering.ledger.attribution import END_USER_PATTERN, MAX_END_USER_CHARS

router = APIRouter(prefix="/v1", responses=error_responses(*RULE_ERRORS["self"]))


@router.get("/tokens/{token_id}/budget")
async def token_budget(
    token_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> BudgetOut:
    return BudgetOut.of(await queries.current_budget(services.db, "token", token_id))


@router.get("/users/{user_id}/budget")
async def user_budget(
    user_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> BudgetOut:
    return BudgetOut.of(await queries.current_budget(services.db, "user", user_id))


@router.get("/teams/{team_id}/budget")
async def team_budget(
    team_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> BudgetOut:
    return BudgetOut.of(await queries.current_budget(services.db, "team", team_id))


@router.get("/tokens/{token_id}/limits")
async def token_limits(
    token_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> LimitsOut:
    return LimitsOut.of(await queries.current_limits(services.db, "token", token_id))


@router.get("/users/{user_id}/limits")
async def user_limits(
    user_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> LimitsOut:
    return LimitsOut.of(await queries.current_limits(services.db, "user", user_id))


@router.get("/teams/{team_id}/limits")
async def team_limits(
    team_id: str,
    _: SelfPrincipal,
    services: ServicesDep,
) -> LimitsOut:
    return LimitsOut.of(await queries.current_limits(services.db, "team", team_id))


# End users' budgets


_END_USER = "/teams/{team_id}/end-users/{end_user:path}/budget"
ADMIN = RULE_ERRORS["admin"]
# An end user in the path (URL-encoded), declared as end_user_terms.check_end_user takes it.
EndUserPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_END_USER_CHARS,
        json_schema_extra={"pattern": END_USER_PATTERN},
    ),
]


@router.put(_END_USER, responses=error_responses(400, 404, *ADMIN))
async def put_end_user_budget(
    team_id: str,
    end_user: EndUserPath,
    body: EndUserBudgetIn,
    _: AdminPrincipal,
    session: SessionDep,
) -> EndUserBudgetOut:
    """One end user's own budget, in place of its team's default (`end_user` URL-encoded)."""
    end_user_terms.check_end_user(end_user)
    now = await end_user_terms.set_override(
        session, team_id, end_user, body.credit_limit, body.reset_interval
    )
    return EndUserBudgetOut.of(team_id, end_user, True, now)


@router.delete(_END_USER, status_code=204, responses=error_responses(400, 404, *ADMIN))
async def delete_end_user_budget(
    team_id: str, end_user: EndUserPath, _: AdminPrincipal, session: SessionDep
) -> Response:
    """The end user back on its team's default budget (what it spent in the window stays)."""
    end_user_terms.check_end_user(end_user)
    await end_user_terms.clear_override(session, team_id, end_user)
    return Response(status_code=204)


@router.get(_END_USER, responses=error_responses(400))
async def end_user_budget(
    team_id: str, end_user: EndUserPath, _: SelfPrincipal, session: SessionDep
) -> EndUserBudgetOut:
    """An end user's budget as it stands now (its team's default if it has no override)."""
    end_user_terms.check_end_user(end_user)
    override, now = await end_user_terms.budget_of(session, team_id, end_user)
    return EndUserBudgetOut.of(team_id, end_user, override, now)


@router.get("/teams/{team_id}/end-users", responses=error_responses(400))
async def list_end_users(
    team_id: str,
    _: SelfPrincipal,
    session: SessionDep,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=256, description="The last end user of a page"),
) -> EndUserList:
    """The team's end users that have a budget, by name, with their current window's figures."""
    found = await end_user_terms.list_end_users(session, team_id, limit=limit, after=after)
    return EndUserList(data=[EndUserBudgetOut.of(team_id, *row) for row in found])
