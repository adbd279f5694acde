"""refusals: requests refused before anything was reserved (402, 429, 403), and the
max_tokens a ledger event was clamped to

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEDGER_TABLES = ("ledger_events", "ledger_events_archive")


def upgrade() -> None:
    for table in LEDGER_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("max_tokens_clamped", sa.BigInteger(), nullable=True))
    op.create_table(
        "refusals",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("token_id", sa.String(length=40), nullable=True),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("team_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("subject_id", sa.String(length=40), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("code", sa.String(length=40), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_refusals")),
    )
    with op.batch_alter_table("refusals") as batch:
        batch.create_index("ix_refusals_created", ["created_at", "id"], unique=False)
        batch.create_index("ix_refusals_user_created", ["user_id", "created_at"], unique=False)
        batch.create_index("ix_refusals_team_created", ["team_id", "created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("refusals") as batch:
        batch.drop_index("ix_refusals_team_created")
        batch.drop_index("ix_refusals_user_created")
        batch.drop_index("ix_refusals_created")
    op.drop_table("refusals")
    for table in LEDGER_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("max_tokens_clamped")
