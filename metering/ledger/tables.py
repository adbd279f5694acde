"""The ledger's tables: its events (ledger_events and the archive retention moves old ones to),
the rollups of their sums (spend_hourly and the coarser read models) and the increments waiting
to be folded into them (rollup_pending). Written by metering.ledger only; read by the reports.

The event's columns are declared once, by metering.ledger.event; every table here is on
metering.db's Base, with the rest of the schema (metering.models)."""

from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, Column, Index, Integer, String, Table, Text
from sqlalchemy.orm import Mapped, mapped_column

from metering.db import Base, Pico, UTCDateTime
from metering.ledger.event import columns as ledger_columns


class LedgerEvent(Base):
    """One request that reached an upstream: the columns declared by metering.ledger.event."""

    __table__ = Table(
        "ledger_events",
        Base.metadata,
        *ledger_columns(),
        Index("ix_ledger_events_created", "created_at", "id"),
        Index("ix_ledger_events_token_created", "token_id", "created_at"),
        Index("ix_ledger_events_user_created", "user_id", "created_at"),
        Index("ix_ledger_events_team_created", "team_id", "created_at"),
        Index("ix_ledger_events_corrects", "corrects_event_id"),
        # GET /v1/usage?end_user=: one end user's events, newest first.
        Index("ix_ledger_events_end_user_created", "end_user", "created_at"),
    )
    if TYPE_CHECKING:  # the columns named in queries, as mypy cannot read them off the table
        id: Mapped[str]
        created_at: Mapped[datetime]
        user_id: Mapped[str]


class LedgerEventArchive(Base):
    """Ledger events the retention job moved out of the hot ledger: the very same columns."""

    __table__ = Table(
        "ledger_events_archive",
        Base.metadata,
        *ledger_columns(),
        Index("ix_ledger_events_archive_created", "created_at", "id"),
    )


class SpendHourly(Base):
    """Ledger totals per UTC hour and attribution (token_id '' stands for none): with the
    increments not yet folded in (rollup_pending), it equals the ledger's sums."""

    __tablename__ = "spend_hourly"
    __table_args__ = (
        Index("ix_spend_hourly_user_hour", "user_id", "hour"),
        Index("ix_spend_hourly_token_hour", "token_id", "hour"),
    )

    hour: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    team_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    provider: Mapped[str] = mapped_column(String(100), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[int] = mapped_column(Pico)
    uncharged: Mapped[int] = mapped_column(Pico, default=0, server_default="0")
    # The part of cost made by adjustment events (corrections, credits): spend without them
    # is cost - adjustments.
    adjustments: Mapped[int] = mapped_column(Pico, default=0, server_default="0")


class RollupPending(Base):
    """Hourly rollup increments not yet added to the rollups: every append writes its events'
    increments here, in the transaction (or, on PostgreSQL's one-statement settle, the
    statement) that appends them, one row per key, and a job folds them into every rollup
    (metering.ledger.rollup.fold). The rollups plus these rows equal the ledger's sums at every
    instant; the spend report reads both."""

    __tablename__ = "rollup_pending"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    hour: Mapped[datetime] = mapped_column(UTCDateTime)
    team_id: Mapped[str] = mapped_column(String(40))
    user_id: Mapped[str] = mapped_column(String(40))
    token_id: Mapped[str] = mapped_column(String(40))
    model: Mapped[str] = mapped_column(String(200))
    provider: Mapped[str] = mapped_column(String(100))
    # The events' end user ('' for none) and tags (their JSON text, "{}" for none): the fold
    # fills spend_daily_end_user and spend_daily_tag from them.
    end_user: Mapped[str] = mapped_column(String(256), server_default="")
    tags: Mapped[str] = mapped_column(Text, server_default="{}")
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[int] = mapped_column(Pico)
    uncharged: Mapped[int] = mapped_column(Pico)
    adjustments: Mapped[int] = mapped_column(Pico)


# The coarser read models: the same sums as spend_hourly over fewer keys or whole UTC days
# (the day stored as its midnight). The fold adds each pending increment to every one of them
# (metering.ledger.rollup.ROLLUPS); a report reads the coarsest that answers its question
# exactly.
_KEY_COLUMNS = {
    "team_id": 40,
    "user_id": 40,
    "token_id": 40,
    "model": 200,
    "provider": 100,
    "end_user": 256,
    "tag_key": 64,
    "tag_value": 512,
}
_SUM_COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def _rollup_table(
    name: str, grain: str, keys: tuple[str, ...], indexed: tuple[str | tuple[str, ...], ...]
) -> Table:
    """A rollup table: its grain and keys the primary key (the grain first, so a time range is
    an index range), an index (key, grain) for each key (or keys) a report filters on."""
    return Table(
        name,
        Base.metadata,
        Column(grain, UTCDateTime, primary_key=True),
        *(Column(key, String(_KEY_COLUMNS[key]), primary_key=True) for key in keys),
        *(Column(column, BigInteger, nullable=False) for column in _SUM_COLUMNS),
        Column("reasoning_tokens", BigInteger, nullable=False),
        Column("cost", Pico, nullable=False),
        Column("uncharged", Pico, nullable=False, server_default="0"),
        Column("adjustments", Pico, nullable=False, server_default="0"),
        *(_index(name, grain, key) for key in indexed),
    )


def _index(name: str, grain: str, key: str | tuple[str, ...]) -> Index:
    keys = (key,) if isinstance(key, str) else key
    return Index(f"ix_{name}_{'_'.join(keys)}_{grain}", *keys, grain)


WHO = ("team_id", "user_id", "token_id")
WHAT = ("team_id", "model", "provider")
EVERY_KEY = ("team_id", "user_id", "token_id", "model", "provider")


class SpendHourlyToken(Base):
    """spend_hourly by team, user and token only."""

    __table__ = _rollup_table("spend_hourly_token", "hour", WHO, ("team_id", "user_id", "token_id"))


class SpendHourlyModel(Base):
    """spend_hourly by team, model and provider only."""

    __table__ = _rollup_table("spend_hourly_model", "hour", WHAT, ("team_id", "model"))


class SpendDaily(Base):
    """spend_hourly summed over whole UTC days, every key kept."""

    __table__ = _rollup_table("spend_daily", "day", EVERY_KEY, ("user_id", "token_id"))


class SpendDailyToken(Base):
    """spend_daily by team, user and token only."""

    __table__ = _rollup_table("spend_daily_token", "day", WHO, ("team_id", "user_id", "token_id"))


class SpendDailyModel(Base):
    """spend_daily by team, model and provider only."""

    __table__ = _rollup_table("spend_daily_model", "day", WHAT, ("team_id", "model"))


# By the attribution below the token: only the events' own end user and tags (migration 0020).
END_USER = (*WHO, "end_user")
TAG = (*EVERY_KEY, "tag_key", "tag_value")


class SpendDailyEndUser(Base):
    """spend_daily by team, user, token and end user: the events that have an end user only
    (the rest is spend_daily_token's sums minus these)."""

    __table__ = _rollup_table(
        "spend_daily_end_user", "day", END_USER, (("team_id", "end_user"), "end_user", "user_id")
    )
    # A day's rows in end-user order (migration 0023), on PostgreSQL with the sums included: a
    # report of one day by end user reads its page from the index alone, in the page's order.
    by_day = Index(
        "ix_spend_daily_end_user_day_end_user",
        __table__.c.day,
        __table__.c.end_user,
        postgresql_include=[*_SUM_COLUMNS, "reasoning_tokens", "cost", "uncharged", "adjustments"],
    )


class SpendDailyTag(Base):
    """spend_daily by every key and one tag pair: each event counted once for each of its tags
    (the events without a tag key are spend_daily's sums minus the rows of that key)."""

    __table__ = _rollup_table(
        "spend_daily_tag",
        "day",
        TAG,
        (
            ("tag_key", "tag_value"),
            ("team_id", "tag_key"),
            ("user_id", "tag_key"),
        ),
    )


class SpendDailyTagModel(Base):
    """spend_daily_tag by team, model and provider only (as spend_daily_model is spend_daily's):
    a report by tag over a whole organisation reads a few rows a day per team and model."""

    __table__ = _rollup_table(
        "spend_daily_tag_model",
        "day",
        (*WHAT, "tag_key", "tag_value"),
        (("tag_key", "tag_value"), ("team_id", "tag_key")),
    )


class SpendHourlyTag(Base):
    """spend_daily_tag's sums per UTC hour by team and one tag pair only (migration 0021): the
    whole hours at the edges of a range of whole days (a rolling 30 days), or a report by tag
    and hour, read from it instead of the ledger."""

    __table__ = _rollup_table(
        "spend_hourly_tag",
        "hour",
        ("team_id", "tag_key", "tag_value"),
        (("tag_key", "tag_value"),),
    )
