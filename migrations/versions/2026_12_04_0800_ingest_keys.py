"""team ingestion keys: credentials that report usage for one team's tokens, users and team

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ingest_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("team_id", sa.String(40), sa.ForeignKey("teams.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", metering.db.UTCDateTime(), nullable=False),
        sa.Column("revoked_at", metering.db.UTCDateTime(), nullable=True),
    )
    op.create_index("ix_ingest_keys_team_id", "ingest_keys", ["team_id"])


def downgrade() -> None:
    op.drop_index("ix_ingest_keys_team_id", table_name="ingest_keys")
    op.drop_table("ingest_keys")
