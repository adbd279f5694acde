"""A team's ingestion keys (POST/GET /v1/teams/{id}/ingest-keys, DELETE .../{key_id}): the
credentials a team's own collector reports usage with. A key reports only for its team's
tokens, users and team, and is charged in full (the usage already happened). The secret is
shown once; only its SHA-256 is kept, and every use reads the key's row, so a revocation holds
at once on every replica."""

import uuid
from datetime import datetime

from pydantic import BaseModel, Field
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metering.auth.tokens import digest, new_ingest_key
from metering.db import utcnow
from metering.errors import MeteringError, NotFound
from metering.models import IngestKey, Team
from metering.text import RequestBody
from metering.timefmt import rfc3339

MAX_ACTIVE = 20  # live keys per team: enough to rotate every collector, bounded


class IngestKeyCreate(RequestBody):
    name: str = Field(min_length=1, max_length=200, description="what the key is for")


class IngestKeyOut(BaseModel):
    id: str
    team_id: str
    name: str
    prefix: str = Field(description="the secret's first characters, to recognise it")
    created_at: str
    revoked_at: str | None

    @classmethod
    def of(cls, key: IngestKey) -> "IngestKeyOut":
        return cls(
            id=key.id,
            team_id=key.team_id,
            name=key.name,
            prefix=key.prefix,
            created_at=rfc3339(key.created_at),
            revoked_at=rfc3339(key.revoked_at) if key.revoked_at else None,
        )


class IngestKeyCreated(IngestKeyOut):
    key: str = Field(description="the secret (`mik_...`), shown this once")


class IngestKeyList(BaseModel):
    data: list[IngestKeyOut]


class TooManyKeys(MeteringError):
    status, code = 409, "ingest_key_limit_reached"


async def _live_team(session: AsyncSession, team_id: str) -> Team:
    team = (
        await session.execute(select(Team).where(Team.id == team_id).with_for_update())
    ).scalar_one_or_none()
    if team is None or team.deleted_at is not None:
        raise NotFound(f"team {team_id} not found")
    return team


async def create(session: AsyncSession, team_id: str, name: str) -> tuple[IngestKey, str]:
    """A new key of the team and its secret. The team's row is locked, so concurrent creations
    count exactly against MAX_ACTIVE."""
    await _live_team(session, team_id)
    active = await session.scalars(
        select(IngestKey.id).where(IngestKey.team_id == team_id, IngestKey.revoked_at.is_(None))
    )
    if len(list(active)) >= MAX_ACTIVE:
        raise TooManyKeys(
            f"team {team_id} has {MAX_ACTIVE} active ingestion keys, the most it may hold: "
            "revoke one first"
        )
    secret = new_ingest_key()
    key = IngestKey(
        id=f"ik_{uuid.uuid4().hex}",
        team_id=team_id,
        name=name,
        prefix=secret[:12],
        key_hash=digest(secret),
        created_at=utcnow(),
    )
    session.add(key)
    await session.flush()
    return key, secret


async def listed(session: AsyncSession, team_id: str, include_revoked: bool) -> list[IngestKey]:
    team = await session.get(Team, team_id)
    if team is None or team.deleted_at is not None:
        raise NotFound(f"team {team_id} not found")
    query = select(IngestKey).where(IngestKey.team_id == team_id).order_by(IngestKey.created_at)
    if not include_revoked:
        query = query.where(IngestKey.revoked_at.is_(None))
    return list(await session.scalars(query))


async def revoke(session: AsyncSession, team_id: str, key_id: str, now: datetime | None = None):
    found = await session.scalar(
        select(IngestKey.id).where(IngestKey.id == key_id, IngestKey.team_id == team_id)
    )
    if found is None:
        raise NotFound(f"ingestion key {key_id} not found in team {team_id}")
    await session.execute(
        update(IngestKey)
        .where(IngestKey.id == key_id, IngestKey.revoked_at.is_(None))
        .values(revoked_at=now or utcnow())
    )
