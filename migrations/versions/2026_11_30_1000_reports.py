"""reports: the hourly spend rollup (backfilled from the ledger), the ledger archive,
reconciliations

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The UTC hour of created_at, as each backend stores a UTCDateTime.
HOUR = {
    "postgresql": "date_trunc('hour', created_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'",
    "sqlite": "strftime('%Y-%m-%d %H:00:00.000000', created_at)",
}


def _ledger_columns() -> list[sa.Column]:
    return [
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("started_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("token_id", sa.String(length=40), nullable=True),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("provider", sa.String(length=100), nullable=False),
        sa.Column("upstream_model", sa.String(length=200), nullable=False),
        sa.Column("upstream_id", sa.String(length=200), nullable=True),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("finish_reason", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("total_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("text_tokens", sa.BigInteger(), nullable=True),
        sa.Column("reasoning_tokens", sa.BigInteger(), nullable=True),
        sa.Column("audio_tokens", sa.BigInteger(), nullable=True),
        sa.Column("image_tokens", sa.BigInteger(), nullable=True),
        sa.Column("video_tokens", sa.BigInteger(), nullable=True),
        sa.Column("accepted_prediction_tokens", sa.BigInteger(), nullable=True),
        sa.Column("rejected_prediction_tokens", sa.BigInteger(), nullable=True),
        sa.Column("usage_source", sa.String(length=16), nullable=False),
        sa.Column("input_price", sa.BigInteger(), nullable=False),
        sa.Column("cached_price", sa.BigInteger(), nullable=False),
        sa.Column("output_price", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.BigInteger(), nullable=False),
        sa.Column("ttft_ms", sa.Integer(), nullable=True),
        sa.Column("latency_ms", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "spend_hourly",
        sa.Column("hour", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("token_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("provider", sa.String(length=100), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "hour",
            "team_id",
            "user_id",
            "token_id",
            "model",
            "provider",
            name=op.f("pk_spend_hourly"),
        ),
    )
    with op.batch_alter_table("spend_hourly", schema=None) as batch_op:
        batch_op.create_index("ix_spend_hourly_token_hour", ["token_id", "hour"], unique=False)
        batch_op.create_index("ix_spend_hourly_user_hour", ["user_id", "hour"], unique=False)

    # Events recorded before this revision: the rollup starts equal to the ledger.
    hour = HOUR[op.get_bind().dialect.name]
    op.execute(
        f"""
        INSERT INTO spend_hourly (hour, team_id, user_id, token_id, model, provider, requests,
            prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost)
        SELECT {hour}, team_id, user_id, COALESCE(token_id, ''), model, provider, COUNT(*),
            SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens),
            SUM(COALESCE(reasoning_tokens, 0)), SUM(cost)
        FROM ledger_events
        GROUP BY {hour}, team_id, user_id, COALESCE(token_id, ''), model, provider
        """
    )

    op.create_table(
        "ledger_events_archive",
        *_ledger_columns(),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_events_archive")),
    )
    with op.batch_alter_table("ledger_events_archive", schema=None) as batch_op:
        batch_op.create_index(
            "ix_ledger_events_archive_created", ["created_at", "id"], unique=False
        )

    op.create_table(
        "reconciliations",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("provider", sa.String(length=100), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("tolerance", sa.String(length=32), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconciliations")),
    )


def downgrade() -> None:
    op.drop_table("reconciliations")
    with op.batch_alter_table("ledger_events_archive", schema=None) as batch_op:
        batch_op.drop_index("ix_ledger_events_archive_created")

    op.drop_table("ledger_events_archive")
    with op.batch_alter_table("spend_hourly", schema=None) as batch_op:
        batch_op.drop_index("ix_spend_hourly_user_hour")
        batch_op.drop_index("ix_spend_hourly_token_hour")

    op.drop_table("spend_hourly")
