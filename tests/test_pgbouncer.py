"""The service behind PgBouncer in transaction pooling mode (Debian's `pgbouncer`, 1.18: no
prepared statement tracking), with METERING_DATABASE_POOLER=pgbouncer and the direct URL for
LISTEN. Each test starts a pooler of its own in front of the tests' PostgreSQL."""

import asyncio
import subprocess
import threading
import uuid
from decimal import Decimal

import asyncpg
import openai
import psycopg
import pytest
from sqlalchemy import text

from metering import migrate
from metering.db import Database, direct_url
from metering.settings import Settings, parse_catalog
from metering.testing import PgBouncer, metering_server
from tests.conftest import ADMIN_KEY, PG_DIRECT_DSN, Api, catalog_for

SIM_KEYS = {"SIM_EXASCALE_KEY": "sim-key", "SIM_OPENAI_KEY": "sim-key"}


@pytest.fixture
def database():
    """A new database on the tests' PostgreSQL: (its name, its direct URL)."""
    name = f"metering_pgb_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_DIRECT_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield name, f"{PG_DIRECT_DSN.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(PG_DIRECT_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pooler(pool_size: int = 20) -> PgBouncer:
    server = psycopg.conninfo.conninfo_to_dict(PG_DIRECT_DSN)
    return PgBouncer(
        host=str(server["host"]), port=int(server["port"]), pool_size=pool_size
    ).start()


def admin(bouncer: PgBouncer, command: str) -> list[list[str]]:
    """A command of PgBouncer's admin console (simple query protocol only: psql's)."""
    out = subprocess.run(
        ["psql", "-X", "-At", "-F", "\t", "-c", command, bouncer.url("pgbouncer")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line.split("\t") for line in out.splitlines()]


def test_a_statement_kept_by_name_is_missing_in_the_next_server_session_unless_none_is_kept(
    database,
):
    """A client's second run of a statement lands on another server session (the first is in
    another client's transaction): asyncpg's statement, prepared by name in the first, is not
    there; with the pooler's connect arguments nothing is kept by name and both runs work."""
    name, _ = database
    bouncer = pooler(pool_size=2)

    async def twice(**kwargs) -> list[int]:
        client = await asyncpg.connect(bouncer.url(name), **kwargs)
        other = await asyncpg.connect(bouncer.url(name), **kwargs)
        try:
            first = await client.fetchval("SELECT $1::int + 1", 0)  # the one server session
            await other.execute("BEGIN")  # ... now other's, until it ends
            second = await client.fetchval("SELECT $1::int + 1", 1)  # a second session
            await other.execute("ROLLBACK")
            return [first, second]
        finally:
            await client.close()
            await other.close()

    try:
        with pytest.raises(asyncpg.exceptions.InvalidSQLStatementNameError):
            asyncio.run(twice())
        assert asyncio.run(twice(statement_cache_size=0)) == [1, 2]
    finally:
        bouncer.stop()


async def _each_way(db: Database) -> list[int]:
    """A value through each of Database's ways to the database."""
    async with db.transaction() as session:
        orm = (await session.execute(text("SELECT :n + 1"), {"n": 0})).scalar_one()
    async with db.begin() as conn:
        core = (await conn.execute(text("SELECT :n + 1"), {"n": 1})).scalar_one()
    async with db.single() as conn:
        single = (await conn.execute(text("SELECT :n + 1"), {"n": 2})).scalar_one()
    async with db.raw() as conn:
        raw = await conn.fetchval("SELECT $1::int + 1", 3)
    async with db.reads() as session:
        report = (await session.execute(text("SELECT :n + 1"), {"n": 4})).scalar_one()
    return [orm, core, single, raw, report]


def test_every_way_to_the_database_works_with_one_server_session_for_many_clients(
    database, monkeypatch
):
    """Three processes' worth of pools take turns on one server session; each statement with
    parameters, many times, interleaved."""
    name, direct = database
    bouncer = pooler(pool_size=1)

    async def run() -> list[list[int]]:
        dbs = [Database(bouncer.url(name), 20, pooler="pgbouncer", direct=direct) for _ in "abc"]
        try:
            rounds = [_each_way(db) for db in dbs for _ in range(10)]
            return await asyncio.gather(*rounds)
        finally:
            for db in dbs:
                await db.dispose()

    try:
        assert asyncio.run(run()) == [[1, 2, 3, 4, 5]] * 30
        # PgBouncer refuses a setting given at connect: the serving settings are not sent.
        monkeypatch.delenv("METERING_DATABASE_POOLER", raising=False)
        with pytest.raises(Exception, match="unsupported startup parameter"):
            asyncio.run(_each_way(Database(bouncer.url(name), pooler=None)))
    finally:
        bouncer.stop()


def test_migrations_race_through_the_pooler_and_leave_no_lock(database):
    name, direct = database
    bouncer = pooler(pool_size=4)
    errors: list[BaseException] = []

    def upgrade() -> None:
        try:
            migrate.upgrade(bouncer.url(name))
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=upgrade) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == []
        with psycopg.connect(direct, autocommit=True) as conn:
            version = conn.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
            locks = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                (migrate.MIGRATION_LOCK,),
            ).fetchone()[0]
        assert (version, locks) == (1, 0)
    finally:
        bouncer.stop()


def test_requests_are_metered_and_a_revoked_token_refused_through_the_pooler(database, sim):
    """A completion through the SDK is held, forwarded, settled and reported through the
    pooler; a revoked token is refused at once, told by the listener on the direct URL."""
    name, direct = database
    bouncer = pooler()
    settings = Settings(
        database_url=bouncer.url(name),
        database_pooler="pgbouncer",
        database_direct_url=PG_DIRECT_DSN.rsplit("/", 1)[0],
        admin_key=ADMIN_KEY,
        _env_file=None,
    )
    assert direct_url(settings.database_url, settings.database_direct_url) == direct
    try:
        migrate.upgrade(settings.database_url)
        server = metering_server(settings, parse_catalog(catalog_for(sim), environ=SIM_KEYS))
        try:
            api = Api(server.url, "postgresql", settings)
            _, _, token = api.principal(token_limit="1.00")
            client = api.openai(token["token"])
            for _ in range(3):
                answer = client.chat.completions.create(
                    model="gpt-sim", messages=[{"role": "user", "content": "hello"}]
                )
                assert answer.choices[0].message.content
            events = api.events(token_id=token["id"])
            assert len(events) == 3
            budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
            spent = sum(Decimal(event["cost"]) for event in events)
            assert spent > 0
            assert (Decimal(budget["spent"]), Decimal(budget["reserved"])) == (spent, 0)
            # The listener is no client of the pooler: it LISTENs on the server itself.
            clients = admin(bouncer, "SHOW CLIENTS")
            assert clients and not any("metering-auth" in row for row in clients)
            with psycopg.connect(direct, autocommit=True) as conn:
                listening = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                    "'metering-auth' AND datname = current_database()"
                ).fetchone()[0]
            assert listening == 1
            api.ok("DELETE", f"/v1/tokens/{token['id']}", 204)
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(
                    model="gpt-sim", messages=[{"role": "user", "content": "again"}]
                )
            stats = {row[0]: row for row in admin(bouncer, "SHOW STATS")}
            assert int(stats[name][1]) > 0  # transactions through the pooler
        finally:
            server.stop()
    finally:
        bouncer.stop()


@pytest.mark.parametrize(
    ("url", "given", "expected"),
    [
        ("postgresql://m:pw@pool:6432/db", None, "postgresql://m:pw@pool:6432/db"),
        ("postgresql://m:pw@pool:6432/db", "postgresql://pg:5432", "postgresql://m:pw@pg:5432/db"),
        ("postgresql://m:pw@pool:6432/db", "postgresql://m@pg/other", "postgresql://m:pw@pg/other"),
        ("postgresql://m:pw@pool:6432/db", "postgresql://admin@pg/db", "postgresql://admin@pg/db"),
        ("sqlite:///./metering.db", "postgresql://pg:5432", "sqlite:///./metering.db"),
    ],
)
def test_the_direct_url_takes_what_it_leaves_out_from_the_database_url(url, given, expected):
    assert direct_url(url, given) == expected


def test_an_unknown_pooler_is_refused_and_an_empty_one_is_unset():
    with pytest.raises(ValueError, match="METERING_DATABASE_POOLER is 'odyssey'"):
        Settings(database_pooler="odyssey", _env_file=None)
    assert Settings(database_pooler="", _env_file=None).database_pooler is None
