"""team names unique among live teams (without case): a unique index; earlier duplicates renamed

Revision ID: 0013
Revises: 0012
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A live team whose name an older live team already has (without case) keeps its name with its
# id appended, so the index can be made and nothing is lost; the oldest keeps the plain name.
RENAME_LATER_DUPLICATES = """
UPDATE teams SET name = substr(name, 1, 150) || ' (' || id || ')'
WHERE deleted_at IS NULL AND EXISTS (
    SELECT 1 FROM teams AS older
    WHERE older.deleted_at IS NULL AND lower(older.name) = lower(teams.name)
      AND (older.created_at < teams.created_at
           OR (older.created_at = teams.created_at AND older.id < teams.id))
)
"""


def upgrade() -> None:
    op.execute(RENAME_LATER_DUPLICATES)
    op.create_index(
        "uq_teams_name_live",
        "teams",
        [sa.text("lower(name)")],
        unique=True,
        sqlite_where=sa.text("deleted_at IS NULL"),
        postgresql_where=sa.text("deleted_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_teams_name_live", table_name="teams")
