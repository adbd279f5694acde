"""daily rollups: spend by team, user and token and by team, model and provider per hour, and
the three of them per UTC day (backfilled from spend_hourly)

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY_LENGTHS = {"team_id": 40, "user_id": 40, "token_id": 40, "model": 200, "provider": 100}
WHO = ("team_id", "user_id", "token_id")
WHAT = ("team_id", "model", "provider")
EVERY_KEY = ("team_id", "user_id", "token_id", "model", "provider")
SUMS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
)
# name -> grain, keys, the keys indexed with the grain
TABLES = {
    "spend_hourly_token": ("hour", WHO, ("team_id", "user_id", "token_id")),
    "spend_hourly_model": ("hour", WHAT, ("team_id", "model")),
    "spend_daily": ("day", EVERY_KEY, ("user_id", "token_id")),
    "spend_daily_token": ("day", WHO, ("team_id", "user_id", "token_id")),
    "spend_daily_model": ("day", WHAT, ("team_id", "model")),
}
# The UTC day of spend_hourly's hour, as each backend stores a UTCDateTime.
DAY = {
    "postgresql": "date_trunc('day', hour AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d 00:00:00.000000', hour)",
}


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    for name, (grain, keys, indexed) in TABLES.items():
        op.create_table(
            name,
            sa.Column(grain, metering.db.UTCDateTime(timezone=True), nullable=False),
            *(sa.Column(k, sa.String(length=KEY_LENGTHS[k]), nullable=False) for k in keys),
            *(sa.Column(s, sa.BigInteger(), nullable=False) for s in SUMS[:-1]),
            sa.Column("uncharged", sa.BigInteger(), nullable=False, server_default="0"),
            sa.PrimaryKeyConstraint(grain, *keys, name=op.f(f"pk_{name}")),
        )
        with op.batch_alter_table(name, schema=None) as batch_op:
            for key in indexed:
                batch_op.create_index(f"ix_{name}_{key}_{grain}", [key, grain], unique=False)
        # spend_hourly holds every event ever settled (the archived ones too): the new rollups
        # start equal to it, hence to the ledger.
        at = "hour" if grain == "hour" else DAY[dialect]
        columns = ", ".join(keys)
        sums = ", ".join(f"SUM({s})" for s in SUMS)
        op.execute(
            f"INSERT INTO {name} ({grain}, {columns}, {', '.join(SUMS)}) "
            f"SELECT {at}, {columns}, {sums} FROM spend_hourly GROUP BY {at}, {columns}"
        )


def downgrade() -> None:
    for name, (grain, _, indexed) in reversed(TABLES.items()):
        with op.batch_alter_table(name, schema=None) as batch_op:
            for key in indexed:
                batch_op.drop_index(f"ix_{name}_{key}_{grain}")
        op.drop_table(name)
