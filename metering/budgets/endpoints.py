"""GET /v1/{tokens,users,teams}/{id}/budget: a budget as it stands now, and
GET /v1/{tokens,users,teams}/{id}/limits: the rate, parallel and model limits and their use
(admin, or self)."""

from fastapi import APIRouter

from metering.auth.principal import RULE_ERRORS, SelfPrincipal
from metering.budgets import queries
from metering.budgets.schemas import BudgetOut, LimitsOut
from metering.container import ServicesDep
from metering.errors import error_responses

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
