"""The identity API: teams, users, API tokens and their budgets."""

from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy import select

from metering.auth.principal import Principal, admin_only, any_principal
from metering.budgets.service import view
from metering.db import utcnow
from metering.errors import Forbidden
from metering.identity import service
from metering.identity.schemas import (
    TeamCreate,
    TeamPatch,
    TokenCreate,
    TokenPatch,
    UserCreate,
    UserPatch,
)
from metering.models import ApiToken, Budget, Team, User
from metering.money import format_usd
from metering.timefmt import rfc3339

router = APIRouter(prefix="/v1")


async def unit_of_work(request: Request):
    """One transaction per call. Use it as Depends(unit_of_work, scope="function"): it then
    commits before the response leaves, so a client never sees a 201 for a row not yet there."""
    async with request.app.state.db.transaction() as session:
        yield session


def _limits(budget: Budget | None) -> dict:
    if budget is None:
        return {"credit_limit": None, "reset_interval": "never"}
    return {
        "credit_limit": format_usd(budget.credit_limit),
        "reset_interval": budget.reset_interval,
    }


def team_out(team: Team, budget: Budget | None) -> dict:
    return {
        "id": team.id,
        "name": team.name,
        **_limits(budget),
        "created_at": rfc3339(team.created_at),
    }


def user_out(user: User, budget: Budget | None) -> dict:
    return {
        "id": user.id,
        "email": user.email,
        "name": user.name,
        "team_id": user.team_id,
        **_limits(budget),
        "created_at": rfc3339(user.created_at),
    }


def token_out(token: ApiToken, budget: Budget | None) -> dict:
    return {
        "id": token.id,
        "user_id": token.user_id,
        "name": token.name,
        "prefix": token.prefix,
        **_limits(budget),
        "expires_at": rfc3339(token.expires_at),
        "created_at": rfc3339(token.created_at),
        "revoked_at": rfc3339(token.revoked_at),
    }


def budget_out(budget: Budget) -> dict:
    current = view(budget, utcnow())
    return {
        "scope": current.scope,
        "id": current.subject_id,
        "credit_limit": format_usd(current.credit_limit),
        "reset_interval": current.reset_interval,
        "window_start": rfc3339(current.window_start),
        "resets_at": rfc3339(current.resets_at),
        "spent": format_usd(current.spent),
        "reserved": format_usd(current.reserved),
        "remaining": format_usd(current.remaining),
    }


async def _with_budgets(session, objects, out):
    ids = [o.id for o in objects]
    budgets = {
        b.subject_id: b
        for b in await session.scalars(select(Budget).where(Budget.subject_id.in_(ids)))
    }
    return [out(o, budgets.get(o.id)) for o in objects]


# Teams (admin)


@router.post("/teams", status_code=201)
async def create_team(
    body: TeamCreate,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    team = await service.create_team(session, body.name, body.credit_limit, body.reset_interval)
    return team_out(team, await service.get_budget(session, team.id))


@router.get("/teams")
async def list_teams(
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=40),
):
    query = select(Team).where(Team.deleted_at.is_(None)).order_by(Team.id).limit(limit)
    if after:
        query = query.where(Team.id > after)
    teams = list(await session.scalars(query))
    return {"object": "list", "data": await _with_budgets(session, teams, team_out)}


@router.get("/teams/{team_id}")
async def get_team(
    team_id: str,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    team = await service.get_team(session, team_id)
    return team_out(team, await service.get_budget(session, team.id))


@router.patch("/teams/{team_id}")
async def patch_team(
    team_id: str,
    body: TeamPatch,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    team = await service.get_team(session, team_id)
    if body.name is not None:
        team.name = body.name
    await service.change_budget(session, team_id, body.model_dump(exclude_unset=True))
    await session.flush()
    session.expire_all()
    return team_out(
        await service.get_team(session, team_id), await service.get_budget(session, team_id)
    )


@router.delete("/teams/{team_id}", status_code=204)
async def delete_team(
    team_id: str,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    await service.delete_team(session, team_id)
    return Response(status_code=204)


@router.get("/teams/{team_id}/budget")
async def team_budget(
    team_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    if not principal.is_admin and principal.team_id != team_id:
        raise Forbidden("this credential may only read its own team's budget")
    await service.get_team(session, team_id)
    return budget_out(await service.get_budget(session, team_id))


@router.get("/me")
async def whoami(principal: Principal = Depends(any_principal)) -> dict:
    """Who this credential is: what a script or the dashboard needs to find its own objects."""
    return {
        "kind": principal.kind,
        "user_id": principal.user_id,
        "team_id": principal.team_id,
        "token_id": principal.token_id,
    }


# Users (admin; self for reads)


@router.post("/users", status_code=201)
async def create_user(
    body: UserCreate,
    request: Request,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    password_hash = request.app.state.passwords.hash(body.password) if body.password else None
    user = await service.create_user(
        session,
        email=body.email,
        name=body.name,
        team_id=body.team_id,
        password_hash=password_hash,
        limit=body.credit_limit,
        interval=body.reset_interval,
    )
    return user_out(user, await service.get_budget(session, user.id))


@router.get("/users")
async def list_users(
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
    team_id: str | None = Query(None, max_length=40),
    limit: int = Query(100, ge=1, le=1000),
    after: str | None = Query(None, max_length=40),
):
    query = select(User).where(User.deleted_at.is_(None)).order_by(User.id).limit(limit)
    if team_id:
        query = query.where(User.team_id == team_id)
    if after:
        query = query.where(User.id > after)
    users = list(await session.scalars(query))
    return {"object": "list", "data": await _with_budgets(session, users, user_out)}


@router.get("/users/{user_id}")
async def get_user(
    user_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    principal.ensure_user(user_id)
    user = await service.get_user(session, user_id)
    return user_out(user, await service.get_budget(session, user.id))


@router.patch("/users/{user_id}")
async def patch_user(
    user_id: str,
    body: UserPatch,
    request: Request,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    user = await service.get_user(session, user_id)
    fields = body.model_dump(exclude_unset=True)
    if body.email is not None and body.email != user.email:
        await service._email_free(session, body.email, except_id=user_id)
        user.email = body.email
    if body.name is not None:
        user.name = body.name
    if body.team_id is not None:
        await service.get_team(session, body.team_id)
        user.team_id = body.team_id
    if body.password is not None:
        user.password_hash = request.app.state.passwords.hash(body.password)
    await service.change_budget(session, user_id, fields)
    await session.flush()
    session.expire_all()
    return user_out(
        await service.get_user(session, user_id), await service.get_budget(session, user_id)
    )


@router.delete("/users/{user_id}", status_code=204)
async def delete_user(
    user_id: str,
    _: Principal = Depends(admin_only),
    session=Depends(unit_of_work, scope="function"),
):
    await service.delete_user(session, user_id)
    return Response(status_code=204)


@router.get("/users/{user_id}/budget")
async def user_budget(
    user_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    principal.ensure_user(user_id)
    await service.get_user(session, user_id)
    return budget_out(await service.get_budget(session, user_id))


# API tokens (admin, or the user for itself)


@router.post("/users/{user_id}/tokens", status_code=201)
async def create_token(
    user_id: str,
    body: TokenCreate,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    principal.ensure_user(user_id)
    token, secret = await service.create_token(
        session,
        user_id,
        name=body.name,
        limit=body.credit_limit,
        interval=body.reset_interval,
        expires_at=body.expires_at,
    )
    out = token_out(token, await service.get_budget(session, token.id))
    return {"token": secret, **out}


@router.get("/users/{user_id}/tokens")
async def list_tokens(
    user_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
    include_revoked: bool = False,
):
    principal.ensure_user(user_id)
    await service.get_user(session, user_id)
    query = select(ApiToken).where(ApiToken.user_id == user_id).order_by(ApiToken.created_at)
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    tokens = list(await session.scalars(query))
    return {"object": "list", "data": await _with_budgets(session, tokens, token_out)}


async def _own_token(session, principal: Principal, token_id: str) -> ApiToken:
    token = await service.get_token(session, token_id)
    principal.ensure_user(token.user_id)
    return token


@router.get("/tokens/{token_id}")
async def get_token(
    token_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    token = await _own_token(session, principal, token_id)
    return token_out(token, await service.get_budget(session, token.id))


@router.patch("/tokens/{token_id}")
async def patch_token(
    token_id: str,
    body: TokenPatch,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    token = await _own_token(session, principal, token_id)
    if body.name is not None:
        token.name = body.name
    await service.change_budget(session, token_id, body.model_dump(exclude_unset=True))
    await session.flush()
    session.expire_all()
    token = await service.get_token(session, token_id)
    return token_out(token, await service.get_budget(session, token_id))


@router.delete("/tokens/{token_id}", status_code=204)
async def revoke_token(
    token_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    await _own_token(session, principal, token_id)
    await service.revoke_token(session, token_id)
    return Response(status_code=204)


@router.get("/tokens/{token_id}/budget")
async def token_budget(
    token_id: str,
    principal: Principal = Depends(any_principal),
    session=Depends(unit_of_work, scope="function"),
):
    await _own_token(session, principal, token_id)
    return budget_out(await service.get_budget(session, token_id))
