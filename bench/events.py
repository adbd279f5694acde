"""Benchmark: POST /v1/events throughput (batches of 1, 100 and 1,000) and rerating 1M events,
on PostgreSQL.

    python -m bench.events                          # both parts, default sizes
    python -m bench.events --rerate-events 100000   # a smaller ledger to rerate
    python -m bench.events --no-rerate              # ingestion only

Creates a fresh PostgreSQL database (dropped at the end unless --keep), migrated as `metering
serve` would. Ingestion: `metering serve` as a subprocess, a team and user made through the
admin API (the user's budget limited, so every event charges a budget row), then --clients
threads post batches of each size, each event with a key of its own; events per second is
the events created over the wall time. Rerating: the ledger filled in SQL with
--rerate-events events of one model (bench.reports' generator, its rollups too), a price
correction recorded in the price history from before the first event (as a catalog entry with
`effective_from` is recorded), then metering.billing.rerate.rerate() over the whole range,
timed; a second rerate (nothing left to correct) timed too.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psycopg

from bench.procs import Process, free_port, metering_command
from bench.reports import generate
from metering import migrate
from metering.billing.rerate import rerate
from metering.db import Database

CATALOG = """\
[providers.sim-openai]
base_url = "http://127.0.0.1:9/openai/v1"
dialect = "openai"

[[models]]
name = "gpt-sim"
provider = "sim-openai"
upstream_model = "sim/gpt"
input_usd_per_mtok = "0.15"
cached_input_usd_per_mtok = "0.075"
output_usd_per_mtok = "0.60"
"""


def ingest(base: str, key: str, user_id: str, size: int, total: int, clients: int) -> dict:
    """`total` events in batches of `size` from `clients` threads; events created per second."""
    batches = total // size
    per_client = [batches // clients + (1 if i < batches % clients else 0) for i in range(clients)]
    created = [0] * clients
    errors: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def client(n: int) -> None:
        with httpx.Client(
            base_url=base, timeout=120, headers={"authorization": f"Bearer {key}"}
        ) as http:
            barrier.wait()
            for _ in range(per_client[n]):
                events = [
                    {
                        "idempotency_key": uuid.uuid4().hex,
                        "user_id": user_id,
                        "model": "gpt-sim",
                        "prompt_tokens": 1200,
                        "cached_tokens": 200,
                        "completion_tokens": 300,
                    }
                    for _ in range(size)
                ]
                response = http.post("/v1/events", json={"events": events})
                if response.status_code != 200:
                    errors.append(response.text[:200])
                    return
                created[n] += sum(r["status"] == "created" for r in response.json()["data"])

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"POST /v1/events failed: {errors[0]}")
    return {
        "batch": size,
        "events": sum(created),
        "requests": batches,
        "seconds": round(seconds, 2),
        "events_per_s": round(sum(created) / seconds),
        "requests_per_s": round(batches / seconds, 1),
    }


def run_ingest(url: str, args, workdir: Path) -> list[dict]:
    key = f"bench-{uuid.uuid4().hex}"
    port = free_port()
    (workdir / "metering.toml").write_text(CATALOG)
    env = {
        **os.environ,
        "METERING_DATABASE_URL": url,
        "METERING_ADMIN_KEY": key,
        "METERING_CONFIG": str(workdir / "metering.toml"),
    }
    argv = [*metering_command(), "serve", "--port", str(port), "--log-level", "warning"]
    server = Process("metering", argv, env, workdir, workdir)
    base = f"http://127.0.0.1:{port}"
    try:
        server.wait_http(f"{base}/healthz", timeout=120)
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}) as admin:
            team = admin.post("/v1/teams", json={"name": "bench", "credit_limit": "1000000"})
            team.raise_for_status()
            user = admin.post(
                "/v1/users",
                json={
                    "email": f"bench-{uuid.uuid4().hex[:8]}@example.com",
                    "name": "bench",
                    "team_id": team.json()["id"],
                    "credit_limit": "1000000",
                },
            )
            user.raise_for_status()
        user_id = user.json()["id"]
        out = []
        for size, total in ((1, args.events_1), (100, args.events_100), (1000, args.events_1000)):
            result = ingest(base, key, user_id, size, total, args.clients)
            print(f"  batch {size}: {result}", file=sys.stderr)
            out.append(result)
        return out
    finally:
        server.stop()


def run_rerate(url: str, events: int) -> dict:
    end = datetime.now(UTC)
    org = {"tokens": 1000, "users": 500, "teams": 50, "models": 1}
    t0 = time.perf_counter()
    generate(url, events, end, org)
    generated_s = time.perf_counter() - t0
    start = end - timedelta(days=31)
    with psycopg.connect(url, autocommit=True) as conn:
        # The correction, as reloading a catalog entry with effective_from records it.
        conn.execute(
            "INSERT INTO prices (model, provider, upstream_model, input_price, cached_price,"
            " output_price, effective_from) VALUES ('gpt-sim', 'sim-openai', 'sim/gpt',"
            " 165000, 82500, 660000, %s)",
            (start,),
        )

    async def timed() -> tuple[dict, float, dict, float]:
        db = Database(url, pool_size=2)
        try:
            t1 = time.perf_counter()
            first = await rerate(
                db,
                provider="sim-openai",
                model="gpt-sim",
                start=start,
                end=end + timedelta(seconds=1),
                reason="bench: price +10%",
            )
            t2 = time.perf_counter()
            second = await rerate(
                db,
                provider="sim-openai",
                model="gpt-sim",
                start=start,
                end=end + timedelta(seconds=1),
                reason="bench: again",
            )
            t3 = time.perf_counter()
            return first.out(), t2 - t1, second.out(), t3 - t2
        finally:
            await db.dispose()

    first, first_s, second, second_s = asyncio.run(timed())
    return {
        "events": events,
        "generated_s": round(generated_s, 1),
        "rerate": first,
        "rerate_s": round(first_s, 1),
        "events_per_s": round(events / first_s),
        "again": second,
        "again_s": round(second_s, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.events", description=__doc__.split("\n")[0])
    p.add_argument("--events-1", type=int, default=2_000, help="events sent one a batch")
    p.add_argument("--events-100", type=int, default=50_000)
    p.add_argument("--events-1000", type=int, default=100_000)
    p.add_argument("--clients", type=int, default=4, help="threads posting at once")
    p.add_argument("--rerate-events", type=int, default=1_000_000)
    p.add_argument("--no-rerate", action="store_true")
    p.add_argument("--no-ingest", action="store_true")
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG",
            os.environ.get("METERING_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ),
    )
    p.add_argument("--keep", action="store_true", help="keep the databases")
    args = p.parse_args(argv)
    base = args.pg.rsplit("/", 1)[0]
    results: dict = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-events-"))
    for part in ("ingest", "rerate"):
        if getattr(args, f"no_{part}"):
            continue
        name = f"metering_bench_{part}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = f"{base}/{name}"
        try:
            migrate.upgrade(url)
            if part == "ingest":
                results["ingest"] = run_ingest(url, args, workdir)
            else:
                results["rerate"] = run_rerate(url, args.rerate_events)
        finally:
            if not args.keep:
                with psycopg.connect(args.pg, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
