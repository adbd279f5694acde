"""end user day index: spend_daily_end_user by (day, end_user), on PostgreSQL with the sums
included, so a report of one day by end user reads its rows in end-user order from the index
alone and stops after its page.

Revision ID: 0023
Revises: 0022
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = "ix_spend_daily_end_user_day_end_user"
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


def upgrade() -> None:
    op.create_index(
        NAME,
        "spend_daily_end_user",
        ["day", "end_user"],
        postgresql_include=list(SUMS),
    )


def downgrade() -> None:
    op.drop_index(NAME, table_name="spend_daily_end_user")
