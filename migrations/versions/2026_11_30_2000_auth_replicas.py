"""auth replicas: each serving process's heartbeat and the last credential change it applied

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "auth_replicas",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("heartbeat_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("acked_seq", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_auth_replicas")),
    )


def downgrade() -> None:
    op.drop_table("auth_replicas")
