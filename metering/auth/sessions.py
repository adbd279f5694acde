"""Login sessions: each is a chain of refresh tokens with rotation and reuse detection
(OAuth 2.0 Security BCP, refresh token rotation).

A refresh token is spent by its first use and replaced by the next of its chain. Presenting a
spent one means two parties hold the chain: the whole session is revoked, with every access and
refresh token it issued. One leeway, for the `refresh-token` header only: requests sent together
with the same expired access token and refresh token are all served when they arrive within
REUSE_GRACE_S of the rotation that one of them made and that token's successor is still unused;
they get no new tokens (the first response carried them). POST /v1/auth/refresh has no leeway.
"""

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import Row, Select, delete, insert, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth import invalidation
from metering.auth.runtime import AuthServices
from metering.auth.tokens import Signer, digest, new_refresh_token, password_stamp, same
from metering.db import Database, utcnow
from metering.errors import Unauthorized
from metering.limits import Limits, scope_limits
from metering.models import AuthSession, RefreshToken, Team, User

log = logging.getLogger("metering.auth")

REUSE_GRACE_S = 10
ENDED = "this session has ended: log in again"
# A row of _session_query() (and _find()'s refresh token), read by column name.
SessionRow = Row[*tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class TokenPair:
    access_token: str
    refresh_token: str
    expires_in: int
    user_id: str

    def out(self) -> dict[str, str | int]:
        return {
            "access_token": self.access_token,
            "refresh_token": self.refresh_token,
            "token_type": "bearer",
            "expires_in": self.expires_in,
            "user_id": self.user_id,
        }


@dataclass(frozen=True, slots=True)
class SessionUser:
    user_id: str
    team_id: str
    limits: Limits | None = None  # its user's and team's rate, parallel and model limits


@dataclass(frozen=True, slots=True)
class Refreshed:
    user: SessionUser
    pair: TokenPair | None  # None: served within the reuse leeway, no new tokens


def _ttls(services: AuthServices) -> tuple[int, int]:
    return services.settings.access_token_ttl_s, services.settings.refresh_token_ttl_s


def _pair(
    services: AuthServices, key: bytes, session_id: str, user_id: str, refresh: str, now: datetime
) -> TokenPair:
    access_ttl, _ = _ttls(services)
    access = Signer.issue(key, session_id, now + timedelta(seconds=access_ttl))
    return TokenPair(access, refresh, access_ttl, user_id)


def _refresh_row(
    session_id: str, refresh: str, generation: int, now: datetime, ttl: int
) -> dict[str, Any]:
    return {
        "token_hash": digest(refresh),
        "session_id": session_id,
        "generation": generation,
        "created_at": now,
        "expires_at": now + timedelta(seconds=ttl),
        "spent_at": None,
    }


async def start(
    services: AuthServices, db_session: AsyncSession, key: bytes, user_id: str, password_hash: str
) -> TokenPair:
    """A new session for a user who just proved their password (inside the caller's unit of
    work; `key`, the signing key, is loaded before it: SQLite has one pooled connection)."""
    now = utcnow()
    session_id = f"ses_{uuid.uuid4().hex}"
    refresh = new_refresh_token()
    db_session.add(
        AuthSession(
            id=session_id,
            user_id=user_id,
            password_stamp=password_stamp(password_hash),
            generation=0,
            created_at=now,
        )
    )
    await db_session.flush()
    await db_session.execute(
        insert(RefreshToken).values(_refresh_row(session_id, refresh, 0, now, _ttls(services)[1]))
    )
    return _pair(services, key, session_id, user_id, refresh, now)


def _session_user(row: SessionRow) -> SessionUser:
    limits = Limits.of(
        scope_limits(
            "user", row.user_id, row.user_rpm, row.user_tpm, row.user_parallel, row.user_models
        ),
        scope_limits(
            "team", row.team_id, row.team_rpm, row.team_tpm, row.team_parallel, row.team_models
        ),
    )
    return SessionUser(row.user_id, row.team_id, limits)


def _live_user(row: SessionRow, stamp: str) -> None:
    """The session's user and team still exist and the password has not changed since login."""
    if row.user_deleted is not None or row.team_deleted is not None:
        raise Unauthorized("this credential's user or team has been deleted")
    if not same(stamp, password_stamp(row.password_hash)):
        raise Unauthorized("the password has changed since this session began: log in again")


def _session_query() -> Select[*tuple[Any, ...]]:
    return (
        select(
            AuthSession.id,
            AuthSession.revoked_at,
            AuthSession.password_stamp,
            AuthSession.generation.label("session_generation"),
            User.id.label("user_id"),
            User.team_id,
            User.password_hash,
            User.deleted_at.label("user_deleted"),
            Team.deleted_at.label("team_deleted"),
            User.rpm_limit.label("user_rpm"),
            User.tpm_limit.label("user_tpm"),
            User.max_parallel_requests.label("user_parallel"),
            User.allowed_models.label("user_models"),
            Team.rpm_limit.label("team_rpm"),
            Team.tpm_limit.label("team_tpm"),
            Team.max_parallel_requests.label("team_parallel"),
            Team.allowed_models.label("team_models"),
        )
        .join(User, User.id == AuthSession.user_id)
        .join(Team, Team.id == User.team_id)
    )


async def user_of(db: Database, session_id: str) -> SessionUser:
    """The principal of a valid access token: its session must still be live (one indexed read)."""
    async with db.sessions() as s:
        row = (await s.execute(_session_query().where(AuthSession.id == session_id))).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized(ENDED)
    _live_user(row, row.password_stamp)
    return _session_user(row)


async def revoke(db_session: AsyncSession, session_id: str, reason: str) -> None:
    """Inside the caller's transaction; once it commits, pass invalidation.pending(db_session)
    to services.credentials.changed() so no replica still accepts the session's access tokens."""
    await db_session.execute(
        update(AuthSession)
        .where(AuthSession.id == session_id, AuthSession.revoked_at.is_(None))
        .values(revoked_at=utcnow(), revoked_reason=reason)
    )
    await invalidation.record(db_session, invalidation.subject("session", session_id))


async def _find(db_session: AsyncSession, presented: str) -> SessionRow:
    hashed = digest(presented)
    row = (
        await db_session.execute(
            _session_query()
            .add_columns(
                RefreshToken.token_hash,
                RefreshToken.generation,
                RefreshToken.expires_at,
                RefreshToken.spent_at,
            )
            .join_from(AuthSession, RefreshToken, RefreshToken.session_id == AuthSession.id)
            .where(RefreshToken.token_hash == hashed)
        )
    ).first()
    # Found by its hash; compared once more in constant time, whatever the database's collation.
    if row is None or not same(row.token_hash, hashed):
        raise Unauthorized("unknown refresh token")
    return row


def _within_grace(row: SessionRow, now: datetime) -> bool:
    return (
        row.generation == row.session_generation - 1
        and row.spent_at is not None
        and now - row.spent_at <= timedelta(seconds=REUSE_GRACE_S)
    )


async def rotate(
    services: AuthServices, presented: str, *, session_id: str | None = None, leeway: bool = False
) -> Refreshed:
    """Spend a refresh token for a new pair. `session_id`: the chain it must belong to (the
    header flow passes the access token's); `leeway`: allow the concurrent-request grace."""
    key = await services.signer.key(services.db)
    now = utcnow()
    _, refresh_ttl = _ttls(services)
    reused = None
    async with services.db.transaction() as s:
        row = await _find(s, presented)
        if session_id is not None and row.id != session_id:
            raise Unauthorized("the refresh token does not belong to this access token's session")
        if row.revoked_at is not None:
            raise Unauthorized(ENDED)
        _live_user(row, row.password_stamp)
        user = _session_user(row)
        if row.expires_at <= now:
            raise Unauthorized("this refresh token has expired: log in again")
        spent = cast(
            CursorResult[Any],
            await s.execute(
                update(RefreshToken)
                .where(RefreshToken.token_hash == row.token_hash, RefreshToken.spent_at.is_(None))
                .values(spent_at=now)
            ),
        )
        if row.spent_at is not None or spent.rowcount != 1:
            if leeway and (row.spent_at is None or _within_grace(row, now)):
                return Refreshed(user, None)
            await revoke(s, row.id, "reuse")
            reused = row.id
        else:
            advanced = cast(
                CursorResult[Any],
                await s.execute(
                    update(AuthSession)
                    .where(AuthSession.id == row.id, AuthSession.revoked_at.is_(None))
                    .values(generation=row.generation + 1, refreshed_at=now)
                ),
            )
            if advanced.rowcount != 1:
                raise Unauthorized(ENDED)
            refresh = new_refresh_token()
            await s.execute(
                insert(RefreshToken).values(
                    _refresh_row(row.id, refresh, row.generation + 1, now, refresh_ttl)
                )
            )
            # Expired tokens of the chain can no longer be used or reused: drop them.
            await s.execute(
                delete(RefreshToken).where(
                    RefreshToken.session_id == row.id, RefreshToken.expires_at <= now
                )
            )
    await services.credentials.changed(invalidation.pending(s))
    if reused is not None:
        # Committed above: the revocation stands although this request is refused.
        log.warning("refresh token reused on session %s: the session is revoked", reused)
        raise Unauthorized("this refresh token was already used: the session is revoked")
    return Refreshed(user, _pair(services, key, row.id, row.user_id, refresh, now))


async def logout(services: AuthServices, presented: str) -> None:
    async with services.db.transaction() as s:
        row = await _find(s, presented)
        await revoke(s, row.id, "logout")
    await services.credentials.changed(invalidation.pending(s))
