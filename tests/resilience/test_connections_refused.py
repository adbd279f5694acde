"""PostgreSQL refusing every new connection (SQLSTATE 53300: "too many clients already", or too
many for the role) after the server's own connections went away: each request gets 503
ledger_unavailable before anything goes upstream, never a 500, and the same process serves
again once connections are allowed. The refusal is a role's CONNECTION LIMIT 0 (the same
SQLSTATE as max_connections reached), so the machine's shared cluster keeps its slots."""

import uuid
from decimal import Decimal

import httpx
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.budgets.conftest import budget, sim_records, usd, wait_for
from tests.conftest import ADMIN_KEY, PG_ADMIN_DSN, Api, catalog_for

pytestmark = pytest.mark.postgres

REFUSED = 6


def _admin(sql: str, *params) -> list[tuple]:
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        cursor = conn.execute(sql, params or None)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def limited_role(sim):
    """A server connecting as a role of its own (not a superuser: the limit applies to it), on
    a database that role owns; (api, role)."""
    role = f"metering_lim_{uuid.uuid4().hex[:10]}"
    _admin(f'CREATE ROLE "{role}" LOGIN')
    _admin(f'CREATE DATABASE "{role}" OWNER "{role}"')
    admin = conninfo_to_dict(PG_ADMIN_DSN)
    url = f"postgresql://{role}@{admin.get('host', '127.0.0.1')}:{admin.get('port', 5432)}/{role}"
    try:
        migrate.upgrade(url)
        settings = Settings(database_url=url, admin_key=ADMIN_KEY, db_pool_size=2, _env_file=None)
        catalog = parse_catalog(
            catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
        )
        server = metering_server(settings, catalog)
        try:
            yield Api(server.url, "postgresql", settings), role
        finally:
            server.stop()
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{role}" WITH (FORCE)')
        _admin(f'DROP ROLE IF EXISTS "{role}"')


def _complete(api: Api, key: str, marker: str, stream: bool) -> httpx.Response:
    body = {
        "model": "gpt-sim",
        "messages": [{"role": "user", "content": f"{marker} sim:tokens=3"}],
        "max_tokens": 8,
        "stream": stream,
    }
    return api.request("POST", "/v1/chat/completions", key=key, json=body)


def _backends(role: str) -> int:
    return _admin("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", role)[0][0]


def test_refused_connections_answer_503_before_the_upstream_and_the_process_recovers(
    limited_role, sim
):
    api, role = limited_role
    team, user, token = api.principal(token_limit="10")
    key = token["token"]
    tag = uuid.uuid4().hex[:8]
    served = []

    first = _complete(api, key, f"refused {tag} before", stream=False)
    assert first.status_code == 200, first.text
    served.append(first.headers["x-request-id"])

    # No new connection for the role, then every one the server had is ended.
    _admin(f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
    _admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", role)
    wait_for(lambda: _backends(role) == 0, timeout=10)
    try:
        for n in range(REFUSED):
            response = _complete(api, key, f"refused {tag} during-{n}", stream=n % 2 == 1)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "ledger_unavailable", response.text
        ready = api.request("GET", "/readyz")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "ledger_unavailable"
        assert _backends(role) == 0  # nothing got through while refused
    finally:
        _admin(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')

    # Nothing refused went upstream.
    assert sim_records(sim, f"refused {tag} during") == []

    # The same process serves again once PostgreSQL takes connections.
    def serves() -> bool:
        response = _complete(api, key, f"refused {tag} after", stream=True)
        if response.status_code == 200:
            served.append(response.headers["x-request-id"])
            return True
        assert response.status_code == 503, response.text
        return False

    wait_for(serves, timeout=30)
    assert len(sim_records(sim, f"refused {tag} after")) == 1

    # One event for each answer that went upstream, none for the refused ones; the budget
    # charged exactly those.
    events = api.events(token_id=token["id"])
    assert sorted(e["id"] for e in events) == sorted(served)
    assert all(e["status"] == "ok" for e in events)
    cost = sum(Decimal(e["cost"]) for e in events)
    assert cost > 0
    for scope, subject in (("token", token), ("user", user), ("team", team)):
        assert usd(budget(api, scope, subject["id"])["spent"]) == cost, scope
