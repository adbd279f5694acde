"""change feed: on PostgreSQL, each ledger event's writing transaction (`txid`, xid8, set by
the database on insert), and the index GET /v1/usage/changes reads in that order
(docs/decisions/change-feed.md). Existing events read as transaction 0: before every new one.

Adding a column with a constant default rewrites no row; the default for new rows is set after.
SQLite has nothing to add: one writer at a time commits its rows in rowid order.

Revision ID: 0026
Revises: 0025
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE ledger_events ADD COLUMN txid xid8 NOT NULL DEFAULT '0'")
    op.execute("ALTER TABLE ledger_events ALTER COLUMN txid SET DEFAULT pg_current_xact_id()")
    op.execute("CREATE INDEX ix_ledger_events_txid ON ledger_events (txid, id)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP INDEX ix_ledger_events_txid")
    op.execute("ALTER TABLE ledger_events DROP COLUMN txid")
