"""PostgreSQL's CPU for each statement of the one-statement settle path, by group size: a
group's hold INSERT (metering.budgets.settle_pg.insert_holds) and its settle statement, whole
and without some of its parts, so that what each part costs shows. bench.run measures the
whole path; this measures where PostgreSQL's share of it goes.

    python -m bench.statements [--pg DSN] [--groups 1,4,8] [--n 1000]
        [--ledger 3000000 [--ids ordered|random]]

Each statement runs on its own connection, with the serving pool's settings, against a new
database (dropped after): leased holds of one token, its user and its team, as the proxy
writes them. The CPU is the backend's own, read from /proc/PID/schedstat around each
statement, so PostgreSQL must run on this machine. A committed one-row INSERT into a table of
one integer is measured the same way, for scale: what any statement that commits costs.

`--ledger N` first fills the ledger with N events (copies of one, with ids of their own), as a
ledger in service holds millions, and each variant starts right after a CHECKPOINT: the WAL
each request writes (`pg_current_wal_insert_lsn` around the timed groups) then counts the
whole index pages a first change after a checkpoint writes. `--ids random` makes the requests'
ids (and the filled events') random, as before ids were time-ordered (metering.ids), to
compare the two.
"""

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import asyncpg
import psycopg

from bench.run import postgres_database
from metering import migrate
from metering.budgets import settle_pg
from metering.budgets.reserve import HoldSpec, hold_json, hold_row, reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle import hold_additions
from metering.budgets.settle_queue import settle
from metering.budgets.views import new_budget
from metering.db import SERVING_SETTINGS, Database, Prepared, utcnow
from metering.ids import time_ordered
from metering.ledger.charge import Allowance, Usage
from metering.ledger.event import Event
from metering.ledger.outcome import Attribution, Outcome, event_for
from metering.ledger.tables import LedgerEvent
from metering.money import usd_to_pico

# The settle statement whole, then without parts of it (each named by what it leaves out).
VARIANTS = {
    "whole": ["take", "charge", "crossed", "events", "pending"],
    "no alert check": ["take", "charge", "events", "pending"],
    "no rollup increment": ["take", "charge", "crossed", "events"],
    "no budget or lease charge": ["take", "events", "pending"],
    "holds taken only": ["take"],
}


def statement_of(parts: list[str]) -> Prepared:
    """The settle statement made of some of settle_pg.PARTS only (each part needs those before
    it that it reads: charge take's, crossed charge's, pending events'): for measuring what
    each costs. Without `crossed` it returns the holds taken alone."""
    result = settle_pg.RESULT
    if "crossed" not in parts:
        result = "\nSELECT (SELECT array_agg(id) FROM ok) AS ok"
    return Prepared("WITH " + ",\n".join(settle_pg.PARTS[name] for name in parts) + result)


def random_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def ordered_id() -> str:
    return time_ordered("req")


IDS = {"ordered": ordered_id, "random": random_id}

# N copies of the ledger's one event with ids of their own, made in SQL: time-ordered ones
# older than any the run makes, in their order, or random ones.
_FILL_IDS = {
    "ordered": "'req_' || lpad(to_hex(%(since)s + g), 12, '0') || substr(md5(g::text), 1, 20)",
    "random": "'req_' || md5(g::text || random()::text)",
}


def _spec(subjects: dict[str, str], make_id: Callable[[], str] = ordered_id) -> HoldSpec:
    billing = Attribution(
        id=make_id(),
        token_id=subjects["token"],
        user_id=subjects["user"],
        team_id=subjects["team"],
        model="gpt-sim",
        provider="sim-openai",
        upstream_model="sim/gpt",
        stream=False,
        input_price=150_000,
        cached_price=75_000,
        output_price=600_000,
        prompt_bound=100,
    )
    return HoldSpec(
        billing,
        prompt_cost=billing.prompt_cost(),
        token_cost=billing.output_price,
        max_tokens=50,
        model_max_output=4096,
    )


def _event(spec: HoldSpec) -> Event:
    """The event of a completion of 10 prompt and 20 completion tokens."""
    usage = Usage(prompt_tokens=10, completion_tokens=20, total_tokens=30)
    return event_for(
        spec.billing,
        Outcome(http_status=200, usage=usage),
        started_at=utcnow(),
        latency_ms=5,
        allowance=Allowance.of(spec.billing, None),
        prompt_tokens=lambda: 0,
        text_tokens=len,
    )


def _cpu_reader(pid: int) -> Callable[[], int]:
    path = Path(f"/proc/{pid}/schedstat")
    if not path.exists():
        raise SystemExit(f"no {path}: bench.statements reads PostgreSQL's backends on this machine")
    return lambda: int(path.read_text().split()[0])  # nanoseconds on a CPU


async def _leases(db: Database, subjects: dict[str, str]) -> dict[str, str]:
    """Budgets for the three subjects, far above what the run spends, and a lease of each taken
    by one request through the service, as the proxy takes them: scope -> lease id."""
    async with db.transaction() as session:
        for scope, subject in subjects.items():
            session.add(new_budget(subject, scope, usd_to_pico(Decimal(10**6)), "never", utcnow()))
    budgets = BudgetRuntime(db, lease_share=8, hold_ttl_s=3600)
    spec = _spec(subjects)
    reservation = await reserve(budgets, spec, ttl_s=3600, leases=budgets.leases)
    if not await settle(budgets.settles, _event(spec), reservation):
        raise SystemExit("the first request did not settle")
    return {scope: budgets.leases.leases[subject].id for scope, subject in subjects.items()}


class Meter:
    """One connection with the serving pool's settings, and its backend's CPU per statement."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.cpu = _cpu_reader(conn.get_server_pid())

    async def run(self, sql: str, args: list, fetch: bool = False) -> tuple[int, object]:
        before = self.cpu()
        if fetch:
            row = await self.conn.fetchrow(sql, *args)
        else:
            row = await self.conn.execute(sql, *args)
        return self.cpu() - before, row


async def _group(
    meter: Meter, subjects, leases, size: int, parts: list[str], make_id=ordered_id
) -> tuple[int, int]:
    """One group of `size` requests: its holds inserted, then settled by the statement made of
    `parts`. Returns the two statements' CPU in nanoseconds."""
    specs = [_spec(subjects, make_id) for _ in range(size)]
    now = utcnow()
    rows = [hold_row(spec, spec.amount(50), now, 3600, leases) for spec in specs]
    insert = settle_pg.insert_holds(tuple(rows[0]))
    held, _ = await meter.run(insert.sql, insert.args({"new_holds": hold_json(rows)}))
    events, holds, adds = [], [], []
    for spec, row in zip(specs, rows, strict=True):
        event = _event(spec)
        hold = settle_pg.Expected(
            row["id"],
            row["token_id"],
            row["user_id"],
            row["team_id"],
            row["amount"],
            True,
            row["token_lease"],
            row["user_lease"],
            row["team_lease"],
        )
        event = event.capped(hold.amount)
        events.append(event)
        holds.append(hold)
        adds += [(hold.id, *added) for added in hold_additions(hold, event.cost)]
    statement = statement_of(parts)
    params = settle_pg.parameters(events, holds, adds)
    settled, row = await meter.run(statement.sql, statement.args(params), fetch=True)
    if len(row["ok"] or ()) != size:
        raise SystemExit(f"the settle statement took {len(row['ok'] or ())} of {size} holds")
    return held, settled


def fill_ledger(dsn: str, events: int, ids: str) -> None:
    """The ledger's one event copied `events` times, each with an id of its own."""
    names = ", ".join(c.name for c in LedgerEvent.__table__.columns if c.name != "id")
    with psycopg.connect(dsn, autocommit=True) as conn:
        since = time.time_ns() // 1_000_000 - 10 * events - 10**7
        conn.execute(
            f"INSERT INTO ledger_events (id, {names}) "
            f"SELECT {_FILL_IDS[ids] % {'since': since}}, {names} "
            f"FROM (SELECT * FROM ledger_events LIMIT 1) e, generate_series(1, {events}) g"
        )
        conn.execute("VACUUM ANALYZE ledger_events")


async def _wal(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn"))


async def measure(
    dsn: str, groups: list[int], n: int, ledger: int = 0, ids: str = "ordered"
) -> dict:
    make_id = IDS[ids]
    db = Database(dsn, 4)
    conn = await asyncpg.connect(dsn, server_settings=SERVING_SETTINGS)
    try:
        suffix = uuid.uuid4().hex[:12]
        subjects = {"token": f"tok_{suffix}", "user": f"user_{suffix}", "team": f"team_{suffix}"}
        leases = await _leases(db, subjects)
        if ledger:
            await asyncio.to_thread(fill_ledger, dsn, ledger, ids)
        meter = Meter(conn)
        await conn.execute("CREATE TABLE bench_one (x int)")
        total = 0
        for _ in range(n):
            spent, _ = await meter.run("INSERT INTO bench_one VALUES (1)", [])
            total += spent
        found: dict = {
            "committed one-row INSERT": total / n / 1000,
            "ledger": ledger,
            "ids": ids,
            "groups": {},
        }
        for size in groups:
            by_variant = {}
            for name, parts in VARIANTS.items():
                for _ in range(10):  # warm: the statements prepared, their generic plans made
                    await _group(meter, subjects, leases, size, parts, make_id)
                if ledger:
                    await conn.execute("CHECKPOINT")
                wal = await _wal(conn)
                held = settled = 0
                for _ in range(n):
                    h, s = await _group(meter, subjects, leases, size, parts, make_id)
                    held, settled = held + h, settled + s
                wal = (await _wal(conn) - wal) / n / size
                by_variant[name] = (held / n / 1000, settled / n / 1000, wal)
            found["groups"][size] = by_variant
        return found
    finally:
        await conn.close()
        await db.dispose()


def report(found: dict) -> str:
    ledger = f"{found['ledger']:,} events filled in" if found["ledger"] else "an empty ledger"
    lines = [
        f"A committed one-row INSERT: {found['committed one-row INSERT']:.0f} µs of PostgreSQL CPU.",
        f"Ids {found['ids']}; {ledger}.",
        "",
        "| group | hold INSERT µs | " + " | ".join(f"settle, {v} µs" for v in VARIANTS) + " |"
        " whole, per request µs | whole, WAL bytes per request |",
        "| ---: | ---: | " + " | ".join("---:" for _ in VARIANTS) + " | ---: | ---: |",
    ]
    for size, by_variant in found["groups"].items():
        holds, settled, wal = by_variant["whole"]
        cells = " | ".join(f"{by_variant[v][1]:.0f}" for v in VARIANTS)
        per_request = (holds + settled) / size
        lines.append(f"| {size} | {holds:.0f} | {cells} | {per_request:.0f} | {wal:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.statements", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="a PostgreSQL database to connect to for CREATE/DROP DATABASE",
    )
    p.add_argument("--groups", default="1,4,8", help="requests per group, comma-separated")
    p.add_argument("--n", type=int, default=1000, help="groups measured per size and statement")
    p.add_argument(
        "--ledger", type=int, default=0, help="events to fill the ledger with first (0: none)"
    )
    p.add_argument(
        "--ids", choices=sorted(IDS), default="ordered", help="the requests' ids (and the filled)"
    )
    args = p.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    if not groups or min(groups) < 1 or max(groups) > 64 or not 1 <= args.n <= 100_000:
        p.error("--groups: sizes from 1 to 64; --n: from 1 to 100,000")
    if not 0 <= args.ledger <= 100_000_000:
        p.error("--ledger: from 0 to 100,000,000 events")
    with postgres_database(args.pg) as (_, url):
        migrate.upgrade(url)
        print(report(asyncio.run(measure(url, groups, args.n, args.ledger, args.ids))))


if __name__ == "__main__":
    main()
