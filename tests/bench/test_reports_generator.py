"""The reports bench's ledger generator: events past 3.5 million get their instants (the product
of an event's number and the span overflowed bigint), and each event's owner, route and cost."""

import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from bench.reports import SPAN, insert_sql, routes
from metering import migrate
from tests.conftest import PG_ADMIN_DSN

pytestmark = pytest.mark.postgres

ORG = {"tokens": 1000, "users": 500, "teams": 50, "models": 20, "end_users": 100_000}


@pytest.fixture
def url():
    name = f"metering_test_gen_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.e2e  # starts a PostgreSQL database of its own (`url`)
def test_the_last_events_of_ten_million(url):
    migrate.upgrade(url)
    n = 10_000_000
    end = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    span_us = int(SPAN.total_seconds()) * 10**6
    with psycopg.connect(url) as conn:
        sql = insert_sql(conn, ORG)
        conn.execute(sql, {"lo": n - 2, "hi": n, "n": n, "end": end, "span_us": span_us})
        rows = conn.execute(
            "SELECT id, created_at, token_id, user_id, team_id, model, prompt_tokens,"
            " cached_tokens, completion_tokens, cost FROM ledger_events ORDER BY id"
        ).fetchall()
    route_of = {i: r for i, r in enumerate(routes(ORG["models"]), 1)}
    assert [row[0] for row in rows] == ["evt_0009999998", "evt_0009999999", "evt_0010000000"]
    for g, (_, at, token, user, team, model, prompt, cached, completion, cost) in zip(
        range(n - 2, n + 1), rows, strict=True
    ):
        # The span divided into n steps: (g - 1) * span / n microseconds before the end.
        assert at == end - timedelta(microseconds=(g - 1) * span_us // n + 1)
        tok = g % 1000
        assert (token, user, team) == (f"tok_{tok}", f"usr_{tok % 500}", f"team_{tok % 500 % 50}")
        name, _, _, input_price, cached_price, output_price = route_of[1 + (g // 7) % 20]
        assert model == name
        assert prompt == 100 + (g * 7919) % 4000
        assert cached == (((g * 7919) % 4000) // 2 if g % 5 == 0 else 0)
        assert completion == 20 + (g * 104729) % 1500
        assert cost == (prompt - cached) * input_price + cached * cached_price + (
            completion * output_price
        )
    # The oldest event lies inside the span: one step less a microsecond after its start.
    assert rows[-1][1] == end - SPAN + timedelta(microseconds=span_us // n - 1)
