"""rollup_pending: hourly rollup increments written with their events, folded into the rollups

The one-statement settle on PostgreSQL writes each event's increment here instead of upserting
six rollup rows; a job folds them into every rollup, and the spend report reads the rollups
plus these rows, so it stays exact at every instant. The views spend_hourly_model_live and
spend_hourly_token_live are the two hourly rollups Grafana reads, plus what is pending, as rows
to be summed (the dashboards sum them).

Revision ID: 0015
Revises: 0014
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FIGURES = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "reasoning_tokens",
    "cost",
    "uncharged",
    "adjustments",
)


# The rollups Grafana's panels read, with the increments not yet folded into them.
LIVE = {
    "spend_hourly_model_live": ("spend_hourly_model", ("team_id", "model", "provider")),
    "spend_hourly_token_live": ("spend_hourly_token", ("team_id", "user_id", "token_id")),
}


def _live_view(rollup: str, keys: tuple[str, ...]) -> str:
    columns = ", ".join(("hour", *keys, *FIGURES))
    return f"SELECT {columns} FROM {rollup} UNION ALL SELECT {columns} FROM rollup_pending"


def upgrade() -> None:
    op.create_table(
        "rollup_pending",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("hour", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("team_id", sa.String(40), nullable=False),
        sa.Column("user_id", sa.String(40), nullable=False),
        sa.Column("token_id", sa.String(40), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("provider", sa.String(100), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in FIGURES),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollup_pending")),
    )
    for view, (rollup, keys) in LIVE.items():
        op.execute(f"CREATE VIEW {view} AS {_live_view(rollup, keys)}")


def downgrade() -> None:
    for view in LIVE:
        op.execute(f"DROP VIEW {view}")
    op.drop_table("rollup_pending")
