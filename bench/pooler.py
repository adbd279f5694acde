"""One statement with parameters, many times, through PgBouncer in transaction mode and directly:
what each way to run it without a statement kept by name costs (`python -m bench.pooler`).

- asyncpg, kept: asyncpg's statement cache, named statements (direct only: what the service
  does without METERING_DATABASE_POOLER);
- asyncpg, unnamed: statement_cache_size=0, each run Parse, Describe and Flush, then Bind,
  Execute and Sync (two exchanges; what the service does with the setting);
- psycopg, unnamed: psycopg 3 with prepare_threshold=None, each run Parse, Bind, Describe,
  Execute and Sync in one exchange.

Each way runs on C connections at once, each statement its own transaction (autocommit, a key
lookup: no commit to wait for), on a fresh database; the ways take turns round by round. Figures: statements per second over all
connections, and the median time of one."""

import argparse
import asyncio
import statistics
import time
import uuid

import asyncpg
import psycopg

from metering.testing import PgBouncer

# A key lookup: no commit to wait for, so what is measured is the protocol and the planning.
STATEMENT = "SELECT n FROM counters WHERE id = {a} AND n >= {b}"


async def _asyncpg(url: str, c: int, n: int, cache: bool) -> tuple[float, list[float]]:
    sql = STATEMENT.format(a="$1", b="$2")
    conns = [await asyncpg.connect(url, statement_cache_size=100 if cache else 0) for _ in range(c)]
    times: list[float] = []

    async def run(conn, k: int) -> None:
        for i in range(n):
            started = time.perf_counter()
            await conn.fetchval(sql, (k * n + i) % 1000, 0)
            times.append(time.perf_counter() - started)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(run(conn, k) for k, conn in enumerate(conns)))
        elapsed = time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    return elapsed, times


async def _psycopg(url: str, c: int, n: int) -> tuple[float, list[float]]:
    sql = STATEMENT.format(a="%(id)s", b="%(n)s")
    conns = [
        await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=None)
        for _ in range(c)
    ]
    times: list[float] = []

    async def run(conn, k: int) -> None:
        for i in range(n):
            started = time.perf_counter()
            cursor = await conn.execute(sql, {"id": (k * n + i) % 1000, "n": 0})
            await cursor.fetchone()
            times.append(time.perf_counter() - started)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(run(conn, k) for k, conn in enumerate(conns)))
        elapsed = time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    return elapsed, times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pooler", description=__doc__.split("\n")[0])
    p.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--statements", type=int, default=2000, help="per way and concurrency")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    name = f"metering_pooler_{uuid.uuid4().hex[:12]}"
    server = psycopg.conninfo.conninfo_to_dict(args.pg)
    host, port = str(server.get("host") or "127.0.0.1"), int(server.get("port") or 5432)
    user = str(server.get("user") or "postgres")
    direct = f"postgresql://{user}@{host}:{port}/{name}"
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    bouncer = PgBouncer(host=host, port=port).start()
    pooled = bouncer.url(name, user)
    try:
        with psycopg.connect(direct, autocommit=True) as conn:
            conn.execute("CREATE TABLE counters (id bigint PRIMARY KEY, n bigint NOT NULL)")
            conn.execute("INSERT INTO counters SELECT i, i FROM generate_series(0, 999) i")
        ways = {
            "asyncpg, kept, direct": lambda c, n: _asyncpg(direct, c, n, True),
            "asyncpg, unnamed, direct": lambda c, n: _asyncpg(direct, c, n, False),
            "asyncpg, unnamed, PgBouncer": lambda c, n: _asyncpg(pooled, c, n, False),
            "psycopg, unnamed, direct": lambda c, n: _psycopg(direct, c, n),
            "psycopg, unnamed, PgBouncer": lambda c, n: _psycopg(pooled, c, n),
        }
        print("| way | C | statements/s | p50 ms |")
        print("| --- | ---: | ---: | ---: |")
        for c in [int(x) for x in args.concurrency.split(",")]:
            per = max(1, args.statements // c // args.rounds)
            results: dict[str, tuple[float, list[float]]] = {way: (0.0, []) for way in ways}
            for _ in range(args.rounds):
                for way, run in ways.items():
                    elapsed, times = asyncio.run(run(c, per))
                    spent, all_times = results[way]
                    results[way] = (spent + elapsed, all_times + times)
            for way, (spent, times) in results.items():
                rate = len(times) / spent
                p50 = statistics.median(times) * 1000
                print(f"| {way} | {c} | {rate:,.0f} | {p50:.2f} |")
    finally:
        bouncer.stop()
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
