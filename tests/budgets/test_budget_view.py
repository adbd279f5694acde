"""`GET /v1/{scope}s/{id}/budget` reads a budget, its leases and the holds on them as of one
moment: a lease another replica gives back between those reads is not shown as reserved."""

import uuid
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from sqlalchemy import event, insert, update

from metering import migrate
from metering.budgets.queries import current_budget
from metering.budgets.views import new_budget
from metering.db import Database, utcnow
from metering.models import Budget, BudgetLease, Team
from metering.money import usd_to_pico
from tests.budgets.conftest import fresh_pg  # noqa: F401

SLICE = usd_to_pico(Decimal("0.125"))


def _give_back(url: str, lease_id: str, team_id: str) -> None:
    """What another replica's `leases.give_back` commits: the lease deleted, its amount taken
    from the budget's `reserved`."""
    with psycopg.connect(url.replace("+asyncpg", "").replace("+psycopg", "")) as conn:
        conn.execute("SELECT 1 FROM budgets WHERE subject_id = %s FOR UPDATE", (team_id,))
        amount = conn.execute(
            "DELETE FROM budget_leases WHERE id = %s RETURNING amount", (lease_id,)
        ).fetchone()[0]
        conn.execute(
            "UPDATE budgets SET reserved = reserved - %s WHERE subject_id = %s", (amount, team_id)
        )


@pytest.mark.anyio
async def test_a_lease_given_back_between_the_reads_is_not_shown_reserved(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 2)
    try:
        now = utcnow()
        team_id = f"team_{uuid.uuid4().hex[:12]}"
        lease_id = f"lease_{uuid.uuid4().hex[:12]}"
        async with db.transaction() as session:
            session.add(Team(id=team_id, name=team_id, created_at=now))
            session.add(new_budget(team_id, "team", usd_to_pico(Decimal("1")), "never", now))
        async with db.begin() as conn:
            await conn.execute(
                insert(BudgetLease.__table__).values(
                    id=lease_id,
                    subject_id=team_id,
                    owner="replica-b",
                    amount=SLICE,
                    created_at=now,
                    expires_at=now + timedelta(hours=1),
                )
            )
            await conn.execute(
                update(Budget.__table__)
                .where(Budget.subject_id == team_id)
                .values(reserved=Budget.reserved + SLICE)
            )
        # A lease no request holds is free credit, not reserved.
        assert (await current_budget(db, "team", team_id)).reserved == 0

        returned: list[str] = []

        def between_reads(conn, cursor, statement, parameters, context, executemany):
            # The budget row has been read; the leases are read next.
            if "budget_leases" in statement and "sum(" in statement and not returned:
                returned.append(statement)
                _give_back(fresh_pg, lease_id, team_id)

        event.listen(db.engine.sync_engine, "before_cursor_execute", between_reads)
        try:
            shown = await current_budget(db, "team", team_id)
        finally:
            event.remove(db.engine.sync_engine, "before_cursor_execute", between_reads)
        assert len(returned) == 1  # the lease was given back exactly between the reads
        assert shown.reserved == 0
        assert (shown.spent, shown.remaining) == (0, usd_to_pico(Decimal("1")))
        # And the row itself now agrees.
        assert (await current_budget(db, "team", team_id)).reserved == 0
    finally:
        await db.dispose()
