"""attributed rollups: spend per UTC day by end user (spend_daily_end_user) and by tag pair
(spend_daily_tag), and the end user and tags of each pending increment so that the fold fills
them; both backfilled from the ledger's events (and archive) that carry an end user or tags

Revision ID: 0020
Revises: 0019
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY_LENGTHS = {
    "team_id": 40,
    "user_id": 40,
    "token_id": 40,
    "model": 200,
    "provider": 100,
    "end_user": 256,
    "tag_key": 64,
    "tag_value": 512,
}
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
WHO = ("team_id", "user_id", "token_id")
WHAT = ("team_id", "model", "provider")
EVERY_KEY = (*WHO, "model", "provider")
# name -> keys, the indexes (columns, the day last)
TABLES = {
    "spend_daily_end_user": (
        (*WHO, "end_user"),
        (("team_id", "end_user"), ("end_user",), ("user_id",)),
    ),
    "spend_daily_tag": (
        (*EVERY_KEY, "tag_key", "tag_value"),
        (("tag_key", "tag_value"), ("team_id", "tag_key"), ("user_id", "tag_key")),
    ),
    "spend_daily_tag_model": (
        (*WHAT, "tag_key", "tag_value"),
        (("tag_key", "tag_value"), ("team_id", "tag_key")),
    ),
}
# What an event adds to each key column (the tag's from the pair).
SOURCE = {
    "team_id": "e.team_id",
    "user_id": "e.user_id",
    "token_id": "COALESCE(e.token_id, '')",
    "model": "e.model",
    "provider": "e.provider",
    "end_user": "e.end_user",
    "tag_key": "pair.key",
    "tag_value": "pair.value",
}
# The views of revision 0015 that read rollup_pending.
LIVE = {
    "spend_hourly_model_live": ("spend_hourly_model", ("team_id", "model", "provider")),
    "spend_hourly_token_live": ("spend_hourly_token", ("team_id", "user_id", "token_id")),
}
EVENTS = ("ledger_events", "ledger_events_archive")
READ = (
    "created_at, team_id, user_id, token_id, model, provider, kind, prompt_tokens, "
    "cached_tokens, completion_tokens, reasoning_tokens, cost, uncharged, end_user, tags"
)
# The UTC day of an event, as each backend stores a UTCDateTime.
DAY = {
    "postgresql": "date_trunc('day', e.created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d 00:00:00.000000', e.created_at)",
}
# Each tag pair of an event, as pair.key and pair.value.
PAIRS = {
    "postgresql": "CROSS JOIN LATERAL jsonb_each_text(CAST(e.tags AS jsonb)) AS pair",
    "sqlite": "CROSS JOIN json_each(e.tags) AS pair",
}
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


def _index(table: str, columns: tuple[str, ...]) -> str:
    return f"ix_{table}_{'_'.join(columns)}_day"


def _backfill(dialect: str) -> None:
    """The new rollups' rows from the events that have an end user or tags (none before 0017:
    a plain INSERT ... SELECT). The increments still pending from before this revision carry
    no end user or tags, so nothing is counted twice."""
    day = DAY[dialect]
    sums = ", ".join(f"SUM({f})" for f in FIGURES)
    events = " UNION ALL ".join(f"SELECT {READ} FROM {table}" for table in EVENTS)
    for name, (columns, _) in TABLES.items():
        keys = ", ".join(SOURCE[c] for c in columns)
        if "end_user" in columns:
            source = f"({events}) AS e WHERE e.end_user IS NOT NULL"
        else:
            source = f"({events}) AS e {PAIRS[dialect]} WHERE e.tags <> '{{}}'"
        op.execute(
            f"INSERT INTO {name} (day, {', '.join(columns)}, {', '.join(SUMS)}) "
            f"SELECT {day}, {keys}, {sums} FROM {source} GROUP BY {day}, {keys}"
        )


def upgrade() -> None:
    with op.batch_alter_table("rollup_pending") as batch:
        batch.add_column(sa.Column("end_user", sa.String(256), nullable=False, server_default=""))
        batch.add_column(sa.Column("tags", sa.Text(), nullable=False, server_default="{}"))
    for name, (keys, indexed) in TABLES.items():
        op.create_table(
            name,
            sa.Column("day", metering.db.UTCDateTime(timezone=True), nullable=False),
            *(sa.Column(k, sa.String(length=KEY_LENGTHS[k]), nullable=False) for k in keys),
            *(sa.Column(s, sa.BigInteger(), nullable=False) for s in SUMS[:5]),
            sa.Column("cost", sa.BigInteger(), nullable=False),
            sa.Column("uncharged", sa.BigInteger(), nullable=False, server_default="0"),
            sa.Column("adjustments", sa.BigInteger(), nullable=False, server_default="0"),
            sa.PrimaryKeyConstraint("day", *keys, name=op.f(f"pk_{name}")),
        )
        for columns in indexed:
            op.create_index(_index(name, columns), name, [*columns, "day"], unique=False)
    _backfill(op.get_bind().dialect.name)


def downgrade() -> None:
    for name, (_, indexed) in reversed(TABLES.items()):
        for columns in indexed:
            op.drop_index(_index(name, columns), table_name=name)
        op.drop_table(name)
    # SQLite drops a column by copying the table: the views that read it go first (0015's).
    for view in LIVE:
        op.execute(f"DROP VIEW {view}")
    with op.batch_alter_table("rollup_pending") as batch:
        batch.drop_column("tags")
        batch.drop_column("end_user")
    for view, (rollup, keys) in LIVE.items():
        columns = ", ".join(("hour", *keys, *SUMS))
        op.execute(
            f"CREATE VIEW {view} AS SELECT {columns} FROM {rollup} "
            f"UNION ALL SELECT {columns} FROM rollup_pending"
        )
