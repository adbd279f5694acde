"""usage checks: usage_anomaly and uncharged on ledger events (and their archive), uncharged
in the hourly rollup

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEDGER_TABLES = ("ledger_events", "ledger_events_archive")


def upgrade() -> None:
    for table in LEDGER_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("usage_anomaly", sa.String(length=40), nullable=True))
            batch_op.add_column(
                sa.Column("uncharged", sa.BigInteger(), nullable=False, server_default="0")
            )
    with op.batch_alter_table("spend_hourly", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("uncharged", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("spend_hourly", schema=None) as batch_op:
        batch_op.drop_column("uncharged")
    for table in LEDGER_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("uncharged")
            batch_op.drop_column("usage_anomaly")
