"""When the database cannot be reached, no request is served unmetered: 503 ledger_unavailable."""

import uuid

import httpx
import psycopg
import pytest

from metering import migrate
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, PG_ADMIN_DSN, Api, catalog_for
from tests.resilience.link import DatabaseLink


@pytest.fixture
def outage(sim):
    name = f"metering_test_outage_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    migrate.upgrade(f"postgresql://postgres@127.0.0.1:5432/{name}")
    cable = DatabaseLink()
    settings = Settings(
        database_url=f"postgresql://postgres@127.0.0.1:{cable.port}/{name}",
        admin_key=ADMIN_KEY,
        _env_file=None,
    )
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings, catalog)
    yield Api(server.url, "postgresql", settings), cable
    server.stop()
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.postgres
def test_a_cut_database_gives_503_and_nothing_reaches_the_upstream(outage, sim):
    api, cable = outage
    _, _, token = api.principal()
    body = {"model": "gpt-sim", "messages": [{"role": "user", "content": "outage"}]}
    headers = {"authorization": f"Bearer {token['token']}"}
    assert (
        httpx.post(f"{api.url}/v1/chat/completions", json=body, headers=headers).status_code == 200
    )
    before = len(sim.log())

    cable.cut()
    for _ in range(3):  # pooled connections die one by one; each attempt must still be a 503
        response = httpx.post(
            f"{api.url}/v1/chat/completions", json=body, headers=headers, timeout=60
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "ledger_unavailable"
    assert len(sim.log()) == before  # no request was served unmetered
    assert httpx.get(f"{api.url}/readyz", timeout=60).status_code == 503
    assert httpx.get(f"{api.url}/healthz").status_code == 200


def test_the_drivers_own_state_errors_during_a_restart_read_as_ledger_unavailable():
    """asyncpg raises InternalClientError ("cannot switch to state ...; another operation is in
    progress") while its server restarts: no SQLSTATE, yet the database is what is missing."""
    from asyncpg.exceptions import InternalClientError
    from sqlalchemy import exc as sa_exc

    from metering.app import _database_error

    driver = InternalClientError("cannot switch to state 12; another operation is in progress")
    try:
        try:
            raise driver
        except InternalClientError as inner:
            raise RuntimeError("adapted") from inner
    except RuntimeError as adapted:
        wrapped = sa_exc.InternalError("SELECT 1", {}, adapted)
    response = _database_error(None, wrapped)
    assert response.status_code == 503
    assert b'"ledger_unavailable"' in response.body
    other = sa_exc.InternalError("SELECT 1", {}, RuntimeError("a real bug"))
    assert _database_error(None, other).status_code == 500
