"""attribution: the end user and the tags of every event (and of every hold, so that a hold
charged on expiry is attributed like its request)

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EVENTS = ("ledger_events", "ledger_events_archive")


def upgrade() -> None:
    for table in EVENTS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("end_user", sa.String(256), nullable=True))
            batch.add_column(sa.Column("tags", sa.Text(), nullable=False, server_default="{}"))
    with op.batch_alter_table("holds") as batch:
        batch.add_column(sa.Column("end_user", sa.String(256), nullable=True))
        batch.add_column(sa.Column("tags", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("holds") as batch:
        batch.drop_column("tags")
        batch.drop_column("end_user")
    for table in EVENTS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("tags")
            batch.drop_column("end_user")
