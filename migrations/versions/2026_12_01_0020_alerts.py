"""alerts: budget thresholds and soft limits, the alert outbox, webhooks and their deliveries

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _time(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, metering.db.UTCDateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    with op.batch_alter_table("budgets") as batch:
        batch.add_column(sa.Column("alert_thresholds", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("soft_limit", sa.BigInteger(), nullable=True))
    op.create_table(
        "alert_events",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("type", sa.String(length=40), nullable=False),
        _time("created_at"),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("subject_id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=True),
        sa.Column("user_id", sa.String(length=40), nullable=True),
        sa.Column("dedupe_key", sa.String(length=200), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
        sa.Column("dispatched", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_events")),
        sa.UniqueConstraint("dedupe_key", name=op.f("uq_alert_events_dedupe_key")),
    )
    op.create_index("ix_alert_events_created", "alert_events", ["created_at", "id"])
    op.create_index("ix_alert_events_dispatched", "alert_events", ["dispatched", "created_at"])
    op.create_index(op.f("ix_alert_events_user_id"), "alert_events", ["user_id"])
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.Text(), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=True),
        sa.Column("secret", sa.String(length=200), nullable=False),
        _time("created_at"),
        _time("deleted_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhooks")),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("webhook_id", sa.String(length=40), nullable=False),
        sa.Column("event_id", sa.String(length=40), nullable=False),
        sa.Column("status", sa.String(length=12), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _time("created_at"),
        _time("next_attempt_at", nullable=True),
        _time("claimed_until", nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.String(length=300), nullable=True),
        _time("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "uq_webhook_deliveries_pair", "webhook_deliveries", ["webhook_id", "event_id"], unique=True
    )
    op.create_index(
        "ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"]
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("delivery_id", sa.String(length=40), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        _time("at"),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.String(length=300), nullable=True),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("delivery_id", "attempt", name=op.f("pk_webhook_attempts")),
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_index("uq_webhook_deliveries_pair", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
    op.drop_index(op.f("ix_alert_events_user_id"), table_name="alert_events")
    op.drop_index("ix_alert_events_dispatched", table_name="alert_events")
    op.drop_index("ix_alert_events_created", table_name="alert_events")
    op.drop_table("alert_events")
    with op.batch_alter_table("budgets") as batch:
        batch.drop_column("soft_limit")
        batch.drop_column("alert_thresholds")
