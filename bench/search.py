"""Benchmark: `q` on GET /v1/users over many rows, on PostgreSQL and SQLite.

    python -m bench.search                 # 100,000 users in 100 teams
    python -m bench.search --users 20000

Fills a fresh database of each kind (PostgreSQL at METERING_BENCH_PG, default
postgresql://postgres@127.0.0.1:5432/postgres, a database created and dropped here; a SQLite
file in a temporary directory) with users in bulk, starts the server on it, and times one page
(limit 50) of each kind of search, the median of 7 calls (PostgreSQL analyzed first, as
autovacuum would in time): a word every user's email holds, one
user's name, no match at all (every row read), an exact id, and a name within one team.
"""

import argparse
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
from sqlalchemy import create_engine, insert, text

from metering import migrate
from metering.db import sync_url
from metering.models import Team, User
from metering.settings import Catalog, Settings
from metering.testing import metering_server

KEY = "bench-admin-" + uuid.uuid4().hex
CALLS = 7
BATCH = 5000


def fill(url: str, users: int, teams: int) -> dict[str, str]:
    """Teams and users inserted in bulk; a few ids and names to search for."""
    now = datetime.now(UTC)
    team_ids = [f"team_{uuid.uuid4().hex}" for _ in range(teams)]
    engine = create_engine(sync_url(url))
    with engine.begin() as conn:
        conn.execute(
            insert(Team),
            [{"id": t, "name": f"team {n}", "created_at": now} for n, t in enumerate(team_ids)],
        )
        for start in range(0, users, BATCH):
            rows = [
                {
                    "id": f"user_{uuid.uuid4().hex}",
                    "email": f"person{n}@corp.example",
                    "name": f"Person {n:07d}",
                    "team_id": team_ids[n % teams],
                    "created_at": now,
                }
                for n in range(start, min(start + BATCH, users))
            ]
            conn.execute(insert(User), rows)
        last = conn.execute(User.__table__.select().order_by(User.id.desc()).limit(1)).first()
    if engine.dialect.name == "postgresql":  # the statistics autovacuum would gather in time
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE teams, users"))
    engine.dispose()
    assert last is not None
    return {"id": last.id, "name": last.name, "team": last.team_id}


def median_ms(http: httpx.Client, params: dict) -> tuple[float, int]:
    times, rows = [], 0
    for _ in range(CALLS):
        began = time.perf_counter()
        response = http.get("/v1/users", params={"limit": 50, **params})
        times.append((time.perf_counter() - began) * 1000)
        assert response.status_code == 200, response.text
        rows = len(response.json()["data"])
    return statistics.median(times), rows


def run(url: str, users: int, teams: int) -> list[tuple[str, float, int]]:
    migrate.upgrade(url)
    found = fill(url, users, teams)
    settings = Settings(database_url=url, admin_key=KEY, _env_file=None)
    server = metering_server(settings, Catalog(providers={}, models={}))
    cases = {
        "every email holds it (`corp.example`)": {"q": "corp.example"},
        "one user's name": {"q": found["name"].upper()},
        "no match (every row read)": {"q": "nobody-has-this"},
        "an exact id": {"q": found["id"]},
        "one user's name, team_id too": {"q": found["name"], "team_id": found["team"]},
        "no q (the page as before)": {},
    }
    try:
        with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {KEY}"}) as http:
            return [(name, *median_ms(http, params)) for name, params in cases.items()]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--teams", type=int, default=100)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    name = f"bench_search_{uuid.uuid4().hex[:8]}"
    parts = urlsplit(args.pg)
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    results = {}
    try:
        results["PostgreSQL"] = run(
            urlunsplit(parts._replace(path=f"/{name}")), args.users, args.teams
        )
        with tempfile.TemporaryDirectory() as tmp:
            results["SQLite"] = run(f"sqlite:///{Path(tmp) / 'm.db'}", args.users, args.teams)
    finally:
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(f"GET /v1/users?limit=50, {args.users:,} users: median of {CALLS} calls, ms (rows)\n")
    print("| search | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    for i, (case, _, _) in enumerate(next(iter(results.values()))):
        cells = [f"{rows[i][1]:.1f} ({rows[i][2]})" for rows in results.values()]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
