"""A large report never stalls the proxy: while GET /v1/spend builds and sends a report of
100,000 rows, a proxied chat completion started after it finishes before it."""

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import create_engine, pool, text

from bench.rollups import derive_statement
from metering.db import sync_url
from metering.ledger.rollup import ROLLUPS
from metering.ledger.tables import SpendHourly

hourly = SpendHourly.__table__

TOKENS, HOURS = 100, 1000  # 100,000 rollup rows: the report by token and hour has as many


# The hourly rows, made by the database itself (one INSERT ... SELECT over a generated grid of
# tokens and hours: a hundred thousand rows built in Python took most of the module's time).
HOURLY = {
    "postgresql": """
INSERT INTO spend_hourly (hour, team_id, user_id, token_id, model, provider, requests,
    prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost, uncharged,
    adjustments)
SELECT CAST(:first AS timestamptz) + h * interval '1 hour', :team, :user,
    'tok_stall_' || lpad(t::text, 3, '0'), 'gpt-sim', 'sim-openai', 1, 100 + h, 0, 10 + t, 0,
    21000000, 0, 0
FROM generate_series(0, :tokens - 1) AS t, generate_series(0, :hours - 1) AS h""",
    "sqlite": """
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < :hours - 1)
INSERT INTO spend_hourly (hour, team_id, user_id, token_id, model, provider, requests,
    prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost, uncharged,
    adjustments)
SELECT strftime('%Y-%m-%d %H:%M:%S.000000', :first, '+' || h.i || ' hours'), :team, :user,
    'tok_stall_' || printf('%03d', t.i), 'gpt-sim', 'sim-openai', 1, 100 + h.i, 0, 10 + t.i,
    0, 21000000, 0, 0
FROM n AS t, n AS h WHERE t.i < :tokens""",
}


@pytest.fixture(scope="module")
def large_report(api):
    """A team of its own with 100,000 hourly rollup rows (one per token and hour) and the
    coarser rollups' rows, as settle would have left them; returns the report's parameters."""
    team, user, _ = api.principal()
    first = datetime(2024, 1, 1, tzinfo=UTC) + timedelta(hours=uuid.uuid4().int % 5000)
    dialect = api.backend
    engine = create_engine(sync_url(api.settings.database_url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(HOURLY[dialect]),
                {
                    "first": first if dialect == "postgresql" else f"{first:%Y-%m-%d %H:%M:%S}",
                    "team": team["id"],
                    "user": user["id"],
                    "tokens": TOKENS,
                    "hours": HOURS,
                },
            )
            for rollup in ROLLUPS[1:]:  # the coarser ones, summed from the hourly rows
                conn.execute(derive_statement(rollup, dialect, hourly.c.team_id == team["id"]))
    finally:
        engine.dispose()
    return {
        "team_id": team["id"],
        "group_by": "token,hour",
        "start": first.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "end": (first + timedelta(hours=HOURS)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "limit": TOKENS * HOURS,
    }


def race(api, large_report, fmt: str, token: str) -> tuple[list[str], dict, httpx.Response]:
    """Start the report, and once its first bytes are in, a completion: which finished first."""
    finished: list[str] = []
    report_started = threading.Event()
    report: dict = {}

    def read_report() -> None:
        params = {**large_report, "format": fmt}
        headers = {"authorization": f"Bearer {api.settings.admin_key}"}
        with httpx.stream(
            "GET", f"{api.url}/v1/spend", params=params, headers=headers, timeout=120
        ) as response:
            report["status"] = response.status_code
            chunks = []
            for chunk in response.iter_bytes():
                report_started.set()
                chunks.append(chunk)
        finished.append("report")
        report["body"] = b"".join(chunks)
        report_started.set()

    reader = threading.Thread(target=read_report)
    reader.start()
    # The report is running: its first bytes (the totals and paging fields) have arrived.
    assert report_started.wait(120)
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {token}"},
        json={"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=3"}]},
        timeout=120,
    )
    finished.append("completion")
    reader.join(120)
    return finished, report, response


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_a_completion_finishes_while_a_large_report_is_still_being_sent(api, large_report, fmt):
    _, _, token = api.principal()
    # A report built in one piece on the event loop is whole before its first byte is sent, so
    # the completion can never finish first; a streamed one leaves room for it. On a busy machine
    # one try can still lose the race by chance: three tries, one must show the room.
    orders = []
    for _ in range(3):
        finished, report, response = race(api, large_report, fmt, token["token"])
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        assert report["status"] == 200
        orders.append(finished)
        if finished == ["completion", "report"]:
            break
    assert ["completion", "report"] in orders, orders
    # And the report is whole.
    if fmt == "json":
        body = json.loads(report["body"])
        assert (body["row_count"], len(body["rows"]), body["next_page"]) == (100_000, 100_000, None)
        assert body["total"]["requests"] == 100_000
        first = {
            "token_id": "tok_stall_000",
            "hour": large_report["start"],
            "requests": 1,
            "prompt_tokens": 100,
            "cached_tokens": 0,
            "completion_tokens": 10,
            "reasoning_tokens": 0,
            "cost": "0.000021",
        }
        assert {key: body["rows"][0][key] for key in first} == first
    else:
        lines = report["body"].decode().splitlines()
        assert len(lines) == 100_001


def test_a_report_one_hour_longer_could_hold_more_than_100000_rows_and_is_400(api, large_report):
    """100 tokens over 1,000 hours is the largest report there may be; an hour more and the
    bound (hours x the tokens the team's daily rollup holds) passes the limit."""
    end = datetime.fromisoformat(large_report["end"]) + timedelta(hours=1)
    params = {**large_report, "end": end.strftime("%Y-%m-%dT%H:%M:%SZ"), "limit": 10}
    response = api.request("GET", "/v1/spend", params=params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("report_too_large", "group_by")
    assert error["message"].startswith(
        "this report could hold up to 100,100 rows (1,001 hours x 100 tokens); a report holds "
        "at most 100,000:"
    )
