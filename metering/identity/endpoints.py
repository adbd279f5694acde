"""The identity API: teams, users and API tokens (their budgets: metering.budgets.endpoints)."""

from typing import Any

from fastapi import APIRouter, Query, Response
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth.principal import RULE_ERRORS, AdminPrincipal, Principal, SelfPrincipal
from metering.auth.schemas import PrincipalOut
from metering.budgets import end_user_terms
from metering.container import Services, ServicesDep, SessionDep
from metering.db import SEARCH_CHARS
from metering.errors import InvalidRequest, error_responses
from metering.identity import service
from metering.identity.schemas import (
    TeamCreate,
    TeamList,
    TeamOut,
    TeamPatch,
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenOut,
    TokenPatch,
    UserCreate,
    UserList,
    UserOut,
    UserPatch,
)

router = APIRouter(prefix="/v1")

ADMIN = RULE_ERRORS["admin"]
SELF = RULE_ERRORS["self"]
# What the catalog, the stored teams and users and the clock decide (the document cannot).
MODELS: dict[str | None, str] = {
    "allowed_models": "its exact names in the catalog (a reload changes it), and within the "
    "lists of its user and team"
}
USER_RULES: dict[str | None, str] = {**MODELS, "team_id": "a live team"}
TOKEN_RULES: dict[str | None, str] = {**MODELS, "expires_at": "in the future"}


def _search(fields: str) -> Any:
    """The `q` of a list: its bound (SEARCH_CHARS) both checked and declared in /openapi.json."""
    return Query(
        None,
        max_length=SEARCH_CHARS,
        description=f"Only the rows whose id is this, or whose {fields} holds it (any case; "
        "`%`, `_` and `\\` match themselves); with limit and after, the matches are paged",
    )


def _limits(body, services: Services) -> dict:
    """The limit fields a body sent; the exact names of an allow-list must be in the catalog."""
    sent = body.model_dump(exclude_unset=True)
    fields = {name: sent[name] for name in service.LIMIT_FIELDS if name in sent}
    for name in fields.get("allowed_models") or ():
        if not any(c in name for c in "*?") and name not in services.catalog.models:
            raise InvalidRequest(
                f"allowed_models: {name} is not a model of the catalog", param="allowed_models"
            )
    return fields


def _alerts(body) -> dict:
    """The alert fields a body sent (metering.alerts: they alert, never refuse)."""
    sent = body.model_dump(exclude_unset=True)
    return {name: sent[name] for name in service.ALERT_FIELDS if name in sent}


def _end_user_defaults(body: TeamCreate | TeamPatch) -> dict:
    """The default end-user budget fields a body sent (a create's defaults count as sent)."""
    sent = body.model_dump(exclude_unset=isinstance(body, TeamPatch))
    names = ("end_user_credit_limit", "end_user_reset_interval")
    return {name: sent[name] for name in names if name in sent}


async def _teams(session: AsyncSession, teams) -> list[TeamOut]:
    budgets = await service.budgets_of(session, [t.id for t in teams])
    return [TeamOut.of(t, budgets.get(t.id)) for t in teams]


async def _users(session: AsyncSession, users) -> list[UserOut]:
    budgets = await service.budgets_of(session, [u.id for u in users])
    return [UserOut.of(u, budgets.get(u.id)) for u in users]


async def _tokens(session: AsyncSession, tokens) -> list[TokenOut]:
    budgets = await service.budgets_of(session, [t.id for t in tokens])
    return [TokenOut.of(t, budgets.get(t.id)) for t in tokens]


# Teams (admin)


@router.post("/teams", status_code=201, responses=error_responses(400, 409, *ADMIN, rules=MODELS))
async def create_team(
    body: TeamCreate,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> TeamOut:
    team = await service.create_team(
        session, body.name, body.credit_limit, body.reset_interval, _limits(body, services)
    )
    await service.set_alerts(session, team.id, _alerts(body))
    await end_user_terms.set_team_defaults(session, team, _end_user_defaults(body), new=True)
    return TeamOut.of(team, await service.get_budget(session, team.id))


@router.get("/teams", responses=error_responses(400, *ADMIN))
async def list_teams(
    _: AdminPrincipal,
    session: SessionDep,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=40),
    q: str | None = _search("name"),
) -> TeamList:
    teams = await service.list_teams(session, limit=limit, after=after, q=q)
    return TeamList(data=await _teams(session, teams))


@router.get("/teams/{team_id}", responses=error_responses(404, *ADMIN))
async def get_team(team_id: str, _: AdminPrincipal, session: SessionDep) -> TeamOut:
    team = await service.get_team(session, team_id)
    return TeamOut.of(team, await service.get_budget(session, team.id))


@router.patch("/teams/{team_id}", responses=error_responses(400, 404, 409, *ADMIN, rules=MODELS))
async def patch_team(
    team_id: str,
    body: TeamPatch,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> TeamOut:
    _limits(body, services)
    team = await service.update_team(session, team_id, body.model_dump(exclude_unset=True))
    await end_user_terms.set_team_defaults(session, team, _end_user_defaults(body))
    return TeamOut.of(team, await service.get_budget(session, team_id))


@router.delete("/teams/{team_id}", status_code=204, responses=error_responses(404, *ADMIN))
async def delete_team(team_id: str, _: AdminPrincipal, session: SessionDep) -> Response:
    await service.delete_team(session, team_id)
    return Response(status_code=204)


@router.get("/me", responses=error_responses(401, 403, 429, 503))
async def whoami(principal: SelfPrincipal) -> PrincipalOut:
    """Who this credential is: what a script or the dashboard needs to find its own objects."""
    return PrincipalOut(
        kind=principal.kind,
        user_id=principal.user_id,
        team_id=principal.team_id,
        token_id=principal.token_id,
    )


# Users (admin; self for reads)


@router.post(
    "/users", status_code=201, responses=error_responses(400, 409, *ADMIN, rules=USER_RULES)
)
async def create_user(
    body: UserCreate,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> UserOut:
    password_hash = services.passwords.hash(body.password) if body.password else None
    user = await service.create_user(
        session,
        email=body.email,
        name=body.name,
        team_id=body.team_id,
        password_hash=password_hash,
        limit=body.credit_limit,
        interval=body.reset_interval,
        limits=_limits(body, services),
    )
    await service.set_alerts(session, user.id, _alerts(body))
    return UserOut.of(user, await service.get_budget(session, user.id))


@router.get("/users", responses=error_responses(400, *ADMIN))
async def list_users(
    _: AdminPrincipal,
    session: SessionDep,
    team_id: str | None = Query(None, max_length=40),
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=40),
    q: str | None = _search("name or email"),
) -> UserList:
    users = await service.list_users(session, team_id=team_id, limit=limit, after=after, q=q)
    return UserList(data=await _users(session, users))


@router.get("/users/{user_id}", responses=error_responses(*SELF))
async def get_user(user_id: str, principal: SelfPrincipal, session: SessionDep) -> UserOut:
    principal.ensure_user(user_id)
    user = await service.get_user(session, user_id)
    return UserOut.of(user, await service.get_budget(session, user.id))


@router.patch(
    "/users/{user_id}", responses=error_responses(400, 404, 409, *ADMIN, rules=USER_RULES)
)
async def patch_user(
    user_id: str,
    body: UserPatch,
    _: AdminPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> UserOut:
    _limits(body, services)
    password_hash = services.passwords.hash(body.password) if body.password is not None else None
    fields = body.model_dump(exclude_unset=True)
    user = await service.update_user(session, user_id, fields, password_hash)
    return UserOut.of(user, await service.get_budget(session, user_id))


@router.delete("/users/{user_id}", status_code=204, responses=error_responses(404, *ADMIN))
async def delete_user(user_id: str, _: AdminPrincipal, session: SessionDep) -> Response:
    await service.delete_user(session, user_id)
    return Response(status_code=204)


# API tokens (admin, or the user for itself)


@router.post(
    "/users/{user_id}/tokens",
    status_code=201,
    responses=error_responses(400, 409, *SELF, rules=TOKEN_RULES),
)
async def create_token(
    user_id: str,
    body: TokenCreate,
    principal: SelfPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> TokenCreated:
    principal.ensure_user(user_id)
    token, secret = await service.create_token(
        session,
        user_id,
        name=body.name,
        limit=body.credit_limit,
        interval=body.reset_interval,
        expires_at=body.expires_at,
        expires_in=body.expires_in,
        max_lifetime_s=services.settings.token_max_lifetime_s,
        limits=_limits(body, services),
    )
    await service.set_alerts(session, token.id, _alerts(body))
    out = TokenOut.of(token, await service.get_budget(session, token.id))
    return TokenCreated(token=secret, **out.model_dump())


@router.get("/users/{user_id}/tokens", responses=error_responses(400, *SELF))
async def list_tokens(
    user_id: str,
    principal: SelfPrincipal,
    session: SessionDep,
    include_revoked: bool = False,
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=40),
    q: str | None = _search("name or prefix"),
) -> TokenList:
    principal.ensure_user(user_id)
    tokens = await service.list_tokens(
        session, user_id, include_revoked=include_revoked, limit=limit, after=after, q=q
    )
    return TokenList(data=await _tokens(session, tokens))


async def _own_token(session: AsyncSession, principal: Principal, token_id: str):
    token = await service.get_token(session, token_id)
    principal.ensure_user(token.user_id)
    return token


@router.get("/tokens/{token_id}", responses=error_responses(*SELF))
async def get_token(token_id: str, principal: SelfPrincipal, session: SessionDep) -> TokenOut:
    token = await _own_token(session, principal, token_id)
    return TokenOut.of(token, await service.get_budget(session, token.id))


@router.patch("/tokens/{token_id}", responses=error_responses(400, *SELF, rules=TOKEN_RULES))
async def patch_token(
    token_id: str,
    body: TokenPatch,
    principal: SelfPrincipal,
    services: ServicesDep,
    session: SessionDep,
) -> TokenOut:
    """A user's own credential may tighten its token's limits (credit limit, rpm, tpm, parallel
    requests, allowed models), not raise or remove them, may not change its reset interval, and
    may set or shorten its expiry (`expires_at`, `expires_in`), not extend or remove it: 403
    `forbidden` naming the field. The admin key may change anything."""
    await _own_token(session, principal, token_id)
    _limits(body, services)
    token = await service.update_token(
        session,
        token_id,
        body.model_dump(exclude_unset=True),
        services.settings.token_max_lifetime_s,
        tighten_only=not principal.is_admin,
    )
    return TokenOut.of(token, await service.get_budget(session, token_id))


@router.delete(
    "/tokens/{token_id}",
    status_code=204,
    responses=error_responses(*SELF),
    description="Revoke the token: its next use, on any replica, is a 401. The token, its budget "
    "and its limits stay readable (with `revoked_at`), as its usage does.",
)
async def revoke_token(token_id: str, principal: SelfPrincipal, session: SessionDep) -> Response:
    await _own_token(session, principal, token_id)
    await service.revoke_token(session, token_id)
    return Response(status_code=204)
