"""Database URLs naming several PostgreSQL hosts: either form is taken, and every kind of
connection (the pool, the raw asyncpg ones, the credential listener's, the migrations') reaches
the host that accepts writes, past a host that refuses connections."""

import re
import uuid

import asyncpg
import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from metering import migrate
from metering.db import Database, NoWritableHost, async_url, asyncpg_dsn, is_sqlite, sync_url
from metering.dburl import hosts_in_query
from metering.settings import Settings
from metering.testing import free_port
from tests.conftest import PG_ADMIN_DSN

LIBPQ = "postgresql://app:s3cret@db-a:5432,db-b:5433/metering?target_session_attrs=read-write"
QUERY = "postgresql://app:s3cret@/metering?host=db-a:5432&host=db-b:5433&target_session_attrs=read-write"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (LIBPQ, QUERY),
        (QUERY, QUERY),
        ("postgresql://app@db-a,db-b/metering", "postgresql://app@/metering?host=db-a&host=db-b"),
        ("postgresql://app@db:5432/metering", "postgresql://app@db:5432/metering"),
        ("postgresql://a:p,q@db:5432/m", "postgresql://a:p,q@db:5432/m"),  # a comma in a password
        ("sqlite:///./metering.db", "sqlite:///./metering.db"),
    ],
)
def test_a_libpq_host_list_becomes_host_parameters(given, expected):
    assert hosts_in_query(given) == expected


def test_both_forms_give_the_same_driver_urls():
    for driver_url, driver in ((async_url, "asyncpg"), (sync_url, "psycopg")):
        parsed = make_url(driver_url(LIBPQ))
        assert parsed == make_url(driver_url(QUERY))
        assert parsed.drivername == f"postgresql+{driver}"
        assert parsed.query == {
            "host": ("db-a:5432", "db-b:5433"),
            "target_session_attrs": "read-write",
        }
        assert (parsed.username, parsed.password, parsed.database) == ("app", "s3cret", "metering")
    assert not is_sqlite(LIBPQ)


def test_asyncpg_takes_the_hosts_in_libpq_form():
    # asyncpg reads one `host` query parameter, the last: the list goes back into the netloc.
    assert asyncpg_dsn(QUERY) == LIBPQ
    assert asyncpg_dsn(LIBPQ) == LIBPQ
    assert asyncpg_dsn("postgresql://app@db:5432/m") == "postgresql://app@db:5432/m"


def test_settings_take_a_host_list_and_a_password():
    settings = Settings(database_url=LIBPQ, database_password="p@ss:w/rd", _env_file=None)
    parsed = make_url(settings.database_url)
    assert parsed.password == "p@ss:w/rd"
    assert parsed.query["host"] == ("db-a:5432", "db-b:5433")
    assert asyncpg_dsn(settings.database_url) == LIBPQ.replace("s3cret", "p%40ss%3Aw%2Frd")


@pytest.fixture
def two_hosts_url():
    """A database on the shared cluster, named behind a first host that refuses connections."""
    name = f"metering_hosts_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    dead = free_port()
    yield (
        f"postgresql://postgres@127.0.0.1:{dead},127.0.0.1:5432/{name}"
        "?target_session_attrs=read-write"
    )
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.e2e
@pytest.mark.anyio
async def test_every_connection_reaches_the_writable_host(two_hosts_url):
    migrate.upgrade(two_hosts_url)  # psycopg, through Alembic
    db = Database(Settings(database_url=two_hosts_url, _env_file=None).database_url, 2)
    try:
        async with db.begin() as conn:
            assert (await conn.execute(text("SELECT inet_server_port()"))).scalar() == 5432
            assert (await conn.execute(text("SELECT count(*) FROM teams"))).scalar() == 0
        async with db.raw() as raw:
            assert await raw.fetchval("SELECT NOT pg_is_in_recovery()") is True
    finally:
        await db.dispose()
    listener = await asyncpg.connect(asyncpg_dsn(two_hosts_url))
    try:
        assert await listener.fetchval("SELECT inet_server_port()") == 5432
    finally:
        await listener.close()


@pytest.mark.e2e
@pytest.mark.anyio
async def test_no_writable_host_is_an_unreachable_database(two_hosts_url):
    # Every host answers, none as asked (a standby not yet promoted, here the primary asked
    # to be read-only): a lost connection, as when none answers, never a statement's error.
    live_only = re.sub(r"@[^/]*/", "@127.0.0.1:5432/", two_hosts_url)
    db = Database(live_only.replace("read-write", "read-only"), 2)
    try:
        with pytest.raises(DBAPIError) as caught:
            async with db.begin() as conn:
                await conn.execute(text("SELECT 1"))
        assert caught.value.connection_invalidated
        with pytest.raises(NoWritableHost):
            async with db.raw():
                pass
    finally:
        await db.dispose()
