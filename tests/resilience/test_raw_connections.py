"""The group writers' asyncpg connections (Database.raw) come from the pool and go back to it:
overflow connections are closed when the pool is full, a failed one is discarded, and a burst
with cancellations leaves no connection open beyond the pool's bound."""

import asyncio
import logging

import asyncpg
import psycopg
import pytest

from metering.db import Database
from tests.budgets.conftest import fresh_pg  # noqa: F401 - a database of its own
from tests.conftest import PG_ADMIN_DSN

pytestmark = pytest.mark.postgres


def _backends(url: str) -> int:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)
        ).fetchone()[0]


def test_a_burst_of_raw_connections_goes_back_to_the_pool_postgres(fresh_pg, caplog):  # noqa: F811
    caplog.set_level(logging.ERROR)

    async def scenario() -> None:
        db = Database(fresh_pg, 2)  # 2 pooled, 2 more in overflow
        try:

            async def one(i: int) -> int:
                async with db.raw() as conn:
                    if i % 7 == 0:
                        # The server's own refusal: the connection stays sound.
                        with pytest.raises(asyncpg.PostgresError):
                            await conn.fetchval("SELECT 1 / 0")
                    return await conn.fetchval("SELECT $1::int FROM pg_sleep(0.002)", i)

            for _ in range(4):
                tasks = [asyncio.ensure_future(one(i)) for i in range(60)]
                await asyncio.sleep(0.005)
                for task in tasks[1::5]:
                    task.cancel()  # some mid-statement: those connections are discarded
                done = await asyncio.gather(*tasks, return_exceptions=True)
                answered = [d for d in done if isinstance(d, int)]
                assert answered, done
                assert all(d == i for i, d in enumerate(done) if isinstance(d, int))
                pool = db.engine.sync_engine.pool
                assert pool.checkedout() == 0
                assert pool.checkedin() <= 2
                assert _backends(fresh_pg) <= 2
        finally:
            await db.dispose()

    asyncio.run(scenario())
    assert "Exception closing connection" not in caplog.text
    assert _backends(fresh_pg) == 0


@pytest.mark.anyio
async def test_the_connection_given_back_last_is_taken_first_postgres(fresh_pg):  # noqa: F811
    """The pool is LIFO: a light load keeps reusing the same few connections, whose prepared
    statements are planned (a settle's first plans on a fresh connection cost milliseconds)."""

    db = Database(fresh_pg, 4)
    try:
        pids = []
        async with db.raw() as a, db.raw() as b, db.raw() as c:
            pids = [await conn.fetchval("SELECT pg_backend_pid()") for conn in (a, b, c)]
        # Given back c, then b, then a: a was given back last.
        for _ in range(5):
            async with db.raw() as conn:
                assert await conn.fetchval("SELECT pg_backend_pid()") == pids[0]
        async with db.raw() as first, db.raw() as second:
            taken = [await conn.fetchval("SELECT pg_backend_pid()") for conn in (first, second)]
        assert taken == [pids[0], pids[1]]
    finally:
        await db.dispose()


def test_sound_connections_are_kept_between_groups_and_given_back_postgres(fresh_pg, monkeypatch):  # noqa: F811
    """With a pool of at least KEPT_MIN_POOL, up to KEPT_WRITERS sound connections stay out of
    the pool between two groups (no checkout and return per statement); a failed one is
    discarded, not kept; dispose gives the kept ones back and closes them."""
    from metering import db as db_module

    async def pid(conn) -> int:
        return await conn.fetchval("SELECT pg_backend_pid()")

    async def scenario() -> None:
        db = Database(fresh_pg, db_module.KEPT_MIN_POOL)
        pool = db.engine.sync_engine.pool
        try:
            async with db.raw() as conn:
                first = await pid(conn)
            assert pool.checkedout() == 1  # kept, not given back
            for _ in range(3):
                async with db.raw() as conn:
                    assert await pid(conn) == first
            async with db.raw() as conn:  # the server's refusal: still sound, still kept
                with pytest.raises(asyncpg.PostgresError):
                    await conn.fetchval("SELECT 1 / 0")
            async with db.raw() as conn:
                assert await pid(conn) == first
            # A burst: at most KEPT_WRITERS stay out of the pool afterwards.
            async with db.raw() as a, db.raw() as b, db.raw() as c, db.raw() as d:
                assert len({await pid(x) for x in (a, b, c, d)}) == 4
            assert pool.checkedout() == db_module.KEPT_WRITERS
            # Cancelled mid-statement: discarded, never handed to the next group.
            async with db.raw() as conn:
                doomed = await pid(conn)
            task = asyncio.ensure_future(_sleep_on(db, 1.0))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(3):
                async with db.raw() as a, db.raw() as b:
                    assert await pid(a) != doomed and await pid(b) != doomed
                    assert await a.fetchval("SELECT 1") == 1
            # Past KEPT_FOR_S a connection goes back to the pool instead of being kept.
            monkeypatch.setattr(db_module, "KEPT_FOR_S", 0.0)
            for _ in range(db_module.KEPT_WRITERS):
                async with db.raw():
                    pass
            assert pool.checkedout() == 0
        finally:
            await db.dispose()

    asyncio.run(scenario())
    assert _backends(fresh_pg) == 0


async def _sleep_on(db: Database, seconds: float) -> None:
    async with db.raw() as conn:
        await conn.execute(f"SELECT pg_sleep({seconds})")


@pytest.mark.anyio
@pytest.mark.parametrize("pool_size", [2, 8])  # given back to the pool, or kept
async def test_a_connection_the_server_ended_is_never_handed_out_again_postgres(
    fresh_pg,  # noqa: F811 - the fixture imported above
    pool_size,
):
    """A backend terminated mid-statement: asyncpg reports it as a PostgresError (class 08),
    which is not the server refusing a statement; the connection is discarded, and the next
    group gets a live one."""

    db = Database(fresh_pg, pool_size)
    try:
        async with db.raw() as conn:
            victim = await conn.fetchval("SELECT pg_backend_pid()")

        # The statement waits on a lock another session holds until the backend is terminated.
        holder = psycopg.connect(fresh_pg, autocommit=True)  # advisory locks are per database
        holder.execute("SELECT pg_advisory_lock(4242)")

        async def terminate() -> None:
            with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
                for _ in range(500):  # until the victim waits on the lock (10 s at most)
                    waiting = admin.execute(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                        (victim,),
                    ).fetchone()
                    if waiting and waiting[0]:
                        break
                    await asyncio.sleep(0.02)
                admin.execute("SELECT pg_terminate_backend(%s)", (victim,))

        killer = asyncio.ensure_future(terminate())
        try:
            with pytest.raises(asyncpg.PostgresError) as failed:  # noqa: PT012 - the pid, then the kill
                async with db.raw() as conn:
                    assert await conn.fetchval("SELECT pg_backend_pid()") == victim
                    await conn.execute("SELECT pg_advisory_lock(4242)")
            await killer
        finally:
            holder.close()
        assert (failed.value.sqlstate or "").startswith(("08", "57P")), failed.value
        for _ in range(3):
            async with db.raw() as conn:
                assert await conn.fetchval("SELECT pg_backend_pid()") != victim
    finally:
        await db.dispose()
