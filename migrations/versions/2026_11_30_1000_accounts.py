"""accounts: login sessions (refresh-token chains), refresh tokens, login throttling

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "auth_sessions",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("user_id", sa.String(length=40), nullable=False),
        sa.Column("password_stamp", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("refreshed_at", metering.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", metering.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("revoked_reason", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_auth_sessions_user_id_users")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_auth_sessions")),
    )
    with op.batch_alter_table("auth_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_auth_sessions_user_id"), ["user_id"], unique=False)

    op.create_table(
        "refresh_tokens",
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=40), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("spent_at", metering.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["auth_sessions.id"],
            name=op.f("fk_refresh_tokens_session_id_auth_sessions"),
        ),
        sa.PrimaryKeyConstraint("token_hash", name=op.f("pk_refresh_tokens")),
    )
    with op.batch_alter_table("refresh_tokens", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_refresh_tokens_session_id"), ["session_id"], unique=False
        )

    op.create_table(
        "login_throttles",
        sa.Column("email_hash", sa.String(length=64), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failure_at", metering.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("locked_until", metering.db.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("email_hash", name=op.f("pk_login_throttles")),
    )
    with op.batch_alter_table("login_throttles", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_login_throttles_last_failure_at"), ["last_failure_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("login_throttles", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_login_throttles_last_failure_at"))

    op.drop_table("login_throttles")
    with op.batch_alter_table("refresh_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_refresh_tokens_session_id"))

    op.drop_table("refresh_tokens")
    with op.batch_alter_table("auth_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_auth_sessions_user_id"))

    op.drop_table("auth_sessions")
