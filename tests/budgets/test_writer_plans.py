"""Statements are planned once per connection, while `holds` may be a page or two; the pool's
connections never plan a sequential scan, so a plan stays a key lookup as the table fills with
the dead rows of every request between two vacuums (metering.db, SERVING_SETTINGS). A report's
transaction plans with the planner's defaults."""

import json

import pytest

from metering import migrate
from metering.budgets import settle_pg
from metering.db import Database
from tests.budgets.conftest import fresh_pg  # noqa: F401


def _scans(plan: dict) -> set[tuple[str, str]]:
    """(node type, relation) of every node of an EXPLAIN (FORMAT JSON) plan that reads one."""
    found = set()
    if "Relation Name" in plan:
        found.add((plan["Node Type"], plan["Relation Name"]))
    for child in plan.get("Plans", ()):
        found |= _scans(child)
    return found


async def _generic_plan(conn, sql: str, args: list[str]) -> set[tuple[str, str]]:
    """The plan a prepared statement keeps after its first runs (the generic plan), on this
    connection, as the tables are now."""
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        await conn.execute(f"PREPARE probe AS {sql}")
        try:
            raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE probe({', '.join(args)})")
        finally:
            await conn.execute("DEALLOCATE probe")
    finally:
        await conn.execute("RESET plan_cache_mode")
    plans = json.loads(raw) if isinstance(raw, str) else raw  # the pool's codec decodes json
    return _scans(plans[0]["Plan"])


async def _driver(connection):
    return (await connection.get_raw_connection()).driver_connection


async def _report_driver(session):
    """The asyncpg connection of a report's transaction (Database.reads), begun."""
    connection = await session.connection()
    return (await connection.get_raw_connection()).driver_connection


@pytest.mark.anyio
async def test_the_settle_statement_finds_holds_by_key_outside_reports(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)
    settle = settle_pg.STATEMENT
    empty = ["'[]'"] * len(settle.names)

    db = Database(fresh_pg, 2)
    try:
        async with db.raw() as conn:  # the group writers' connection
            assert await conn.fetchval("SHOW enable_seqscan") == "off"
            writer = await _generic_plan(conn, settle.sql, empty)
        async with db.reads() as report:
            conn = await _report_driver(report)
            assert await conn.fetchval("SHOW enable_seqscan") == "on"
            assert await conn.fetchval("SHOW work_mem") == "64MB"
            assert await conn.fetchval("SHOW jit") == "off"
            other = await _generic_plan(conn, settle.sql, empty)
        async with db.single() as after:  # SET LOCAL: the report's transaction only
            assert await (await _driver(after)).fetchval("SHOW enable_seqscan") == "off"
            assert await (await _driver(after)).fetchval("SHOW work_mem") != "64MB"
        # Planned with the defaults, the empty table is read whole...
        assert ("Seq Scan", "holds") in other
        # ...on the writers' connection every read of holds (the hold taken, the holds seen) is by
        # key, and nothing is read whole.
        holds = {node for node, relation in writer if relation == "holds"}
        assert holds and "Seq Scan" not in holds, writer
        assert all(node != "Seq Scan" for node, _ in writer), writer
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_hold_deleted_by_id_after_a_vacuum_is_found_by_key_outside_reports(fresh_pg):  # noqa: F811
    """The general path's statements (a release, a settle with a rate claim) are SQLAlchemy's,
    on the same pool: just after a vacuum has left `holds` one page, their generic plans are
    still key lookups there, and sequential scans with the planner's defaults (a report's)."""
    migrate.upgrade(fresh_pg)
    delete = "DELETE FROM holds WHERE id = $1"

    db = Database(fresh_pg, 2)
    try:
        async with db.single() as serving:
            conn = await _driver(serving)
            await conn.execute("VACUUM ANALYZE holds")
            plan = await _generic_plan(conn, delete, ["'h1'"])
        async with db.reads() as report:
            default = await _generic_plan(await _report_driver(report), delete, ["'h1'"])
        assert ("Seq Scan", "holds") in default
        assert ("Seq Scan", "holds") not in plan and ("Index Scan", "holds") in plan, plan
    finally:
        await db.dispose()
