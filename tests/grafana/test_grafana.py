"""The Grafana dashboards: every panel's SQL, with Grafana's macros and the team variable
expanded as Grafana expands them, runs on the migrated PostgreSQL schema as the read-only role of
dashboards/postgres/grafana-reader.sql, over the demo traffic, and agrees with the API."""

import json
import os
import re
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
import yaml

from tests.conftest import direct
from tests.demo_site import ADMIN_KEY

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "dashboards" / "grafana"
READER_SQL = ROOT / "dashboards" / "postgres" / "grafana-reader.sql"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PANELS = {
    panel["title"]: panel for path in DASHBOARDS for panel in json.loads(path.read_text())["panels"]
}
# The columns each panel's first query answers with, in order.
COLUMNS = {
    "Spend": ["spend_usd"],
    "Requests": ["requests"],
    "Tokens": ["prompt_tokens", "completion_tokens"],
    "Failed requests": ["failed", "requests"],
    "Spend over time by team": ["time", "metric", "spend_usd"],
    "Spend over time by model": ["time", "metric", "spend_usd"],
    "Spend over time by provider": ["time", "metric", "spend_usd"],
    "Budget use": [
        "scope",
        "name",
        "spent_usd",
        "reserved_usd",
        "limit_usd",
        "used_percent",
        "reset_interval",
        "resets_at",
        "id",
    ],
    "Top tokens by spend": ["token", "spend_usd"],
    "Top end users by spend": ["end_user", "spend_usd"],
    "Spend by endpoint": ["endpoint", "requests", "spend_usd"],
    "Tokens by kind": ["model", "prompt", "cached", "completion", "reasoning"],
    "Upstream latency": ["time", "metric", "p50_ms", "p95_ms"],
    "Recent requests": [
        "time",
        "team",
        "user",
        "token",
        "model",
        "provider",
        "stream",
        "status",
        "http_status",
        "usage_source",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "reasoning_tokens",
        "cost_usd",
        "ttft_ms",
        "latency_ms",
        "id",
    ],
}
MACRO = re.compile(r"\$(__[A-Za-z]+)\(([^)]*)\)")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

pytestmark = pytest.mark.postgres


def expand(sql: str, start: datetime, end: datetime, teams: list[str] | None, interval="1h"):
    """The SQL Grafana sends for a range, $__interval and $team (None: All), expanded the way
    Grafana's PostgreSQL macro engine expands it."""
    sql = sql.replace("$__interval", interval)
    all_value = "'__all'"
    sql = sql.replace("$team", ",".join(f"'{t}'" for t in teams) if teams else all_value)
    frm, to = (t.astimezone(UTC).isoformat().replace("+00:00", "Z") for t in (start, end))

    def macro(match: re.Match) -> str:
        name, args = match.group(1), [a.strip() for a in match.group(2).split(",")]
        if name == "__timeFilter":
            return f"{args[0]} BETWEEN '{frm}' AND '{to}'"
        if name == "__timeFrom":
            return f"'{frm}'"
        if name == "__timeTo":
            return f"'{to}'"
        if name in ("__timeGroup", "__timeGroupAlias"):
            text = args[1].strip("'")
            seconds = int(text[:-1]) * UNITS[text[-1]]
            group = f"floor(extract(epoch from {args[0]})/{seconds})*{seconds}"
            return group + (' AS "time"' if name == "__timeGroupAlias" else "")
        raise AssertionError(f"a macro this test does not know: {name}")

    expanded = MACRO.sub(macro, sql)
    assert "$" not in expanded, expanded
    return expanded


@pytest.fixture(scope="module")
def reader(pg_site):
    """The read-only role, made by the very script docker-compose runs (psql), on the site's
    database; dropped afterwards (roles belong to the whole server)."""
    role = f"grafana_reader_{uuid.uuid4().hex[:8]}"
    url = pg_site.database_url
    env = {**os.environ, "GRAFANA_DB_USER": role, "GRAFANA_DB_PASSWORD": uuid.uuid4().hex}
    for _ in range(2):  # a second run changes nothing and does not fail
        done = subprocess.run(
            ["psql", url, "-q", "-f", str(READER_SQL)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    yield role
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def query(pg_site, reader):
    """Runs SQL as the reader; answers (column names, rows)."""
    # The server itself: a session's role, through a pooler, would be the service's next.
    with psycopg.connect(direct(pg_site.database_url), autocommit=True) as conn:
        conn.execute(f'SET ROLE "{reader}"')

        def run(sql: str) -> tuple[list[str], list[tuple]]:
            cursor = conn.execute(sql)
            return [c.name for c in cursor.description], cursor.fetchall()

        yield run


def window() -> tuple[datetime, datetime]:
    end = datetime.now(UTC) + timedelta(minutes=1)
    return end - timedelta(hours=24), end


def test_the_dashboards_have_every_panel():
    assert DASHBOARDS, "no dashboard JSON under dashboards/grafana/dashboards"
    assert sorted(PANELS) == sorted(COLUMNS)


@pytest.mark.parametrize("title", sorted(COLUMNS))
@pytest.mark.parametrize("teams", ["all", "one"])
def test_each_panel_runs_as_the_reader_with_its_columns(query, pg_site, title, teams):
    # The demo's end users are the helpdesk's customers, in demo-support.
    one = "demo-support" if title == "Top end users by spend" else "demo-platform"
    chosen = None if teams == "all" else [team_id(pg_site, one)]
    for target in PANELS[title]["targets"]:
        columns, rows = query(expand(target["rawSql"], *window(), chosen))
        if target["refId"] == "A":
            assert columns == COLUMNS[title]
        assert rows, f"{title} ({target['refId']}) has no rows"
        if target["format"] == "time_series":
            assert columns[0] == "time" and [r[0] for r in rows] == sorted(r[0] for r in rows)


def team_id(site, name: str) -> str:
    return next(t["id"] for t in site.get("/v1/teams")["data"] if t["name"] == name)


def money(value) -> Decimal:
    return Decimal(value).normalize()


def test_spend_panels_agree_with_the_api(query, pg_site):
    start, end = window()
    api = pg_site.get("/v1/spend", start=start.isoformat(), group_by="team")
    names = {t["id"]: t["name"] for t in pg_site.get("/v1/teams")["data"]}
    expected = {names[r["team_id"]]: money(r["cost"]) for r in api["rows"]}
    _, rows = query(
        expand(PANELS["Spend over time by team"]["targets"][0]["rawSql"], start, end, None)
    )
    drawn: dict = {}
    for _, team, cost in rows:
        drawn[team] = drawn.get(team, 0) + cost
    assert {k: money(v) for k, v in drawn.items()} == expected
    _, [(total,)] = query(expand(PANELS["Spend"]["targets"][0]["rawSql"], start, end, None))
    assert money(total) == money(api["total"]["cost"])
    platform = team_id(pg_site, "demo-platform")
    _, [(one,)] = query(expand(PANELS["Spend"]["targets"][0]["rawSql"], start, end, [platform]))
    assert money(one) == expected["demo-platform"]


def test_token_kinds_and_top_tokens_agree_with_the_api(query, pg_site):
    start, end = window()
    by_model = pg_site.get("/v1/spend", start=start.isoformat(), group_by="model")["rows"]
    _, rows = query(expand(PANELS["Tokens by kind"]["targets"][0]["rawSql"], start, end, None))
    assert rows == [
        (
            r["model"],
            r["prompt_tokens"] - r["cached_tokens"],
            r["cached_tokens"],
            r["completion_tokens"] - r["reasoning_tokens"],
            r["reasoning_tokens"],
        )
        for r in by_model
    ]
    by_token = pg_site.get("/v1/spend", start=start.isoformat(), group_by="token")["rows"]
    top = sorted((money(r["cost"]) for r in by_token), reverse=True)[:10]
    _, rows = query(expand(PANELS["Top tokens by spend"]["targets"][0]["rawSql"], start, end, None))
    assert [money(cost) for _, cost in rows] == top
    assert rows[0][0].startswith("notebook (alice@demo.example)")


def test_top_end_users_agree_with_the_api_over_whole_days(query, pg_site):
    """The demo's helpdesk names its customers: the panel is /v1/spend by end user over the
    UTC days the range touches, largest first, without the requests that named none."""
    start, end = window()
    day = start.replace(hour=0, minute=0, second=0, microsecond=0)
    sql = PANELS["Top end users by spend"]["targets"][0]["rawSql"]
    support = team_id(pg_site, "demo-support")
    for teams, params in ((None, {}), ([support], {"team_id": support})):
        rows = pg_site.get("/v1/spend", start=day.isoformat(), group_by="end_user", **params)[
            "rows"
        ]
        expected = sorted(
            ((r["end_user"], money(r["cost"])) for r in rows if r["end_user"] is not None),
            key=lambda pair: (-pair[1], pair[0]),
        )[:20]
        _, drawn = query(expand(sql, start, end, teams))
        assert [(name, money(cost)) for name, cost in drawn] == expected
        # (Other tests of the session may add end users of their own teams.)
        names = {name for name, _ in drawn}
        assert names == {"cust-ada", "cust-ben", "cust-cy"} if teams else names >= {"cust-ada"}
    other = team_id(pg_site, "demo-platform")
    assert query(expand(sql, start, end, [other]))[1] == []


def test_prometheus_has_no_series_per_end_user(pg_site):
    """End users are unbounded: no metric names one, even behind the metrics key."""
    names = {e["end_user"] for e in pg_site.get("/v1/usage", limit=1000)["data"]} - {None}
    assert names >= {"cust-ada", "cust-ben", "cust-cy"}
    text = pg_site.http.get("/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    labels = set()
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" in line:
            body = line[line.index("{") + 1 : line.rindex("}")]
            labels |= {pair.split("=", 1)[0] for pair in re.findall(r'\w+="[^"]*"', body)}
            values = set(re.findall(r'="([^"]*)"', body))
            assert not values & names, line
    assert labels and not labels & {"end_user", "tag", "tags"}


def test_budget_use_agrees_with_the_budget_api(query, pg_site):
    _, rows = query(expand(PANELS["Budget use"]["targets"][0]["rawSql"], *window(), None))
    assert {r[0] for r in rows} == {"team", "user", "token"}
    for scope, _, spent, reserved, limit, used, interval, resets_at, subject in rows:
        budget = pg_site.get(f"/v1/{scope}s/{subject}/budget")
        assert money(spent) == money(budget["spent"])
        assert money(reserved) == money(budget["reserved"])  # leased, unused credit is free
        assert money(limit) == money(budget["credit_limit"])
        assert interval == budget["reset_interval"]
        if budget["resets_at"] is None:
            assert resets_at is None
        else:
            assert resets_at.astimezone(UTC).isoformat()[:19] == budget["resets_at"][:19]
        assert used == round(100 * (spent + reserved) / limit, 2)
    notebook = next(r for r in rows if r[0] == "token" and r[1].startswith("notebook ("))
    window_start = pg_site.get(f"/v1/tokens/{notebook[8]}/budget")["window_start"]
    events = pg_site.get("/v1/usage", token_id=notebook[8], limit=100)["data"]
    first = min(datetime.fromisoformat(e["created_at"]) for e in events)
    if first >= datetime.fromisoformat(window_start):
        # The demo's notebook token, near its daily limit, is the most used budget.
        assert rows[0] == notebook and notebook[5] >= 75
    else:
        # The suite ran across midnight UTC: the daily window rolled after the demo traffic.
        assert notebook[2] == 0 and notebook[5] < 75
    assert [r[5] for r in rows] == sorted((r[5] for r in rows), reverse=True)


def test_recent_requests_and_latency_come_from_the_ledger(query, pg_site):
    start, end = window()
    _, rows = query(expand(PANELS["Recent requests"]["targets"][0]["rawSql"], start, end, None))
    events = pg_site.get("/v1/usage", limit=100)["data"]
    assert [r[-1] for r in rows] == [e["id"] for e in events]
    first, event = rows[0], events[0]
    assert money(first[14]) == money(event["cost"]) and first[4] == event["model"]
    _, latency = query(
        expand(PANELS["Upstream latency"]["targets"][0]["rawSql"], start, end, None, "1m")
    )
    assert {r[1] for r in latency} == {e["model"] for e in events if e["latency_ms"] is not None}
    assert all(p95 >= p50 for _, _, p50, p95 in latency)


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM key_values",
        "SELECT password_hash FROM users",
        "SELECT token_hash FROM api_tokens",
        "SELECT * FROM refresh_tokens",
        "SELECT * FROM auth_sessions",
        "DELETE FROM ledger_events",
        "UPDATE budgets SET spent = 0",
    ],
)
def test_the_reader_cannot_see_secrets_or_write(query, sql):
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        query(sql)


def test_the_team_variable_lists_the_teams(query, pg_site):
    variable = next(
        v
        for path in DASHBOARDS
        for v in json.loads(path.read_text())["templating"]["list"]
        if v["name"] == "team"
    )
    columns, rows = query(variable["query"])
    assert columns == ["__text", "__value"]
    assert {name for name, _ in rows} >= {"demo-platform", "demo-research", "demo-support"}
    assert variable["allValue"] == "'__all'" and variable["multi"] and variable["includeAll"]


def test_provisioning_points_at_the_dashboards_and_one_datasource():
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/metering.yml").read_text())
    [source] = sources["datasources"]
    assert source["type"] == "grafana-postgresql-datasource"
    used = {json.dumps(p.get("datasource")) for p in PANELS.values()} | {
        json.dumps(t["datasource"]) for p in PANELS.values() for t in p["targets"]
    }
    assert used == {json.dumps({"type": source["type"], "uid": source["uid"]})}
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/metering.yml").read_text())
    [provider] = providers["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./dashboards/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./dashboards/grafana/provisioning"] == "/etc/grafana/provisioning"


PROMETHEUS_RULES = ROOT / "dashboards" / "prometheus" / "metering-alerts.yml"
GRAFANA_ALERTS = GRAFANA / "provisioning" / "alerting" / "metering-alerts.yml"


def test_the_prometheus_rules_name_a_metric_the_proxy_exports():
    from metering.metrics import BUDGET_USED_RATIO

    rules = [r for g in yaml.safe_load(PROMETHEUS_RULES.read_text())["groups"] for r in g["rules"]]
    assert rules and all(r["alert"] and r["expr"] for r in rules)
    assert rules[0]["expr"] == f"{BUDGET_USED_RATIO} > 0.8"
    for rule in rules:
        assert re.findall(r"[a-z_]+_ratio", rule["expr"]) == [BUDGET_USED_RATIO]


def test_the_grafana_alert_runs_as_the_reader_on_the_same_measure(query, pg_site):
    [group] = yaml.safe_load(GRAFANA_ALERTS.read_text())["groups"]
    [rule] = group["rules"]
    source, threshold = rule["data"]
    assert source["datasourceUid"] == "metering-postgres"
    assert threshold["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0.8]}
    columns, rows = query(source["model"]["rawSql"])
    assert columns == ["scope", "subject_id", "budget_used_ratio"]
    assert rows and all(ratio >= 0 for _, _, ratio in rows)
