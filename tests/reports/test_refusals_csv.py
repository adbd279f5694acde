"""GET /v1/refusals?format=csv without a limit streams every matching refusal, read in pages:
each page starts after the last row of the one before, so rows that share a timestamp are
neither lost nor repeated at a page's edge (both backends)."""

import csv
import io
from datetime import timedelta

import pytest

from metering.auth.service import Principal
from metering.db import Database, utcnow
from metering.models import Refusal
from metering.reports import refusals
from tests.budgets.conftest import fresh_db, fresh_pg, fresh_sqlite  # noqa: F401 - fixtures


def _refusal(i: int, at, user: str) -> Refusal:
    return Refusal(
        id=f"req_{i:04d}",
        created_at=at,
        token_id="tok_csv",
        user_id=user,
        team_id="team_csv",
        model="gpt-sim",
        reason="budget",
        scope="token",
        subject_id="tok_csv",
        http_status=402,
        code="budget_exceeded",
        message=f"refused {i}, with a comma",
    )


@pytest.mark.anyio
async def test_the_csv_streams_every_refusal_across_pages(fresh_db):  # noqa: F811
    db = Database(fresh_db, 2)
    try:
        base = utcnow().replace(microsecond=0) - timedelta(hours=1)
        # 23 refusals over 8 instants (three share each), and two of another user.
        rows = [_refusal(i, base + timedelta(seconds=i // 3), "user_a") for i in range(23)]
        rows += [_refusal(100 + i, base, "user_b") for i in range(2)]
        async with db.transaction() as session:
            session.add_all(rows)
        admin = Principal("admin")
        query = refusals.refusals_query(admin, start=None, end=None, filters={})
        chunks = [c async for c in refusals.csv_stream(db, query, labels=False, batch=4)]
        # The header, then one chunk per page of 4: 25 rows are 7 pages.
        assert len(chunks) == 1 + 7
        lines = list(csv.DictReader(io.StringIO(b"".join(chunks).decode())))
        assert list(lines[0]) == list(refusals.COLUMNS)
        expected = sorted(rows, key=lambda r: (r.created_at, r.id), reverse=True)
        assert [line["id"] for line in lines] == [r.id for r in expected]
        assert lines[0]["message"] == "refused 22, with a comma"
        # A user's credential streams its own refusals only.
        own = Principal("access", user_id="user_b", team_id="team_csv")
        query = refusals.refusals_query(own, start=None, end=None, filters={})
        chunks = [c async for c in refusals.csv_stream(db, query, labels=False, batch=1)]
        mine = list(csv.DictReader(io.StringIO(b"".join(chunks).decode())))
        assert [line["id"] for line in mine] == ["req_0101", "req_0100"]
        # Nothing matching: the header alone.
        query = refusals.refusals_query(admin, start=None, end=None, filters={"model": "x"})
        chunks = [c async for c in refusals.csv_stream(db, query, labels=False)]
        assert b"".join(chunks).decode().splitlines() == [",".join(refusals.COLUMNS)]
    finally:
        await db.dispose()
