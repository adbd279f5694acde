"""Benchmark: the two ways of keeping the rollups, through the ledger's writer, on SQLite and on
PostgreSQL (docs/decisions/rollups.md).

    python -m bench.rollup_ways              # 3 runs of 200 transactions a case

- direct: each transaction inserts its events and upserts every rollup row they add to (the
  way the general path kept them until the decision: bench.rollups.direct, kept as the
  reference);
- pending: each transaction inserts its events and their increments to rollup_pending
  (metering.ledger.writer.append_many, as the service writes them now), and `rollup.fold`
  moves them into the rollups afterwards: its time is counted too, per event folded.

For each database, group size (1 event a transaction: a settle alone; 16: a settle group) and
writers at once (1; 8 on PostgreSQL, each a transaction of its own at a time, so the direct way
waits on the rollup rows another holds until it commits), it times every transaction from
BEGIN to COMMIT, the two ways taking turns run by run. Each event is a new request of one of
200 tokens (of 10 teams) over 10 models in the current hour (bench.settle_rollups' events), so
most rollup rows are updated, not inserted, as at a steady load. Prints, per case, the median over the runs of each run's median
and p90 transaction, the events written per second, and the fold's time per 1,000 events.
The databases are the run's own: a new PostgreSQL database (dropped at the end) and a SQLite
file in a temporary directory, migrated as `metering serve` would.
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench.rollups import direct
from bench.settle_rollups import event
from metering import migrate
from metering.db import Database
from metering.ledger import rollup, writer
from metering.ledger.event import Event

Write = Callable[[Any, list[Event]], Awaitable[None]]


WAYS: dict[str, Write] = {"direct": direct, "pending": writer.append_many}


async def _run(db: Database, write: Write, group: int, writers: int, transactions: int) -> dict:
    """`writers` tasks, each writing `transactions` transactions of `group` events in turn."""
    times: list[float] = []

    async def one(w: int) -> None:
        for n in range(transactions):
            now = datetime.now(UTC)
            events = [event((w * transactions + n) * group + k, now) for k in range(group)]
            t0 = time.perf_counter()
            async with db.begin() as conn:
                await write(conn, events)
            times.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(w) for w in range(writers)))
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    folded = await rollup.fold(db, rounds=10_000)
    fold_s = time.perf_counter() - t1
    times.sort()
    written = writers * transactions * group
    return {
        "median_ms": statistics.median(times),
        "p90_ms": times[int(len(times) * 0.9)],
        "events_per_s": written / wall,
        # The fold's time per 1,000 events (the direct way: an empty fold's).
        "fold_ms_per_1000": fold_s * 1000 * 1000 / written if folded else 0.0,
    }


async def measure(url: str, cases: list[tuple[int, int]], runs: int, transactions: int) -> dict:
    db = Database(url, pool_size=8)
    out: dict[tuple[int, int, str], list[dict]] = {}
    try:
        await _run(db, direct, 4, 1, 30)  # warm-up: statements prepared, rows there
        await _run(db, writer.append_many, 4, 1, 30)
        for group, writers in cases:
            for _ in range(runs):
                for name, write in WAYS.items():
                    result = await _run(db, write, group, writers, transactions)
                    out.setdefault((group, writers, name), []).append(result)
    finally:
        await db.dispose()
    return {
        key: {m: statistics.median(r[m] for r in results) for m in results[0]}
        for key, results in out.items()
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rollup_ways", description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--transactions", type=int, default=200, help="per writer, run and case")
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    args = p.parse_args(argv)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/rollup_ways.db"
        migrate.upgrade(url)
        results["sqlite"] = asyncio.run(
            measure(url, [(1, 1), (16, 1)], args.runs, args.transactions)
        )
    name = f"metering_bench_rollups_{uuid.uuid4().hex[:8]}"
    url = f"{args.pg.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        migrate.upgrade(url)
        cases = [(1, 1), (16, 1), (1, 8), (16, 8)]
        results["postgresql"] = asyncio.run(measure(url, cases, args.runs, args.transactions))
    finally:
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    command = "python -m bench.rollup_ways" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    print(f"`{command}`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.2f}:")
    print()
    print(
        "| database | events a transaction | writers | way | median ms | p90 ms | events/s "
        "| fold ms per 1,000 events |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for dialect, by_case in results.items():
        for (group, writers, way), r in by_case.items():
            print(
                f"| {dialect} | {group} | {writers} | {way} | {r['median_ms']:.2f} "
                f"| {r['p90_ms']:.2f} | {r['events_per_s']:,.0f} "
                f"| {r['fold_ms_per_1000']:.1f} |"
            )


if __name__ == "__main__":
    main()
