"""Credentials -> Principal, and logins: the logic and SQL behind metering.auth.principal's
dependencies and the /v1/auth routes (no FastAPI here)."""

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import anyio
from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import InstrumentedAttribute

from metering.auth import sessions, throttle
from metering.auth.cache import Loaded
from metering.auth.invalidation import subject
from metering.auth.passwords import Passwords
from metering.auth.runtime import AuthServices
from metering.auth.tokens import (
    ACCESS_PREFIX,
    API_TOKEN_PREFIX,
    INGEST_PREFIX,
    Signer,
    digest,
    same,
)
from metering.db import Database, utcnow
from metering.errors import Forbidden, NotFound, Unauthorized
from metering.limits import Limits, scope_limits
from metering.models import ApiToken, IngestKey, Team, User
from metering.timefmt import rfc3339

log = logging.getLogger("metering.auth")

# ingest: a team's ingestion key, which may only report that team's usage (POST /v1/events).
Kind = Literal["admin", "api_token", "access", "ingest"]
WRONG_CREDENTIALS = "invalid email or password"


@dataclass(frozen=True, slots=True)
class Principal:
    kind: Kind
    user_id: str | None = None
    team_id: str | None = None
    token_id: str | None = None
    # Rate, parallel and model limits of its token, user and team; None: none anywhere.
    limits: Limits | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    @property
    def charged_in_full(self) -> bool:
        """Whose reported usage is the record of what already happened (admin, ingestion key),
        not a request of its own to admit against its limits."""
        return self.kind in ("admin", "ingest")

    def ensure_user(self, user_id: str) -> None:
        """A user's credential may act on that user only."""
        if not self.is_admin and self.user_id != user_id:
            raise Forbidden("this credential may only act on its own user")


@dataclass(frozen=True, slots=True)
class Authenticated:
    principal: Principal
    # The pair made when an expired access token came with a `refresh-token` header.
    refreshed: sessions.TokenPair | None = None


def limit_columns(table: type[ApiToken | User | Team]) -> tuple[InstrumentedAttribute[Any], ...]:
    return (table.rpm_limit, table.tpm_limit, table.max_parallel_requests, table.allowed_models)


def limits_of(row: Sequence[Any], token_id: str, user_id: str, team_id: str) -> Limits | None:
    """The limits of a row ending with limit_columns() of token, user and team."""
    values = tuple(row)[-12:]
    return Limits.of(
        scope_limits("token", token_id, *values[0:4]),
        scope_limits("user", user_id, *values[4:8]),
        scope_limits("team", team_id, *values[8:12]),
    )


def expired(expires_at: datetime) -> Unauthorized:
    return Unauthorized(f"this API token expired at {rfc3339(expires_at)}")


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
        *limit_columns(ApiToken),
        *limit_columns(User),
        *limit_columns(Team),
    )
    .join(User, User.id == ApiToken.user_id)
    .join(Team, Team.id == User.team_id)
    .where(ApiToken.token_hash == bindparam("token_hash"))
)


async def _api_token_principal(services: AuthServices, hashed: str) -> Principal:
    """The principal of the API token whose digest is `hashed`."""
    now = utcnow()
    cache = services.credentials.cache
    key = "t:" + hashed
    hit = cache.get(key)
    if hit is not None:
        if hit.expires_at is not None and hit.expires_at <= now:
            raise expired(hit.expires_at)
        cached: Principal = hit.value
        return cached
    # A miss: misses of this token arriving together share one lookup (CredentialCache.load).
    principal: Principal
    principal, expires_at = await cache.load(key, lambda: _lookup_api_token(services, hashed))
    if expires_at is not None and expires_at <= utcnow():
        raise expired(expires_at)
    return principal


async def _lookup_api_token(services: AuthServices, hashed: str) -> Loaded:
    """An API token's principal read from the database, with the subjects a change to it names
    and its expiry; raises Unauthorized when it is not valid now."""
    async with services.db.sessions() as session:
        row = (await session.execute(TOKEN_LOOKUP, {"token_hash": hashed})).first()
    # Found by its hash; compared once more in constant time, whatever the database's collation.
    if row is None or not same(row[0], hashed):
        raise Unauthorized("unknown API token")
    _, token_id, revoked_at, expires_at, user_id, team_id, user_deleted, team_deleted = row[:8]
    if revoked_at is not None:
        raise Unauthorized("this API token has been revoked")
    if expires_at is not None and expires_at <= utcnow():
        raise expired(expires_at)
    if user_deleted is not None or team_deleted is not None:
        raise Unauthorized("this API token's user or team has been deleted")
    limits = limits_of(row, token_id, user_id, team_id)
    principal = Principal(
        "api_token", user_id=user_id, team_id=team_id, token_id=token_id, limits=limits
    )
    subjects = frozenset(
        (subject("token", token_id), subject("user", user_id), subject("team", team_id))
    )
    return principal, subjects, expires_at


async def _session_user(services: AuthServices, session_id: str) -> sessions.SessionUser:
    """A valid access token's session, live: from the cache, or one indexed read."""
    cache = services.credentials.cache
    key = "s:" + session_id
    hit = cache.get(key)
    if hit is not None:
        cached: sessions.SessionUser = hit.value
        return cached
    # A miss: misses of this session arriving together share one read (CredentialCache.load).
    user: sessions.SessionUser
    user, _ = await cache.load(key, lambda: _lookup_session(services, session_id))
    return user


async def _lookup_session(services: AuthServices, session_id: str) -> Loaded:
    """A session's live user read from the database, with the subjects a change to it names;
    raises Unauthorized when the session is not valid now."""
    user = await sessions.user_of(services.db, session_id)
    subjects = frozenset(
        (
            subject("session", session_id),
            subject("user", user.user_id),
            subject("team", user.team_id),
        )
    )
    return user, subjects, None


async def _access_principal(
    services: AuthServices, token: str, refresh_token: str
) -> Authenticated:
    """An access token's principal; once it has expired, `refresh_token` (the request's
    `refresh-token` header, or empty) rotates its session and serves the request."""
    claims = Signer.read(await services.signer.key(services.db), token)
    if claims.expires_at > utcnow():
        user = await _session_user(services, claims.session_id)
        return Authenticated(
            Principal("access", user_id=user.user_id, team_id=user.team_id, limits=user.limits)
        )
    if not refresh_token:
        raise Unauthorized(
            "the access token has expired: send a refresh-token header or POST /v1/auth/refresh"
        )
    refreshed = await sessions.rotate(
        services, refresh_token, session_id=claims.session_id, leeway=True
    )
    user = refreshed.user
    principal = Principal("access", user_id=user.user_id, team_id=user.team_id, limits=user.limits)
    return Authenticated(principal, refreshed.pair)


def _is_admin_key(hashed: str, admin_key: str | None) -> bool:
    """Whether the credential whose digest is `hashed` is the admin key. Digests are compared:
    equal lengths, so not even the key's length leaks through timing."""
    return bool(admin_key) and same(hashed, _admin_digest(admin_key))


@functools.lru_cache(maxsize=2)
def _admin_digest(admin_key: str) -> str:
    """The admin key's digest, made once per key rather than on every request."""
    return digest(admin_key)


async def authenticate(
    services: AuthServices, token: str, refresh_token: str = ""
) -> Authenticated:
    """Whoever a bearer credential is; Unauthorized for anything unknown or no longer valid."""
    hashed = digest(token)  # once: the admin key's check and an API token's lookup share it
    if _is_admin_key(hashed, services.settings.admin_key):
        return Authenticated(Principal("admin"))
    if token.startswith(API_TOKEN_PREFIX):
        return Authenticated(await _api_token_principal(services, hashed))
    if token.startswith(ACCESS_PREFIX):
        return await _access_principal(services, token, refresh_token)
    if token.startswith(INGEST_PREFIX):
        return Authenticated(await _ingest_principal(services.db, hashed))
    raise Unauthorized("invalid credential")


_INGEST_LOOKUP = (
    select(IngestKey.key_hash, IngestKey.team_id, IngestKey.revoked_at, Team.deleted_at)
    .join(Team, Team.id == IngestKey.team_id)
    .where(IngestKey.key_hash == bindparam("key_hash"))
)


async def _ingest_principal(db: Database, hashed: str) -> Principal:
    """A team's ingestion key, read from the database on every use (it is not on the proxy's
    path): a revocation holds at once on every replica."""
    async with db.sessions() as session:
        row = (await session.execute(_INGEST_LOOKUP, {"key_hash": hashed})).first()
    if row is None or not same(row.key_hash, hashed):
        raise Unauthorized("unknown ingestion key")
    if row.revoked_at is not None:
        raise Unauthorized("this ingestion key has been revoked")
    if row.deleted_at is not None:
        raise Unauthorized("this ingestion key's team has been deleted")
    return Principal("ingest", team_id=row.team_id)


async def token_owner(db: Database, token_id: str) -> str:
    """The user an API token belongs to; NotFound if there is no such token."""
    async with db.sessions() as session:
        owner = await session.scalar(select(ApiToken.user_id).where(ApiToken.id == token_id))
    if owner is None:
        raise NotFound(f"token {token_id} not found")
    return owner


_dummy_hash: str | None = None


def _verify(passwords: Passwords, password_hash: str | None, password: str) -> bool:
    """argon2 verify; an unknown email or a user without a password costs the same time."""
    global _dummy_hash
    if password_hash is None:
        _dummy_hash = _dummy_hash or passwords.hash("no password: the same work as a real one")
        passwords.verify(_dummy_hash, password)
        return False
    return passwords.verify(password_hash, password)


async def login(services: AuthServices, email: str, password: str) -> sessions.TokenPair:
    """A new session for a live user's email and password; Unauthorized otherwise, after the
    same work (throttled per email: metering.auth.throttle)."""
    db = services.db
    key = throttle.email_key(email)
    await throttle.admit(db, key, utcnow())
    async with db.sessions() as s:
        user = (
            await s.execute(
                select(User.id, User.password_hash)
                .join(Team, Team.id == User.team_id)
                .where(
                    func.lower(User.email) == email.strip().lower(),
                    User.deleted_at.is_(None),
                    Team.deleted_at.is_(None),
                )
            )
        ).first()
    password_hash = user.password_hash if user is not None else None
    # argon2 is slow on purpose: off the event loop.
    ok = await anyio.to_thread.run_sync(_verify, services.passwords, password_hash, password)
    if not ok:
        log.info("login refused: wrong email or password")
        raise Unauthorized(WRONG_CREDENTIALS)
    assert user is not None and password_hash is not None  # a right password has both
    signing_key = await services.signer.key(db)
    async with db.transaction() as s:
        await throttle.clear(s, key)
        pair = await sessions.start(services, s, signing_key, user.id, password_hash)
    log.info("login: user %s", user.id)
    return pair


async def refresh(services: AuthServices, refresh_token: str) -> sessions.TokenPair:
    refreshed = await sessions.rotate(services, refresh_token)
    assert refreshed.pair is not None  # no leeway here: a spent token revokes the session
    return refreshed.pair


async def logout(services: AuthServices, refresh_token: str) -> None:
    await sessions.logout(services, refresh_token)
