"""What one PostgreSQL round trip and one committed INSERT cost on this machine: the floor
under the hold's INSERT and the settle's commit.

    python -m bench.commit [--pg DSN] [--n 500]
"""

import argparse
import asyncio
import os
import time
import uuid

import asyncpg


async def measure(dsn: str, n: int) -> dict[str, tuple[float, float]]:
    conn = await asyncpg.connect(dsn)
    table = f"bench_commit_{uuid.uuid4().hex[:8]}"
    await conn.execute(f"CREATE TABLE {table} (x int)")
    try:
        found = {}
        for label, sql in (
            ("round trip (SELECT 1)", "SELECT 1"),
            ("committed one-row INSERT", f"INSERT INTO {table} VALUES (1)"),
        ):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                await conn.execute(sql)
                times.append(time.perf_counter() - start)
            times.sort()
            found[label] = (times[n // 2] * 1000, times[n * 9 // 10] * 1000)
        return found
    finally:
        await conn.execute(f"DROP TABLE {table}")
        await conn.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.commit", description=__doc__.split("\n")[0])
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    p.add_argument("--n", type=int, default=500)
    args = p.parse_args()
    for label, (p50, p90) in asyncio.run(measure(args.pg, args.n)).items():
        print(f"{label}: p50 {p50:.3f} ms, p90 {p90:.3f} ms")


if __name__ == "__main__":
    main()
