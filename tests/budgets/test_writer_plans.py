"""The group writers' statements are planned once per connection, while `holds` may be a few
pages; their connections never plan a sequential scan, so the plan stays a key lookup as the
table fills with the dead rows of every request between two vacuums (metering.db,
WRITER_SETTINGS)."""

import asyncio
import json

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


async def _generic_plan(conn, statement: settle_pg.Prepared) -> set[tuple[str, str]]:
    """The plan a prepared statement keeps after its first runs (the generic plan), on this
    connection, with the `holds` table empty as a fresh server finds it."""
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        await conn.execute(f"PREPARE probe AS {statement.sql}")
        try:
            empty = ", ".join("'[]'" for _ in statement.names)
            raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE probe({empty})")
        finally:
            await conn.execute("DEALLOCATE probe")
    finally:
        await conn.execute("RESET plan_cache_mode")
    plans = json.loads(raw) if isinstance(raw, str) else raw  # the pool's codec decodes json
    return _scans(plans[0]["Plan"])


def test_the_settle_statement_finds_holds_by_key_on_the_writers_connections(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    async def scenario() -> None:
        db = Database(fresh_pg, 2)
        try:
            async with db.raw() as conn:
                assert await conn.fetchval("SHOW enable_seqscan") == "off"
                writer = await _generic_plan(conn, settle_pg.STATEMENT)
            async with db.engine.connect() as general:
                raw = await general.get_raw_connection()
                conn = raw.driver_connection
                assert await conn.fetchval("SHOW enable_seqscan") == "on"
                other = await _generic_plan(conn, settle_pg.STATEMENT)
            # On a connection planned as any other, the empty table is read whole...
            assert ("Seq Scan", "holds") in other
            # ...on the writers', every read of holds (the hold taken, the holds seen) is by key.
            holds = {node for node, relation in writer if relation == "holds"}
            assert holds and "Seq Scan" not in holds, writer
            assert all(node != "Seq Scan" for node, _ in writer), writer
        finally:
            await db.dispose()

    asyncio.run(scenario())
