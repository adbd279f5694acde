"""end-user budgets: a team's default budget for each of its end users, the end users with a
budget (and their overrides), and the end-user budget a hold is reserved in

Revision ID: 0019
Revises: 0018
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Not in a batch: on SQLite a batch would copy the table, losing its expression index
    # (uq_teams_name_live); ADD and DROP COLUMN are native there.
    op.add_column("teams", sa.Column("end_user_credit_limit", sa.BigInteger(), nullable=True))
    op.add_column(
        "teams",
        sa.Column("end_user_reset_interval", sa.String(20), nullable=False, server_default="never"),
    )
    op.create_table(
        "end_user_budgets",
        sa.Column("subject_id", sa.String(40), primary_key=True),
        sa.Column("team_id", sa.String(40), nullable=False),
        sa.Column("end_user", sa.String(256), nullable=False),
        sa.Column("override", sa.Boolean(), nullable=False),
        sa.Column("credit_limit", sa.BigInteger(), nullable=True),
        sa.Column("reset_interval", sa.String(20), nullable=True),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "uq_end_user_budgets_team_end_user",
        "end_user_budgets",
        ["team_id", "end_user"],
        unique=True,
    )
    with op.batch_alter_table("holds") as batch:
        batch.add_column(sa.Column("end_user_budget", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("holds") as batch:
        batch.drop_column("end_user_budget")
    op.drop_index("uq_end_user_budgets_team_end_user", table_name="end_user_budgets")
    op.drop_table("end_user_budgets")
    op.drop_column("teams", "end_user_reset_interval")
    op.drop_column("teams", "end_user_credit_limit")
