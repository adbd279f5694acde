"""Credentials -> Principal: the FastAPI dependencies. Every route says who may call it through
one of them, each marked with its rule (metering.auth.rules); the checks and their SQL are
metering.auth.service's.

Credentials: the admin key; an API token (`mtr_`, looked up by its SHA-256); an access token
(`mat_`, signed, its session checked in the database on each request), with an optional
`refresh-token` header that, once the access token has expired, rotates the session and serves
the request: the new pair leaves in `x-access-token` / `x-refresh-token` (RefreshedTokenHeaders).
Failed credentials are counted per client address (metering.auth.failures): past the limit,
every credential from that address gets 429 until the minute ends.
"""

from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metering.auth import service
from metering.auth.rules import OWNED_PARAMS, SUBJECT_PARAMS, rule
from metering.auth.runtime import AuthServices
from metering.auth.service import Principal
from metering.container import get_services
from metering.errors import Forbidden, Unauthorized

__all__ = [
    "AdminPrincipal",
    "AuthServicesDep",
    "IngestingPrincipal",
    "OpenAccess",
    "Principal",
    "SelfPrincipal",
    "UserPrincipal",
    "admin_only",
    "any_principal",
    "ingesting_principal",
    "open_access",
    "user_principal",
]

# The error statuses each rule's dependency may answer with (for each route's `responses`).
RULE_ERRORS = {
    "open": (),
    "admin": (401, 403, 429, 503),
    "self": (401, 403, 404, 429, 503),
    "user": (401, 403, 429, 503),
    "ingest": (401, 403, 429, 503),
}


# The container, as auth's functions take it.
AuthServicesDep = Annotated[AuthServices, Depends(get_services)]


def bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("missing credential: send Authorization: Bearer <token>")
    return value.strip()


async def authenticate(request: Request, services: AuthServicesDep) -> Principal:
    """Any credential but a team's ingestion key, which may only report usage."""
    principal = await credential(request, services)
    if principal.kind == "ingest":
        raise Forbidden("an ingestion key may only call POST /v1/events")
    return principal


async def credential(request: Request, services: AuthServicesDep) -> Principal:
    token = bearer(request)
    failures = services.credential_failures
    address = request.client.host if request.client else ""
    failures.check(address)
    try:
        found = await service.authenticate(
            services, token, request.headers.get("refresh-token", "").strip()
        )
    except Unauthorized:
        failures.failed(address)
        raise
    if found.refreshed is not None:
        request.state.refreshed_pair = found.refreshed
    return found.principal


# Any credential but an ingestion key; any credential at all.
_Authenticated = Annotated[Principal, Depends(authenticate)]
_Credential = Annotated[Principal, Depends(credential)]


@rule("admin")
async def admin_only(principal: _Authenticated) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this endpoint needs the admin key")
    return principal


@rule("self")
async def any_principal(
    request: Request, principal: _Authenticated, services: AuthServicesDep
) -> Principal:
    """Admin, or a user's own credential acting on itself: a user, token or team named in the
    path must be its own; routes naming none (lists) show the caller only its own rows."""
    if principal.is_admin:
        return principal
    params = request.path_params
    if "user_id" in params:
        principal.ensure_user(params["user_id"])
    if "token_id" in params:
        principal.ensure_user(await service.token_owner(services.db, params["token_id"]))
    if "team_id" in params and params["team_id"] != principal.team_id:
        raise Forbidden("this credential may only act on its own team")
    unknown = set(params) - set(SUBJECT_PARAMS) - set(OWNED_PARAMS)
    if unknown:
        raise Forbidden(f"this credential may not name {', '.join(sorted(unknown))}")
    return principal


@rule("user")
async def user_principal(principal: _Authenticated) -> Principal:
    """A user's credential: the proxy, which charges a user and a team."""
    if principal.is_admin:
        raise Forbidden("the admin key cannot call models: use an API token")
    return principal


@rule("ingest")
async def ingesting_principal(principal: _Credential) -> Principal:
    """Who may report usage: the admin key, a team's ingestion key (its team's usage), or a
    user's credential (its own usage, admitted like its requests)."""
    return principal


@rule("open")
async def open_access() -> None:
    """Declares a route that anyone may call, with no credential."""


# What an endpoint declares in its signature to be called under a rule (metering.auth.rules).
AdminPrincipal = Annotated[Principal, Depends(admin_only)]
SelfPrincipal = Annotated[Principal, Depends(any_principal)]
UserPrincipal = Annotated[Principal, Depends(user_principal)]
IngestingPrincipal = Annotated[Principal, Depends(ingesting_principal)]
OpenAccess = Annotated[None, Depends(open_access)]


def refreshed_headers(state: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The headers of the pair a `refresh-token` header made for this request, if any."""
    pair = state.get("refreshed_pair")
    if pair is None:
        return []
    return [
        (b"x-access-token", pair.access_token.encode()),
        (b"x-refresh-token", pair.refresh_token.encode()),
    ]


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
            if message["type"] == "http.response.start":
                pair = refreshed_headers(scope.get("state", {}))
                if pair:
                    message["headers"] = [*message.get("headers", []), *pair]
            await send(message)

        await self.app(scope, receive, send_with_pair)
