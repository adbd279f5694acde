"""metering_abort(reason): raises, for a statement that must not commit what it has written

The one-statement settle of a group (metering.budgets.settle_pg) runs without BEGIN and
COMMIT; when its charges pass an alert threshold it calls this function, which raises SQLSTATE
MT001, so nothing of the statement is kept and the group is written by the general path (which
records the alert in the charge's transaction). PostgreSQL only: SQLite has no such statement.

Revision ID: 0014
Revises: 0013
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CREATE = """
CREATE OR REPLACE FUNCTION metering_abort(reason text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  RAISE EXCEPTION USING MESSAGE = reason, ERRCODE = 'MT001';
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS metering_abort(text)")
