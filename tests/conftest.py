"""Fixtures: a fresh PostgreSQL database and a SQLite file per run, the simulated upstream, and
the real metering server on loopback for each backend."""

import atexit
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from metering import migrate
from metering.clock import MovableClock, using
from metering.db import SERVING_SETTINGS
from metering.settings import Settings, parse_catalog
from metering.sim.app import SimServer
from metering.testing import PgBouncer, metering_server

# The demo site (a server with the demo traffic) shared by tests/demo, dashboard and grafana;
# `cli`, the `metering` command in this process against the api server (tests/test_cli_*).
pytest_plugins = ["tests.demo_site", "tests.cli_runner"]

PG_ADMIN_DSN = os.environ.get("METERING_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")

# METERING_TEST_PGBOUNCER=1 (`make test-pgbouncer`, and a named subset in `make test`): every
# PostgreSQL database the tests reach, they reach through a PgBouncer in transaction mode
# started for this process, as METERING_DATABASE_POOLER=pgbouncer configures the service for,
# with the direct URL (the server itself) for LISTEN and `metering serve`'s migrations. The
# pooler runs the serving settings on each server connection it opens (connect_query), as an
# operator sets them for the role. Only the postgresql backend runs.
PGBOUNCER = os.environ.get("METERING_TEST_PGBOUNCER") == "1"
PG_DIRECT_DSN = PG_ADMIN_DSN  # the server itself, never the pooler
if PGBOUNCER:
    _server = make_url(PG_ADMIN_DSN)
    _bouncer = PgBouncer(
        host=_server.host or "127.0.0.1",
        port=_server.port or 5432,
        connect_query="; ".join(
            f"SET {name} = {value}" for name, value in SERVING_SETTINGS.items()
        ),
    ).start()
    atexit.register(_bouncer.stop)
    os.environ["METERING_DATABASE_POOLER"] = "pgbouncer"
    # The server without a database name: each database's own (metering.db.direct_url).
    os.environ["METERING_DATABASE_DIRECT_URL"] = _server._replace(database=None).render_as_string(
        hide_password=False
    )
    PG_ADMIN_DSN = _bouncer.url(_server.database or "postgres", _server.username or "postgres")


def direct(url: str) -> str:
    """A database URL of the tests' as the server itself, never through the pooler: for a
    test's own connection that keeps state in its session (SET ROLE), which a pooler would
    hand on to the service's next transaction."""
    if not PGBOUNCER:
        return url
    return (
        make_url(url)
        ._replace(host=_server.host, port=_server.port)
        .render_as_string(hide_password=False)
    )


# The servers the tests start (in this process and as subprocesses) keep small pools: three
# pytest-xdist workers, each with its session's servers and a test's own, share one PostgreSQL
# and its 100 connections (the default max_connections), and a pool keeps up to its size open
# once a burst has grown it. Pools of the default size (20) took up to 94 at once. A test that
# needs another size sets it (tests/resilience/test_raw_connections.py: the default pool and
# its kept writers).
os.environ.setdefault("METERING_DB_POOL_SIZE", "5")
ADMIN_KEY = "test-admin-key-" + uuid.uuid4().hex
BACKENDS = ("postgresql",) if PGBOUNCER else ("sqlite", "postgresql")


def _listed(name: str) -> tuple[str, ...]:
    """The test files a list in tests/ names, one per line (`#` starts a comment): the Makefile
    passes the same files to the serial and alone parts' pytest, which then collect only them."""
    lines = Path(__file__).with_name(name).read_text().splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


# The fault suite (tests/faults/: a primary killed and its standby promoted, a replica cut from
# the database, replicas with skewed clocks) runs on its own command, `make test-faults`, which
# sets METERING_FAULT_SUITE=1; `make test` and any other run leave it out.
collect_ignore = [] if os.environ.get("METERING_FAULT_SUITE") == "1" else ["faults"]
# The client matrix (tests/clients/: the Python and Node clients users bring, each spawned against
# a live server) runs with `make test-clients`, which installs the clients (.venv-clients,
# tests/clients/node/node_modules) and sets METERING_CLIENT_MATRIX=1; `make test` leaves it out.
if os.environ.get("METERING_CLIENT_MATRIX") != "1":
    collect_ignore.append("clients")

# Run apart from the rest of the suite (tests/serial.txt, tests/alone.txt say why).
SERIAL = _listed("serial.txt")
ALONE = _listed("alone.txt")


# The fixtures that start a server (the metering server, the simulated upstream, a webhook
# receiver, a raw upstream) or a database, or hand a test a database of its backend; the rest
# build on them. A test that uses one of them, or is marked e2e because it starts a server or a
# database itself (`metering serve`, a bench run), is `e2e`; every other test is `unit` (no
# socket listening, no database: `make test-fast`).
E2E_FIXTURES = frozenset(
    {
        "sim",
        "pg_url",
        "sqlite_url",
        "backend",
        "fresh_pg",
        "fresh_sqlite",
        "fresh_db",
        "backend_url",
        "alerts_db",
        "commits_db",
        "private_pg",
        "receiver",
        "tls_receiver",
        "upstreams",
    }
)


# The files whose tests take longest (the fuzzer, reports over 100,000 rows, holds that must
# outlive their TTL, bench runs) are collected first: started last, one of them would keep the
# parallel part waiting on a single process after the others had finished.
SLOW_FIRST = (
    "tests/fuzz/",
    "tests/reports/test_report_stall.py",
    "tests/reports/test_spend.py",
    "tests/proxy/test_live_holds.py",
    "tests/bench/",
)


def pytest_collection_modifyitems(config, items) -> None:
    root = config.rootpath
    items.sort(key=lambda item: not item.path.relative_to(root).as_posix().startswith(SLOW_FIRST))
    for item in items:
        path = item.path.relative_to(root).as_posix()
        if path.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        elif path.startswith(ALONE):
            item.add_marker(pytest.mark.alone)
        if item.get_closest_marker("e2e") is None:
            uses = getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.unit if E2E_FIXTURES.isdisjoint(uses) else pytest.mark.e2e)


def catalog_for(sim: SimServer) -> dict:
    return {
        "providers": {
            "sim-openai": {
                "base_url": sim.base_url("openai"),
                "dialect": "openai",
                "api_key_env": "SIM_OPENAI_KEY",
                "timeout_s": 2,
            },
            "sim-exascale": {
                "base_url": sim.base_url("exascale"),
                "dialect": "exascale",
                "api_key_env": "SIM_EXASCALE_KEY",
                "timeout_s": 2,
            },
        },
        "models": [
            {
                "name": "gpt-sim",
                "provider": "sim-openai",
                "upstream_model": "sim/gpt",
                "input_usd_per_mtok": "0.15",
                "output_usd_per_mtok": "0.60",
                "cached_input_usd_per_mtok": "0.075",
                "max_output_tokens": 4096,
            },
            {
                "name": "minimax-m2.1",
                "provider": "sim-exascale",
                "upstream_model": "MiniMaxAI/MiniMax-M2.1",
                "input_usd_per_mtok": "0.30",
                "output_usd_per_mtok": "1.20",
                "max_output_tokens": 16384,
            },
        ],
    }


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """The event loop of the tests marked `anyio` (anyio's pytest plugin): asyncio's."""
    return "asyncio"


@pytest.fixture
async def task_clock() -> AsyncIterator[MovableClock]:
    """A clock of the test's own, current in its task: for an anyio test that calls services
    and jobs directly (metering.db.utcnow() reads it), to move forward instead of waiting."""
    with using(MovableClock()) as moved:
        yield moved


@pytest.fixture(scope="session")
def sim():
    server = SimServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_url():
    name = f"metering_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"{PG_ADMIN_DSN.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('db') / 'metering.db'}"


def database_url(request, backend: str) -> str:
    return request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request):
    return request.param


class Api:
    """The admin's view of one running server, plus helpers that make teams, users and tokens."""

    def __init__(
        self, url: str, backend: str, settings: Settings, clock: MovableClock | None = None
    ) -> None:
        self.url, self.backend, self.settings = url, backend, settings
        # The server's clock, when it runs in this process (the `clock` fixture moves it).
        self.clock = clock
        self.http = httpx.Client(
            base_url=url, timeout=30, headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )

    def request(
        self, method: str, path: str, *, key: str | None = None, **kwargs
    ) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return self.http.request(method, path, headers=headers, **kwargs)

    def ok(self, method: str, path: str, expect: int = 200, **kwargs) -> dict:
        response = self.request(method, path, **kwargs)
        assert response.status_code == expect, response.text
        return response.json() if response.content else {}

    def team(self, credit_limit=None, reset_interval="never") -> dict:
        return self.ok(
            "POST",
            "/v1/teams",
            201,
            json={
                "name": f"team-{uuid.uuid4().hex[:8]}",
                "credit_limit": credit_limit,
                "reset_interval": reset_interval,
            },
        )

    def user(self, team_id: str, credit_limit=None, reset_interval="never") -> dict:
        return self.ok(
            "POST",
            "/v1/users",
            201,
            json={
                "email": f"u{uuid.uuid4().hex[:10]}@example.com",
                "name": "Test User",
                "team_id": team_id,
                "credit_limit": credit_limit,
                "reset_interval": reset_interval,
            },
        )

    def token(self, user_id: str, credit_limit=None, reset_interval="never") -> dict:
        return self.ok(
            "POST",
            f"/v1/users/{user_id}/tokens",
            201,
            json={"name": "test", "credit_limit": credit_limit, "reset_interval": reset_interval},
        )

    def principal(self, token_limit=None, user_limit=None, team_limit=None, interval="never"):
        """A fresh team, user and token; returns (team, user, token)."""
        team = self.team(team_limit, interval)
        user = self.user(team["id"], user_limit, interval)
        return team, user, self.token(user["id"], token_limit, interval)

    def events(self, **filters) -> list[dict]:
        out, cursor = [], None
        while True:
            params = {**filters, "limit": 1000, **({"cursor": cursor} if cursor else {})}
            page = self.ok("GET", "/v1/usage", params=params)
            out.extend(page["data"])
            cursor = page["next_cursor"]
            if not cursor:
                return out

    def openai(self, token: str, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=token, max_retries=0, **kwargs)


@pytest.fixture(scope="session")
def api(request, backend, sim):
    url = database_url(request, backend)
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, _env_file=None)
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "sim-key", "SIM_OPENAI_KEY": "sim-key"}
    )
    clock = MovableClock()
    server = metering_server(settings, catalog, clock=clock)
    yield Api(server.url, backend, settings, clock)
    server.stop()


@pytest.fixture
def clock(api) -> Iterator[MovableClock]:
    """The api server's clock, for a test to move forward instead of waiting on the wall clock;
    back on the wall clock when the test ends."""
    assert api.clock is not None
    yield api.clock
    api.clock.reset()
