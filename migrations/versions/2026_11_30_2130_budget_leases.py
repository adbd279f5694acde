"""budget leases: slices of a budget's credit reserved by one serving process

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import metering.db

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCOPES = ("token", "user", "team")


def upgrade() -> None:
    op.create_table(
        "budget_leases",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("subject_id", sa.String(length=40), nullable=False),
        sa.Column("owner", sa.String(length=40), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("created_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", metering.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_leases")),
    )
    op.create_index(op.f("ix_budget_leases_subject_id"), "budget_leases", ["subject_id"])
    op.create_index(op.f("ix_budget_leases_expires_at"), "budget_leases", ["expires_at"])
    with op.batch_alter_table("holds") as batch:
        batch.add_column(
            sa.Column("leased", sa.Boolean(), server_default=sa.text("false"), nullable=False)
        )
        for scope in SCOPES:
            column = f"{scope}_lease"
            batch.add_column(sa.Column(column, sa.String(length=40), nullable=True))
            batch.create_foreign_key(
                op.f(f"fk_holds_{column}_budget_leases"), "budget_leases", [column], ["id"]
            )
            batch.create_index(op.f(f"ix_holds_{column}"), [column])


def downgrade() -> None:
    with op.batch_alter_table("holds") as batch:
        for scope in SCOPES:
            column = f"{scope}_lease"
            batch.drop_index(op.f(f"ix_holds_{column}"))
            batch.drop_constraint(op.f(f"fk_holds_{column}_budget_leases"), type_="foreignkey")
            batch.drop_column(column)
        batch.drop_column("leased")
    op.drop_table("budget_leases")
