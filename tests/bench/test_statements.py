"""`python -m bench.statements`: PostgreSQL's CPU for the hold INSERT and the settle statement,
whole and without some of its parts. Its figures are only worth something if each statement it
times is the one the proxy runs and really writes what that one writes."""

import asyncio
import re
import subprocess
import sys

import psycopg
import pytest

from bench import statements
from bench.run import postgres_database
from metering import migrate
from metering.budgets import settle_pg
from tests.conftest import PG_ADMIN_DSN

pytestmark = pytest.mark.postgres


def test_the_whole_variant_is_the_statement_the_proxy_runs():
    whole = statements.statement_of(statements.VARIANTS["whole"])
    assert whole.sql == settle_pg.STATEMENT.sql
    assert whole.names == settle_pg.STATEMENT.names
    # Each other variant leaves out what its name says, and only that.
    assert "crossed AS" not in statements.statement_of(statements.VARIANTS["no alert check"]).sql
    no_charge = statements.statement_of(statements.VARIANTS["no budget or lease charge"]).sql
    assert "UPDATE budgets" not in no_charge and "INSERT INTO ledger_events" in no_charge


@pytest.mark.e2e  # starts PostgreSQL databases of its own
def test_every_measured_group_writes_what_the_proxy_writes():
    with postgres_database(PG_ADMIN_DSN) as (_, url):
        migrate.upgrade(url)
        found = asyncio.run(statements.measure(url, [1, 3], 2))
        with psycopg.connect(url) as conn:
            events = conn.execute("SELECT count(*) FROM ledger_events").fetchone()[0]
            holds = conn.execute("SELECT count(*) FROM holds").fetchone()[0]
            pending = conn.execute("SELECT count(*) FROM rollup_pending").fetchone()[0]
            counted = conn.execute("SELECT sum(requests) FROM rollup_pending").fetchone()[0]
            spent = dict(conn.execute("SELECT scope, spent FROM budgets").fetchall())
            costs = conn.execute("SELECT sum(cost) FROM ledger_events").fetchone()[0]
            reserved_ok = conn.execute(
                "SELECT bool_and(b.reserved = l.amount) FROM budgets b "
                "JOIN budget_leases l ON l.subject_id = b.subject_id"
            ).fetchone()[0]
    # Every hold inserted was taken; per size, 12 groups (10 warm, 2 timed) per variant.
    assert holds == 0
    groups = {1: 12, 3: 12}
    with_events = [v for v, parts in statements.VARIANTS.items() if "events" in parts]
    with_pending = [v for v, parts in statements.VARIANTS.items() if "pending" in parts]
    requests = sum(size * count for size, count in groups.items())
    assert events == 1 + requests * len(with_events)  # the first request through the service
    assert counted == 1 + requests * len(with_pending)
    # A group's events share their key: one increment row each group (two for a group that
    # straddles an hour's start, at most one of the run's).
    statements_n = sum(groups.values())
    assert pending - (1 + statements_n * len(with_pending)) in (0, 1)
    # The variants that charge charged every budget what their events cost; the others did
    # not touch the budgets, and nothing reserved was lost (a lease's amount is its budget's).
    charging = [v for v in with_events if "charge" in statements.VARIANTS[v]]
    assert len(set(spent.values())) == 1  # token, user and team alike
    # Every event costs the same: spent is the first's and the charging variants' events'.
    assert spent["token"] * (1 + requests * len(with_events)) == costs * (
        1 + requests * len(charging)
    )
    assert reserved_ok
    assert set(found["groups"]) == {1, 3}
    for by_variant in found["groups"].values():
        assert set(by_variant) == set(statements.VARIANTS)
        assert all(held > 0 and settled > 0 for held, settled, _ in by_variant.values())
        assert all(wal > 0 for _, _, wal in by_variant.values())
    assert "| 3 |" in statements.report(found)


@pytest.mark.parametrize("ids", ["ordered", "random"])
@pytest.mark.e2e  # starts PostgreSQL databases of its own
def test_the_ledger_is_filled_first_with_ids_of_the_kind_asked(ids):
    with postgres_database(PG_ADMIN_DSN) as (_, url):
        migrate.upgrade(url)
        found = asyncio.run(statements.measure(url, [2], 1, ledger=500, ids=ids))
        with psycopg.connect(url) as conn:
            rows = conn.execute("SELECT id FROM ledger_events ORDER BY created_at, id").fetchall()
    made = [row[0] for row in rows]
    with_events = [v for v, parts in statements.VARIANTS.items() if "events" in parts]
    # The first request through the service, the 500 filled, then 11 groups of 2 per variant.
    assert len(made) == len(set(made)) == 1 + 500 + 11 * 2 * len(with_events)
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", m) for m in made)
    # The filled are copies of the first event (its created_at): the first 501. Time-ordered,
    # they all sort before the ids the run made after them; random ones do not.
    before, after = made[:501], made[501:]
    assert (max(before) < min(after)) == (ids == "ordered")
    assert (found["ledger"], found["ids"]) == (500, ids)
    assert f"Ids {ids}; 500 events filled in." in statements.report(found)


def test_bounds_on_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "bench.statements", "--groups", "0", "--pg", PG_ADMIN_DSN],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--groups" in out.stderr
