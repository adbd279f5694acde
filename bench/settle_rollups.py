"""Benchmark: what the coarser rollups add to settle's transaction.

    python -m bench.settle_rollups                 # 400 transactions a case, groups of 1 and 16

On a fresh PostgreSQL database (dropped at the end), migrated as `metering serve` would, it
times the transaction settle writes its events in (the events' INSERT and the rollup upserts,
then COMMIT): with spend_hourly only (as before the coarser rollups), with every rollup in one
statement each, with every rollup in one statement (bench.rollups.direct, as settle wrote
them until the rollups were kept by folding alone), and with the increments to rollup_pending
(metering.ledger.writer.append_many, as settle writes them now; folded later, not timed here:
bench.rollup_ways times it), the four taking turns transaction by transaction, for a group of
one event (a settle alone) and of 16 (a settle group). Each event
is a new request of one of 200 tokens over 10 models in the current hour, so most upserts update
a row already there, as at a steady load. Prints the median and p90 per transaction.
"""

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime

import psycopg
from sqlalchemy.dialects.postgresql import insert as pg_insert

from bench.rollups import direct
from metering import migrate
from metering.db import Database
from metering.ledger import rollup, writer
from metering.ledger.event import Event

TOKENS, MODELS = 200, 10


def event(i: int, now: datetime) -> Event:
    tok = i % TOKENS
    return Event(
        id=f"req_{uuid.uuid4().hex}",
        created_at=now,
        started_at=now,
        token_id=f"tok_{tok}",
        user_id=f"usr_{tok % 100}",
        team_id=f"team_{tok % 10}",
        model=f"model-{i % MODELS}",
        provider="sim-openai",
        upstream_model="sim/gpt",
        upstream_id=None,
        stream=False,
        status="ok",
        http_status=200,
        finish_reason="stop",
        prompt_tokens=100,
        completion_tokens=20,
        total_tokens=120,
        cached_tokens=0,
        text_tokens=None,
        reasoning_tokens=None,
        audio_tokens=None,
        image_tokens=None,
        video_tokens=None,
        accepted_prediction_tokens=None,
        rejected_prediction_tokens=None,
        usage_source="reported",
        input_price=150_000,
        cached_price=75_000,
        output_price=600_000,
        cost=100 * 150_000 + 20 * 600_000,
        ttft_ms=10,
        latency_ms=20,
        error=None,
        usage_anomaly=None,
        max_tokens_clamped=None,
        uncharged=0,
    )


async def hourly_only(session, events: list[Event]) -> None:
    """The write before the coarser rollups: the events and their spend_hourly rows."""
    await session.execute(writer._INSERT, [e.params() for e in events])
    rows = [rollup.row_for(e) for e in events]
    await session.execute(UPSERTS[rollup.HOURLY], rollup.summed(rollup.HOURLY, rows))


async def one_statement_each(session, events: list[Event]) -> None:
    """Every rollup, one upsert statement each (one round trip each)."""
    await session.execute(writer._INSERT, [e.params() for e in events])
    rows = [rollup.row_for(e) for e in events]
    for each in rollup.ROLLUPS:
        await session.execute(UPSERTS[each], rollup.summed(each, rows))


UPSERTS = {each: rollup._upsert(pg_insert, each) for each in rollup.ROLLUPS}
CASES = {
    "spend_hourly only (before)": hourly_only,
    "every rollup, one statement each": one_statement_each,
    "every rollup, one statement": direct,
    "rollup_pending (append_many)": writer.append_many,
}


async def measure(url: str, transactions: int) -> dict:
    db = Database(url, pool_size=2)
    times: dict[tuple[int, str], list[float]] = {}
    counter = 0
    cases = list(CASES.items())
    try:
        for group in (1, 16):
            for n in range(transactions * len(cases) + 30):
                case, write = cases[n % len(cases)]
                now = datetime.now(UTC)
                events = [event(counter + k, now) for k in range(group)]
                counter += group
                t0 = time.perf_counter()
                async with db.transaction() as session:
                    await write(session, events)
                if n >= 30:  # after a warm-up
                    times.setdefault((group, case), []).append((time.perf_counter() - t0) * 1000)
    finally:
        await db.dispose()
    out = {}
    for (group, case), values in times.items():
        values.sort()
        out[(group, case)] = {
            "n": len(values),
            "median_ms": statistics.median(values),
            "p90_ms": values[int(len(values) * 0.9)],
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.settle_rollups", description=__doc__)
    p.add_argument("--transactions", type=int, default=400, help="per case")
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    args = p.parse_args(argv)
    name = f"metering_bench_settle_{uuid.uuid4().hex[:8]}"
    url = f"{args.pg.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        migrate.upgrade(url)
        results = asyncio.run(measure(url, args.transactions))
    finally:
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    command = "python -m bench.settle_rollups" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    print(f"`{command}`, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.2f}:")
    print()
    print("| events in the transaction | rollups written | transactions | median ms | p90 ms |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for (group, case), r in results.items():
        print(f"| {group} | {case} | {r['n']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} |")


if __name__ == "__main__":
    main()
