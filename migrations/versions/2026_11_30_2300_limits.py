"""limits beyond credit: rate and parallel limits, model allow-lists, their counters

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SUBJECTS = ("teams", "users", "api_tokens")


def upgrade() -> None:
    for table in SUBJECTS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("rpm_limit", sa.Integer(), nullable=True))
            batch.add_column(sa.Column("tpm_limit", sa.BigInteger(), nullable=True))
            batch.add_column(sa.Column("max_parallel_requests", sa.Integer(), nullable=True))
            batch.add_column(sa.Column("allowed_models", sa.Text(), nullable=True))
    with op.batch_alter_table("holds") as batch:
        batch.add_column(sa.Column("rate_kinds", sa.String(length=16), nullable=True))
        batch.add_column(
            sa.Column("rate_window", metering.db.UTCDateTime(timezone=True), nullable=True)
        )
        batch.add_column(sa.Column("rate_tokens", sa.BigInteger(), nullable=True))
    op.create_table(
        "rate_counters",
        sa.Column("subject_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("window_start", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("used", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("subject_id", "kind", name=op.f("pk_rate_counters")),
    )


def downgrade() -> None:
    op.drop_table("rate_counters")
    with op.batch_alter_table("holds") as batch:
        batch.drop_column("rate_tokens")
        batch.drop_column("rate_window")
        batch.drop_column("rate_kinds")
    for table in SUBJECTS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("allowed_models")
            batch.drop_column("max_parallel_requests")
            batch.drop_column("tpm_limit")
            batch.drop_column("rpm_limit")
