"""What taking a pooled connection for one group costs in CPU: a Core connection's checkout and
return (what the group writers did) against the pool's own connection (Database.raw with a
pool too small to keep one) and a kept one (Database.raw with the default pool), and a bare
asyncpg round trip for scale.

    python -m bench.checkout [--pg DSN] [--n 3000]
"""

import argparse
import os
import time

import asyncpg
import uvloop

from metering.db import Database


async def _cpu_us(n: int, once) -> float:
    for _ in range(100):  # warm: the pool's connection made, the statements prepared
        await once()
    start = time.process_time()
    for _ in range(n):
        await once()
    return (time.process_time() - start) / n * 1e6


async def measure(dsn: str, n: int) -> dict[str, float]:
    db = Database(dsn, 4)
    keeping = Database(dsn, 20)
    direct = await asyncpg.connect(dsn)
    try:

        async def core() -> None:
            async with db.engine.connect() as held:
                await held.get_raw_connection()

        async def pooled() -> None:
            async with db.raw():
                pass

        async def kept() -> None:
            async with keeping.raw():
                pass

        async def round_trip() -> None:
            await direct.fetchval("SELECT 1")

        return {
            "Core connection checkout and return": await _cpu_us(n, core),
            "pool's own connection (Database.raw, pool of 4)": await _cpu_us(n, pooled),
            "a kept connection (Database.raw, pool of 20)": await _cpu_us(n, kept),
            "asyncpg round trip (SELECT 1)": await _cpu_us(n, round_trip),
        }
    finally:
        await direct.close()
        await db.dispose()
        await keeping.dispose()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.checkout", description=__doc__.split("\n")[0])
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    p.add_argument("--n", type=int, default=3000)
    args = p.parse_args()
    for label, us in uvloop.run(measure(args.pg, args.n)).items():
        print(f"{label}: {us:.0f} µs of CPU each")


if __name__ == "__main__":
    main()
