"""stored responses: the Responses API's stored responses (metering.responses.tables).

Revision ID: 0025
Revises: 0024
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("team_id", sa.String(40), nullable=False),
        sa.Column("user_id", sa.String(40), nullable=False),
        sa.Column("token_id", sa.String(40), nullable=True),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("previous_response_id", sa.String(40), nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("input_items", sa.Text(), nullable=False),
        sa.Column("response", sa.Text(), nullable=False),
    )
    op.create_index("ix_stored_responses_created_at", "stored_responses", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_created_at", "stored_responses")
    op.drop_table("stored_responses")
