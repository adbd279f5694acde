"""Credentials -> Principal. Every route says who may call it through one of the dependencies
here, each marked with its rule (metering.auth.rules).

Credentials: the admin key; an API token (`mtr_`, looked up by its SHA-256); an access token
(`mat_`, signed, its session checked in the database on each request), with an optional
`refresh-token` header that, once the access token has expired, rotates the session and serves
the request: the new pair leaves in `x-access-token` / `x-refresh-token` (RefreshedTokenHeaders).
Failed credentials are counted per client address (metering.auth.failures): past the limit,
every credential from that address gets 429 until the minute ends.
"""

import secrets
from dataclasses import dataclass
from typing import Literal

from fastapi import Depends, Request
from sqlalchemy import bindparam, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.auth import sessions
from metering.auth.rules import SUBJECT_PARAMS, rule
from metering.auth.tokens import ACCESS_PREFIX, Signer, digest, same
from metering.db import utcnow
from metering.errors import Forbidden, NotFound, Unauthorized
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
    return digest(token)


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("missing credential: send Authorization: Bearer <token>")
    return value.strip()


# Built once: every proxied request runs it, and building a statement costs more than running it.
TOKEN_LOOKUP = (
    select(
        ApiToken.token_hash,
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
    .where(ApiToken.token_hash == bindparam("token_hash"))
)


async def _api_token_principal(request: Request, token: str) -> Principal:
    state = request.app.state
    now = utcnow()
    hashed = hash_token(token)
    async with state.db.sessions() as session:
        row = (await session.execute(TOKEN_LOOKUP, {"token_hash": hashed})).first()
    # Found by its hash; compared once more in constant time, whatever the database's collation.
    if row is None or not same(row[0], hashed):
        raise Unauthorized("unknown API token")
    _, token_id, revoked_at, expires_at, user_id, team_id, user_deleted, team_deleted = row
    if revoked_at is not None:
        raise Unauthorized("this API token has been revoked")
    if expires_at is not None and expires_at <= now:
        raise Unauthorized("this API token has expired")
    if user_deleted is not None or team_deleted is not None:
        raise Unauthorized("this API token's user or team has been deleted")
    return Principal("api_token", user_id=user_id, team_id=team_id, token_id=token_id)


async def _access_principal(request: Request, token: str) -> Principal:
    state = request.app.state
    claims = Signer.read(await state.signer.key(state.db), token)
    if claims.expires_at > utcnow():
        user = await sessions.user_of(state.db, claims.session_id)
        return Principal("access", user_id=user.user_id, team_id=user.team_id)
    presented = request.headers.get("refresh-token", "").strip()
    if not presented:
        raise Unauthorized(
            "the access token has expired: send a refresh-token header or POST /v1/auth/refresh"
        )
    refreshed = await sessions.rotate(state, presented, session_id=claims.session_id, leeway=True)
    if refreshed.pair is not None:
        request.state.refreshed_pair = refreshed.pair
    return Principal("access", user_id=refreshed.user.user_id, team_id=refreshed.user.team_id)


def _is_admin_key(token: str, admin_key: str | None) -> bool:
    # Digests first: equal lengths, so not even the key's length leaks through timing.
    return bool(admin_key) and same(digest(token), digest(admin_key))


async def authenticate(request: Request) -> Principal:
    token = bearer(request)
    failures = request.app.state.credential_failures
    address = request.client.host if request.client else ""
    failures.check(address)
    try:
        return await _principal(request, token)
    except Unauthorized:
        failures.failed(address)
        raise


async def _principal(request: Request, token: str) -> Principal:
    if _is_admin_key(token, request.app.state.settings.admin_key):
        return Principal("admin")
    if token.startswith(TOKEN_PREFIX):
        return await _api_token_principal(request, token)
    if token.startswith(ACCESS_PREFIX):
        return await _access_principal(request, token)
    raise Unauthorized("invalid credential")


@rule("admin")
async def admin_only(principal: Principal = Depends(authenticate)) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return principal


async def _token_owner(request: Request, token_id: str) -> str:
    async with request.app.state.db.sessions() as session:
        owner = await session.scalar(select(ApiToken.user_id).where(ApiToken.id == token_id))
    if owner is None:
        raise NotFound(f"token {token_id} not found")
    return owner


@rule("self")
async def any_principal(
    request: Request, principal: Principal = Depends(authenticate)
) -> Principal:
    """Admin, or a user's own credential acting on itself: a user, token or team named in the
    path must be its own; routes naming none (lists) show the caller only its own rows."""
    if principal.is_admin:
        return principal
    params = request.path_params
    if "user_id" in params:
        principal.ensure_user(params["user_id"])
    if "token_id" in params:
        principal.ensure_user(await _token_owner(request, params["token_id"]))
    if "team_id" in params and params["team_id"] != principal.team_id:
        raise Forbidden("this credential may only act on its own team")
    unknown = set(params) - set(SUBJECT_PARAMS)
    if unknown:
        raise Forbidden(f"this credential may not name {', '.join(sorted(unknown))}")
    return principal


self_principal = any_principal


@rule("user")
async def user_principal(principal: Principal = Depends(authenticate)) -> Principal:
    """A user's credential: the proxy, which charges a user and a team."""
    if principal.is_admin:
        raise Forbidden("the admin key cannot call models: use an API token")
    return principal


@rule("open")
async def open_access() -> None:
    """Declares a route that anyone may call, with no credential."""


class RefreshedTokenHeaders:
    """Puts the pair made by a `refresh-token` header on the response, whatever its status and
    also when it streams: the old refresh token is spent, so the client must get the new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_pair(message: Message) -> None:
            pair = scope.get("state", {}).get("refreshed_pair")
            if message["type"] == "http.response.start" and pair is not None:
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-access-token", pair.access_token.encode()),
                    (b"x-refresh-token", pair.refresh_token.encode()),
                ]
            await send(message)

        await self.app(scope, receive, send_with_pair)
