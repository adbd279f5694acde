"""Credentials -> Principal. Every route says who may call it through one of the dependencies here."""

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Literal

from fastapi import Depends, Request
from sqlalchemy import select

from metering.db import utcnow
from metering.errors import Forbidden, Unauthorized
from metering.models import ApiToken, Team, User

TOKEN_PREFIX = "mtr_"

Kind = Literal["admin", "api_token", "access"]


@dataclass(frozen=True, slots=True)
class Principal:
    kind: Kind
    user_id: str | None = None
    team_id: str | None = None
    token_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    def ensure_user(self, user_id: str) -> None:
        """A user's credential may act on that user only."""
        if not self.is_admin and self.user_id != user_id:
            raise Forbidden("this credential may only act on its own user")


def new_api_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    # API tokens carry 256 random bits: a fast hash is enough, and lookups stay O(1) by index.
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("missing credential: send Authorization: Bearer <token>")
    return value.strip()


async def _api_token_principal(request: Request, token: str) -> Principal:
    state = request.app.state
    now = utcnow()
    async with state.db.sessions() as session:
        row = (
            await session.execute(
                select(
                    ApiToken.id,
                    ApiToken.revoked_at,
                    ApiToken.expires_at,
                    User.id,
                    User.team_id,
                    User.deleted_at,
                    Team.deleted_at,
                )
                .join(User, User.id == ApiToken.user_id)
                .join(Team, Team.id == User.team_id)
                .where(ApiToken.token_hash == hash_token(token))
            )
        ).first()
    if row is None:
        raise Unauthorized("unknown API token")
    token_id, revoked_at, expires_at, user_id, team_id, user_deleted, team_deleted = row
    if revoked_at is not None:
        raise Unauthorized("this API token has been revoked")
    if expires_at is not None and expires_at <= now:
        raise Unauthorized("this API token has expired")
    if user_deleted is not None or team_deleted is not None:
        raise Unauthorized("this API token's user or team has been deleted")
    return Principal("api_token", user_id=user_id, team_id=team_id, token_id=token_id)


async def authenticate(request: Request) -> Principal:
    token = bearer(request)
    admin_key = request.app.state.settings.admin_key
    if admin_key and hmac.compare_digest(token.encode(), admin_key.encode()):
        return Principal("admin")
    if token.startswith(TOKEN_PREFIX):
        return await _api_token_principal(request, token)
    raise Unauthorized("invalid credential")


async def admin_only(principal: Principal = Depends(authenticate)) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return principal


async def any_principal(principal: Principal = Depends(authenticate)) -> Principal:
    """Admin, or a user's own credential (the endpoint checks ownership)."""
    return principal


async def user_principal(principal: Principal = Depends(authenticate)) -> Principal:
    """A user's credential: the proxy, which charges a user and a team."""
    if principal.is_admin:
        raise Forbidden("the admin key cannot call models: use an API token")
    return principal
