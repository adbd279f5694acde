"""catalog prices

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("provider", sa.String(length=100), nullable=False),
        sa.Column("upstream_model", sa.String(length=200), nullable=False),
        sa.Column("input_price", sa.BigInteger(), nullable=False),
        sa.Column("cached_price", sa.BigInteger(), nullable=False),
        sa.Column("output_price", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_prices")),
    )
    op.create_index(
        "ix_prices_model_provider", "prices", ["model", "provider", "effective_from"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_prices_model_provider", table_name="prices")
    op.drop_table("prices")
