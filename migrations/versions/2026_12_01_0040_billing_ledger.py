"""billing-grade ledger: adjustment events, ingested usage's idempotency keys, run budgets

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEDGERS = ("ledger_events", "ledger_events_archive")
ROLLUPS = (
    "spend_hourly",
    "spend_hourly_token",
    "spend_hourly_model",
    "spend_daily",
    "spend_daily_token",
    "spend_daily_model",
)


def upgrade() -> None:
    for table in LEDGERS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("kind", sa.String(length=16), nullable=False, server_default="usage")
            )
            batch.add_column(sa.Column("corrects_event_id", sa.String(length=40), nullable=True))
            batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
            batch.add_column(sa.Column("run_id", sa.String(length=100), nullable=True))
    op.create_index("ix_ledger_events_corrects", "ledger_events", ["corrects_event_id"])
    for table in ROLLUPS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column("adjustments", sa.BigInteger(), nullable=False, server_default="0")
            )
    with op.batch_alter_table("holds") as batch:
        batch.add_column(sa.Column("run_id", sa.String(length=100), nullable=True))
    op.create_table(
        "ingested_keys",
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=False),
        sa.Column("event_id", sa.String(length=40), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("team_id", "idempotency_key", name=op.f("pk_ingested_keys")),
    )
    op.create_table(
        "runs",
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("credit_limit", sa.BigInteger(), nullable=False),
        sa.Column("spent", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("team_id", "id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_last_used_at"), "runs", ["last_used_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_runs_last_used_at"), table_name="runs")
    op.drop_table("runs")
    op.drop_table("ingested_keys")
    with op.batch_alter_table("holds") as batch:
        batch.drop_column("run_id")
    for table in ROLLUPS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("adjustments")
    op.drop_index("ix_ledger_events_corrects", table_name="ledger_events")
    for table in LEDGERS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("run_id")
            batch.drop_column("reason")
            batch.drop_column("corrects_event_id")
            batch.drop_column("kind")
