"""end user index: GET /v1/usage's end_user filter reads the ledger by end user, newest first

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_ledger_events_end_user_created", "ledger_events", ["end_user", "created_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_ledger_events_end_user_created", table_name="ledger_events")
