"""Teams, users and API tokens. Services flush; the endpoint's unit of work commits."""

import json
import uuid
from datetime import datetime, timedelta

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth import invalidation
from metering.auth.tokens import digest, new_api_token
from metering.budgets.views import load, new_budget, roll
from metering.budgets.windows import parse_interval, window_for
from metering.db import contains, utcnow
from metering.errors import Forbidden, InvalidRequest, MeteringError, NotFound
from metering.limits import allows, dump_models, parse_models
from metering.models import ApiToken, Budget, Team, User
from metering.money import usd_to_pico
from metering.timefmt import rfc3339

MAX_ACTIVE_TOKENS = 10


class TokenCapReached(MeteringError):
    status, code = 409, "token_limit_reached"


class EmailTaken(MeteringError):
    status, code = 409, "email_taken"


class TeamNameTaken(MeteringError):
    status, code = 409, "team_name_taken"


LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_parallel_requests", "allowed_models")


def set_limits(subject, fields: dict) -> bool:
    """Apply the limit fields a body sent (null removes one); whether any was sent."""
    sent = False
    for name in LIMIT_FIELDS:
        if name in fields:
            value = fields[name]
            setattr(subject, name, dump_models(value) if name == "allowed_models" else value)
            sent = True
    return sent


def check_narrowing(patterns: list[str] | None, parents: list[tuple[str, str, str | None]]) -> None:
    """A token's (or user's) allow-list only narrows its user's and team's: each exact name it
    lists must be allowed there too (a pattern is intersected with theirs when checked)."""
    if patterns is None:
        return
    for scope, subject_id, parent in parents:
        allowed = parse_models(parent)
        for name in patterns:
            if not any(c in name for c in "*?") and not allows(allowed, name):
                raise InvalidRequest(
                    f"allowed_models: {name} is not allowed for {scope} {subject_id}; a list "
                    "may only narrow its user's and team's",
                    param="allowed_models",
                )


def token_expiry(
    now: datetime, expires_at: datetime | None, expires_in: int | None, max_lifetime_s: int | None
) -> datetime | None:
    """When a token expires: `expires_at`, or `expires_in` seconds from now, at most the
    operator's max lifetime from now."""
    if expires_in is not None:
        expires_at = now + timedelta(seconds=expires_in)
    if expires_at is not None and expires_at <= now:
        raise InvalidRequest("expires_at must be in the future", param="expires_at")
    if max_lifetime_s is not None:
        ceiling = now + timedelta(seconds=max_lifetime_s)
        if expires_at is None or expires_at > ceiling:
            expires_at = ceiling
    return expires_at


def new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def _pico(limit):
    return None if limit is None else usd_to_pico(limit)


async def get_team(session: AsyncSession, team_id: str) -> Team:
    team = await session.get(Team, team_id)
    if team is None or team.deleted_at is not None:
        raise NotFound(f"team {team_id} not found")
    return team


async def get_user(session: AsyncSession, user_id: str) -> User:
    user = await session.get(User, user_id)
    if user is None or user.deleted_at is not None:
        raise NotFound(f"user {user_id} not found")
    return user


async def get_token(session: AsyncSession, token_id: str) -> ApiToken:
    token = await session.get(ApiToken, token_id)
    if token is None:
        raise NotFound(f"token {token_id} not found")
    return token


async def get_budget(session: AsyncSession, subject_id: str) -> Budget | None:
    return await session.get(Budget, subject_id)


async def budgets_of(session: AsyncSession, ids: list[str]) -> dict[str, Budget]:
    found = await session.scalars(select(Budget).where(Budget.subject_id.in_(ids)))
    return {b.subject_id: b for b in found}


def _search(query, id_column, q: str | None, *columns):
    """Rows whose id is `q`, or one of whose `columns` holds it without case (q empty: all)."""
    if not q:
        return query
    return query.where(or_(id_column == q, *(contains(c, q) for c in columns)))


async def list_teams(
    session: AsyncSession, *, limit: int, after: str | None, q: str | None = None
) -> list[Team]:
    query = select(Team).where(Team.deleted_at.is_(None)).order_by(Team.id).limit(limit)
    if after:
        query = query.where(Team.id > after)
    query = _search(query, Team.id, q, Team.name)
    return list(await session.scalars(query))


async def list_users(
    session: AsyncSession,
    *,
    team_id: str | None,
    limit: int,
    after: str | None,
    q: str | None = None,
) -> list[User]:
    query = select(User).where(User.deleted_at.is_(None)).order_by(User.id).limit(limit)
    if team_id:
        query = query.where(User.team_id == team_id)
    if after:
        query = query.where(User.id > after)
    query = _search(query, User.id, q, User.name, User.email)
    return list(await session.scalars(query))


async def list_tokens(
    session: AsyncSession,
    user_id: str,
    *,
    include_revoked: bool,
    limit: int = 100,
    after: str | None = None,
    q: str | None = None,
) -> list[ApiToken]:
    """A user's tokens in the order they were made, `limit` of them after the token `after`
    (a token of another user, or none, starts nowhere: an empty page)."""
    await get_user(session, user_id)
    query = (
        select(ApiToken)
        .where(ApiToken.user_id == user_id)
        .order_by(ApiToken.created_at, ApiToken.id)
        .limit(limit)
    )
    if after:
        mark = (
            select(ApiToken.created_at, ApiToken.id)
            .where(ApiToken.id == after, ApiToken.user_id == user_id)
            .subquery()
        )
        query = query.join(
            mark, tuple_(ApiToken.created_at, ApiToken.id) > tuple_(mark.c.created_at, mark.c.id)
        )
    if not include_revoked:
        query = query.where(ApiToken.revoked_at.is_(None))
    query = _search(query, ApiToken.id, q, ApiToken.name, ApiToken.prefix)
    return list(await session.scalars(query))


async def create_team(
    session: AsyncSession, name: str, limit, interval: str, limits: dict | None = None
) -> Team:
    await _team_name_free(session, name)
    now = utcnow()
    team = Team(id=new_id("team"), name=name, created_at=now)
    set_limits(team, limits or {})
    session.add(team)
    session.add(new_budget(team.id, "team", _pico(limit), interval, now))
    await _flush_unique(
        session, TeamNameTaken(f"a team named {name!r} already exists", param="name")
    )
    return team


async def _flush_unique(session: AsyncSession, taken: MeteringError) -> None:
    """Flush; a unique index refusing the row (a creation or rename racing this one past the
    service's check) is the same 409 the check gives, never a 500."""
    try:
        await session.flush()
    except sa_exc.IntegrityError as exc:
        if "uq_" not in str(exc.orig) and "UNIQUE" not in str(exc.orig):
            raise
        raise taken from None


async def _team_name_free(session: AsyncSession, name: str, except_id: str | None = None) -> None:
    """Team names are unique among live teams, compared without case (409 names the holder as
    it is spelled)."""
    query = select(Team.id, Team.name).where(
        func.lower(Team.name) == name.lower(), Team.deleted_at.is_(None), Team.id != except_id
    )
    existing = (await session.execute(query.limit(1))).first()
    if existing is not None:
        raise TeamNameTaken(
            f"a team named {existing.name!r} already exists (id {existing.id})", param="name"
        )


async def _email_free(session: AsyncSession, email: str, except_id: str | None = None) -> None:
    """Emails are unique among live users, compared without case (409 names the holder as it
    is spelled)."""
    query = select(User.id, User.email).where(
        func.lower(User.email) == email.lower(), User.deleted_at.is_(None), User.id != except_id
    )
    existing = (await session.execute(query.limit(1))).first()
    if existing is not None:
        raise EmailTaken(
            f"a user with email {existing.email!r} already exists (id {existing.id})",
            param="email",
        )


async def create_user(
    session: AsyncSession, *, email, name, team_id, password_hash, limit, interval, limits=None
) -> User:
    limits = limits or {}
    try:
        team = await get_team(session, team_id)
    except NotFound:
        raise InvalidRequest(f"team {team_id} not found", param="team_id") from None
    check_narrowing(limits.get("allowed_models"), [("team", team.id, team.allowed_models)])
    await _email_free(session, email)
    now = utcnow()
    user = User(
        id=new_id("user"),
        email=email,
        name=name,
        team_id=team_id,
        password_hash=password_hash,
        created_at=now,
    )
    set_limits(user, limits)
    session.add(user)
    session.add(new_budget(user.id, "user", _pico(limit), interval, now))
    await _flush_unique(session, EmailTaken(f"a user with email {email} already exists"))
    return user


async def create_token(
    session: AsyncSession,
    user_id: str,
    *,
    name,
    limit,
    interval,
    expires_at: datetime | None,
    expires_in: int | None = None,
    max_lifetime_s: int | None = None,
    limits: dict | None = None,
) -> tuple[ApiToken, str]:
    """A new API token; its secret is returned this once. At most 10 active per user."""
    now = utcnow()
    limits = limits or {}
    # Lock the user row: concurrent creations for one user queue here, so the count is exact.
    user = (
        await session.execute(select(User).where(User.id == user_id).with_for_update())
    ).scalar_one_or_none()
    if user is None or user.deleted_at is not None:
        raise NotFound(f"user {user_id} not found")
    expires_at = token_expiry(now, expires_at, expires_in, max_lifetime_s)
    await _narrows_user(session, user, limits.get("allowed_models"))
    active = (
        await session.execute(
            select(func.count())
            .select_from(ApiToken)
            .where(
                ApiToken.user_id == user_id,
                ApiToken.revoked_at.is_(None),
                (ApiToken.expires_at.is_(None)) | (ApiToken.expires_at > now),
            )
        )
    ).scalar_one()
    if active >= MAX_ACTIVE_TOKENS:
        raise TokenCapReached(
            f"user {user_id} already has {MAX_ACTIVE_TOKENS} active tokens: revoke one first"
        )
    secret = new_api_token()
    token = ApiToken(
        id=new_id("tok"),
        user_id=user_id,
        name=name,
        prefix=secret[:12],
        token_hash=digest(secret),
        expires_at=expires_at,
        created_at=now,
    )
    set_limits(token, limits)
    session.add(token)
    session.add(new_budget(token.id, "token", _pico(limit), interval, now))
    await session.flush()
    return token, secret


async def revoke_token(session: AsyncSession, token_id: str) -> None:
    await get_token(session, token_id)
    await session.execute(
        update(ApiToken)
        .where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    await invalidation.record(session, invalidation.subject("token", token_id))


async def delete_user(session: AsyncSession, user_id: str) -> None:
    await get_user(session, user_id)
    now = utcnow()
    await session.execute(update(User).where(User.id == user_id).values(deleted_at=now))
    await session.execute(
        update(ApiToken)
        .where(ApiToken.user_id == user_id, ApiToken.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    await invalidation.record(session, invalidation.subject("user", user_id))


async def delete_team(session: AsyncSession, team_id: str) -> None:
    await get_team(session, team_id)
    await session.execute(update(Team).where(Team.id == team_id).values(deleted_at=utcnow()))
    await invalidation.record(session, invalidation.subject("team", team_id))


async def _narrows_user(session: AsyncSession, user: User, patterns: list[str] | None) -> None:
    team = await session.get(Team, user.team_id)
    parents = [("user", user.id, user.allowed_models)]
    if team is not None:
        parents.append(("team", team.id, team.allowed_models))
    check_narrowing(patterns, parents)


async def update_team(session: AsyncSession, team_id: str, fields: dict) -> Team:
    """Apply a PATCH's fields (those it sent); the team as it now is."""
    team = await get_team(session, team_id)
    if fields.get("name") is not None and fields["name"] != team.name:
        await _team_name_free(session, fields["name"], except_id=team_id)
        team.name = fields["name"]
    if set_limits(team, fields):
        # Every replica's cached credentials of the team carry its limits: dropped.
        await invalidation.record(session, invalidation.subject("team", team_id))
    await change_budget(session, team_id, fields)
    await _flush_unique(
        session, TeamNameTaken(f"a team named {fields.get('name')!r} already exists", param="name")
    )
    session.expire_all()
    return await get_team(session, team_id)


async def update_user(
    session: AsyncSession, user_id: str, fields: dict, password_hash: str | None
) -> User:
    """Apply a PATCH's fields (those it sent; the new password already hashed)."""
    user = await get_user(session, user_id)
    email = fields.get("email")
    if email is not None and email != user.email:
        await _email_free(session, email, except_id=user_id)
        user.email = email
    if fields.get("name") is not None:
        user.name = fields["name"]
    moved = fields.get("team_id") is not None and fields["team_id"] != user.team_id
    if fields.get("team_id") is not None:
        await get_team(session, fields["team_id"])
        user.team_id = fields["team_id"]
    if password_hash is not None:
        user.password_hash = password_hash
    if "allowed_models" in fields:
        team = await session.get(Team, user.team_id)
        parents = [("team", team.id, team.allowed_models)] if team is not None else []
        check_narrowing(fields["allowed_models"], parents)
    if set_limits(user, fields) or moved or password_hash is not None:
        # Its credentials now charge another team, or its sessions have ended.
        await invalidation.record(session, invalidation.subject("user", user_id))
    await change_budget(session, user_id, fields)
    await _flush_unique(session, EmailTaken(f"a user with email {email} already exists"))
    session.expire_all()
    return await get_user(session, user_id)


def check_tightening(token: ApiToken, fields: dict) -> None:
    """A user's own credential may tighten its token's limits, never loosen them: a number
    only lowered (or set where there was none), an allow-list only replaced by one that the
    current list covers (each entry allowed by it, or one of its own patterns)."""
    for name in ("rpm_limit", "tpm_limit", "max_parallel_requests"):
        if name not in fields:
            continue
        current, new = getattr(token, name), fields[name]
        if current is not None and (new is None or new > current):
            raise Forbidden(
                f"{name}: only the admin key may raise or remove a token's limit", param=name
            )
    if "allowed_models" in fields and token.allowed_models is not None:
        current = parse_models(token.allowed_models) or ()
        new = fields["allowed_models"]
        if (
            new is None
            or any(n not in current and not allows(current, n) for n in new)
            or any(any(c in n for c in "*?") and n not in current for n in new)
        ):
            raise Forbidden(
                "allowed_models: only the admin key may widen a token's list",
                param="allowed_models",
            )


async def check_budget_tightening(session: AsyncSession, token_id: str, fields: dict) -> None:
    """A user's own credential may lower its token's credit limit (or set one where there was
    none), never raise or remove it, and may not change its reset interval (a shorter window
    would reset the limit sooner)."""
    if "credit_limit" not in fields and fields.get("reset_interval") is None:
        return
    budget = (await load(session, [token_id])).get(token_id)
    if budget is None:
        return
    if "credit_limit" in fields and budget.credit_limit is not None:
        new = fields["credit_limit"]
        if new is None or _pico(new) > budget.credit_limit:
            raise Forbidden(
                "credit_limit: only the admin key may raise or remove a token's credit limit",
                param="credit_limit",
            )
    if fields.get("reset_interval") not in (None, budget.reset_interval):
        raise Forbidden(
            "reset_interval: only the admin key may change a token's reset interval",
            param="reset_interval",
        )


def check_shortening(token: ApiToken, fields: dict, now: datetime) -> None:
    """A user's own credential may give its token an expiry or bring it closer, never push it
    out or remove it (`expires_in` counts from now; null removes), as with its limits."""
    if "expires_at" not in fields and "expires_in" not in fields:
        return
    wanted: datetime | None
    if fields.get("expires_in") is not None:
        name, wanted = "expires_in", now + timedelta(seconds=fields["expires_in"])
    else:
        name = "expires_at" if "expires_at" in fields else "expires_in"
        wanted = fields.get("expires_at")
    current = token.expires_at
    if current is not None and (wanted is None or wanted > current):
        raise Forbidden(
            f"{name}: only the admin key may extend or remove a token's expiry (this one "
            f"expires at {rfc3339(current)})",
            param=name,
        )


async def update_token(
    session: AsyncSession,
    token_id: str,
    fields: dict,
    max_lifetime_s: int | None = None,
    *,
    tighten_only: bool = False,
) -> ApiToken:
    token = await get_token(session, token_id)
    now = utcnow()
    if tighten_only:
        check_tightening(token, fields)
        check_shortening(token, fields, now)
        await check_budget_tightening(session, token_id, fields)
    if fields.get("name") is not None:
        token.name = fields["name"]
    if "allowed_models" in fields:
        user = await session.get(User, token.user_id)
        if user is not None:
            await _narrows_user(session, user, fields["allowed_models"])
    changed = set_limits(token, fields)
    if "expires_at" in fields or "expires_in" in fields:
        token.expires_at = token_expiry(
            now, fields.get("expires_at"), fields.get("expires_in"), max_lifetime_s
        )
        changed = True
    if changed:
        # Every replica's cached credential carries the token's expiry and limits: dropped
        # before this call returns.
        await invalidation.record(session, invalidation.subject("token", token_id))
    await change_budget(session, token_id, fields)
    await session.flush()
    session.expire_all()
    return await get_token(session, token_id)


async def change_budget(session: AsyncSession, subject_id: str, fields: dict) -> None:
    """A new limit applies to the current window at once; a new interval re-anchors the window
    at the time of the change, keeping what was spent so far counted in it."""
    values: dict = {}
    if "credit_limit" in fields:
        values["credit_limit"] = _pico(fields["credit_limit"])
    if fields.get("reset_interval") is not None:
        now = utcnow()
        current = (await load(session, [subject_id])).get(subject_id)
        if current is not None:
            await roll(session, current, now)
        interval = parse_interval(fields["reset_interval"])
        values.update(
            reset_interval=interval.text,
            anchor_at=now,
            window_start=window_for(interval, now, now)[0],
        )
    if values:
        await session.execute(
            update(Budget).where(Budget.subject_id == subject_id).values(**values)
        )
        # Every replica drops its leases of this budget before the change is answered.
        await invalidation.record(session, invalidation.subject("budget", subject_id))
    await set_alerts(session, subject_id, fields)


ALERT_FIELDS = ("alert_thresholds", "soft_limit")


async def set_alerts(session: AsyncSession, subject_id: str, fields: dict) -> None:
    """A budget's thresholds and soft limit (those sent). They only alert: admission never
    reads them, so no replica needs to hear of the change."""
    values: dict = {}
    if "alert_thresholds" in fields:
        chosen = fields["alert_thresholds"]
        values["alert_thresholds"] = None if chosen is None else json.dumps(sorted(chosen))
    if "soft_limit" in fields:
        values["soft_limit"] = _pico(fields["soft_limit"])
    if values:
        await session.execute(
            update(Budget).where(Budget.subject_id == subject_id).values(**values)
        )
