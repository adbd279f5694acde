"""PostgreSQL's CPU for each statement of the one-statement settle path, by group size: a
group's hold INSERT (metering.budgets.settle_pg.insert_holds) and its settle statement, whole
and without some of its parts, so that what each part costs shows. bench.run measures the
whole path; this measures where PostgreSQL's share of it goes.

    python -m bench.statements [--pg DSN] [--groups 1,4,8] [--n 1000]

Each statement runs on its own connection, with the serving pool's settings, against a new
database (dropped after): leased holds of one token, its user and its team, as the proxy
writes them. The CPU is the backend's own, read from /proc/PID/schedstat around each
statement, so PostgreSQL must run on this machine. A committed one-row INSERT into a table of
one integer is measured the same way, for scale: what any statement that commits costs.
"""

import argparse
import asyncio
import os
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import asyncpg

from bench.run import postgres_database
from metering import migrate
from metering.budgets import settle_pg
from metering.budgets.leases import LeaseBook
from metering.budgets.service import (
    HoldSpec,
    hold_additions,
    hold_json,
    hold_row,
    new_budget,
    reserve,
    settle,
)
from metering.db import SERVING_SETTINGS, Database, utcnow
from metering.ledger.charge import Limits, Usage
from metering.ledger.event import Event
from metering.ledger.outcome import Billing, Outcome, event_for
from metering.money import usd_to_pico

# The settle statement whole, then without parts of it (each named by what it leaves out).
VARIANTS = {
    "whole": ["take", "charge", "crossed", "events", "pending"],
    "no alert check": ["take", "charge", "events", "pending"],
    "no rollup increment": ["take", "charge", "crossed", "events"],
    "no budget or lease charge": ["take", "events", "pending"],
    "holds taken only": ["take"],
}


def _spec(subjects: dict[str, str]) -> HoldSpec:
    billing = Billing(
        id=f"req_{uuid.uuid4().hex}",
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
        limits=Limits.of(spec.billing, None),
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
    book = LeaseBook(db, share=8, ttl_s=3600, trusted=lambda: True)
    spec = _spec(subjects)
    reservation = await reserve(db, spec, ttl_s=3600, leases=book)
    if not await settle(db, _event(spec), reservation):
        raise SystemExit("the first request did not settle")
    return {scope: book.leases[subject].id for scope, subject in subjects.items()}


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


async def _group(meter: Meter, subjects, leases, size: int, parts: list[str]) -> tuple[int, int]:
    """One group of `size` requests: its holds inserted, then settled by the statement made of
    `parts`. Returns the two statements' CPU in nanoseconds."""
    specs = [_spec(subjects) for _ in range(size)]
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
        event.cap(hold.amount)
        events.append(event)
        holds.append(hold)
        adds += [(hold.id, *added) for added in hold_additions(hold, event.cost)]
    statement = settle_pg.statement_of(parts)
    params = settle_pg.parameters(events, holds, adds)
    settled, row = await meter.run(statement.sql, statement.args(params), fetch=True)
    if len(row["ok"] or ()) != size:
        raise SystemExit(f"the settle statement took {len(row['ok'] or ())} of {size} holds")
    return held, settled


async def measure(dsn: str, groups: list[int], n: int) -> dict:
    db = Database(dsn, 4)
    conn = await asyncpg.connect(dsn, server_settings=SERVING_SETTINGS)
    try:
        suffix = uuid.uuid4().hex[:12]
        subjects = {"token": f"tok_{suffix}", "user": f"user_{suffix}", "team": f"team_{suffix}"}
        leases = await _leases(db, subjects)
        meter = Meter(conn)
        await conn.execute("CREATE TABLE bench_one (x int)")
        total = 0
        for _ in range(n):
            spent, _ = await meter.run("INSERT INTO bench_one VALUES (1)", [])
            total += spent
        found: dict = {"committed one-row INSERT": total / n / 1000, "groups": {}}
        for size in groups:
            by_variant = {}
            for name, parts in VARIANTS.items():
                for _ in range(10):  # warm: the statements prepared, their generic plans made
                    await _group(meter, subjects, leases, size, parts)
                held = settled = 0
                for _ in range(n):
                    h, s = await _group(meter, subjects, leases, size, parts)
                    held, settled = held + h, settled + s
                by_variant[name] = (held / n / 1000, settled / n / 1000)
            found["groups"][size] = by_variant
        return found
    finally:
        await conn.close()
        await db.dispose()


def report(found: dict) -> str:
    lines = [
        f"A committed one-row INSERT: {found['committed one-row INSERT']:.0f} µs of PostgreSQL CPU.",
        "",
        "| group | hold INSERT µs | " + " | ".join(f"settle, {v} µs" for v in VARIANTS) + " |"
        " whole, per request µs |",
        "| ---: | ---: | " + " | ".join("---:" for _ in VARIANTS) + " | ---: |",
    ]
    for size, by_variant in found["groups"].items():
        holds = by_variant["whole"][0]
        cells = " | ".join(f"{by_variant[v][1]:.0f}" for v in VARIANTS)
        per_request = (holds + by_variant["whole"][1]) / size
        lines.append(f"| {size} | {holds:.0f} | {cells} | {per_request:.0f} |")
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
    args = p.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    if not groups or min(groups) < 1 or max(groups) > 64 or not 1 <= args.n <= 100_000:
        p.error("--groups: sizes from 1 to 64; --n: from 1 to 100,000")
    with postgres_database(args.pg) as (_, url):
        migrate.upgrade(url)
        print(report(asyncio.run(measure(url, groups, args.n))))


if __name__ == "__main__":
    main()
