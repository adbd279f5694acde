"""hourly tag rollup: spend per UTC hour by team and tag pair (spend_hourly_tag), so that a
report by tag over a range of whole days and hours reads the hours at its edges from it instead
of the ledger; backfilled from the ledger's events (and archive) that carry tags, less the
increments still pending (the fold adds those)

Revision ID: 0021
Revises: 0020
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "spend_hourly_tag"
KEYS = {"team_id": 40, "tag_key": 64, "tag_value": 512}
INDEX = "ix_spend_hourly_tag_tag_key_tag_value_hour"
SUMS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
    "adjustments",
)
EVENTS = ("ledger_events", "ledger_events_archive")
# An event's figures, as the fold adds them (metering.ledger.rollup.row_for).
FIGURES = (
    "CASE WHEN e.kind = 'adjustment' THEN 0 ELSE 1 END",
    "e.prompt_tokens",
    "e.cached_tokens",
    "e.completion_tokens",
    "COALESCE(e.reasoning_tokens, 0)",
    "e.cost",
    "e.uncharged",
    "CASE WHEN e.kind = 'adjustment' THEN e.cost ELSE 0 END",
)
# The UTC hour of an event, as each backend stores a UTCDateTime.
HOUR = {
    "postgresql": "date_trunc('hour', e.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d %H:00:00.000000', e.created_at)",
}
# Each tag pair of a row's tags, as pair.key and pair.value.
PAIRS = {
    "postgresql": "CROSS JOIN LATERAL jsonb_each_text(CAST({t}.tags AS jsonb)) AS pair",
    "sqlite": "CROSS JOIN json_each({t}.tags) AS pair",
}


def _backfill(dialect: str) -> None:
    """The events' sums per hour, team and tag pair, less the pending increments' (each of
    those is added by the fold, as to every rollup): equal to the ledger once they are."""
    pairs = PAIRS[dialect]
    figures = ", ".join(f"{f} AS {s}" for f, s in zip(FIGURES, SUMS, strict=True))
    events = " UNION ALL ".join(
        f"SELECT {HOUR[dialect]} AS hour, e.team_id, pair.key AS tag_key, "
        f"pair.value AS tag_value, {figures} "
        f"FROM {table} AS e {pairs.format(t='e')} WHERE e.tags <> '{{}}'"
        for table in EVENTS
    )
    pending = (
        "SELECT p.hour, p.team_id, pair.key AS tag_key, pair.value AS tag_value, "
        f"{', '.join(f'-p.{s} AS {s}' for s in SUMS)} "
        f"FROM rollup_pending AS p {pairs.format(t='p')} WHERE p.tags <> '{{}}'"
    )
    keys = "hour, team_id, tag_key, tag_value"
    op.execute(
        f"INSERT INTO {NAME} ({keys}, {', '.join(SUMS)}) "
        f"SELECT {keys}, {', '.join(f'SUM({s})' for s in SUMS)} "
        f"FROM ({events} UNION ALL {pending}) AS part GROUP BY {keys}"
    )


def upgrade() -> None:
    op.create_table(
        NAME,
        sa.Column("hour", metering.db.UTCDateTime(timezone=True), nullable=False),
        *(sa.Column(k, sa.String(length=n), nullable=False) for k, n in KEYS.items()),
        *(sa.Column(s, sa.BigInteger(), nullable=False) for s in SUMS[:5]),
        sa.Column("cost", sa.BigInteger(), nullable=False),
        sa.Column("uncharged", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("adjustments", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("hour", *KEYS, name=op.f(f"pk_{NAME}")),
    )
    op.create_index(INDEX, NAME, ["tag_key", "tag_value", "hour"], unique=False)
    dialect = op.get_bind().dialect.name
    _backfill(dialect)
    if dialect == "postgresql":  # planned with its rows known, not as an empty table
        op.execute(f"ANALYZE {NAME}")


def downgrade() -> None:
    op.drop_index(INDEX, table_name=NAME)
    op.drop_table(NAME)
