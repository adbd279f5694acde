"""event endpoint: the API each event's request called (chat.completions or responses), on the
ledger, its archive and the holds (a hold charged on expiry keeps it).

A column with a constant default: on PostgreSQL 11 and later no row is rewritten.

Revision ID: 0024
Revises: 0023
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EVENT_TABLES = ("ledger_events", "ledger_events_archive")


def upgrade() -> None:
    for table in EVENT_TABLES:
        op.add_column(
            table,
            sa.Column("endpoint", sa.String(32), nullable=False, server_default="chat.completions"),
        )
    op.add_column("holds", sa.Column("endpoint", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("holds", "endpoint")
    for table in EVENT_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("endpoint")
