"""search indexes: on PostgreSQL, trigram indexes (pg_trgm) on the lowered names of teams and the
lowered names and emails of users, which the lists' `q` (a substring in any case) reads instead
of every row. Nothing on SQLite, nor where the extension cannot be had: the search then reads
the rows, as it would without the indexes.

Revision ID: 0022
Revises: 0021
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Not in the models: an index of one database, that alembic's comparison passes over.
INDEXES = {
    "ix_teams_name_search": "teams USING gin (lower(name) gin_trgm_ops)",
    "ix_users_search": "users USING gin (lower(name) gin_trgm_ops, lower(email) gin_trgm_ops)",
}


def _trigrams(bind) -> bool:
    """Whether pg_trgm is there, or could be made by this role (in a savepoint: a refusal must
    not end the migration's transaction)."""
    found = bind.execute(
        sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm'")
    ).first()
    if found is None:
        return False
    try:
        with bind.begin_nested():
            bind.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_trgm"))
    except sa.exc.DBAPIError:
        return False
    return True


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql" or not _trigrams(bind):
        return
    for name, target in INDEXES.items():
        op.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {target}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
