"""Benchmark: what the metering proxy adds to a chat completion, next to a direct call and the floor.

    python -m bench.run              # prints markdown tables
    python -m bench.run --write      # ... and replaces the generated section of BENCHMARKS.md
    python -m bench.run --litellm    # also LiteLLM's proxy (installed into its own virtualenv)

Starts, side by side, the simulated upstream (`python -m metering.sim`), the floor (a bare
passthrough on the proxy's own stack: bench/floor.py), `metering serve` on a fresh PostgreSQL
database (created and dropped here) and `metering serve` on a SQLite file, and with --litellm
LiteLLM's proxy. Then, from an asyncio/aiohttp load generator in this process, for each
concurrency and kind of request, the paths take turns batch by batch: direct to the sim, the
floor, ours on PostgreSQL (budgets on), ours on SQLite (budgets on), LiteLLM. Two more
scenarios follow: the hot budget (C=32 on one token against C=32 over 32 teams, each its own
token) and the paced stream (the sim waits 50 ms before answering and 5 ms between 20 chunks:
time to first byte). The ledger is checked at the end.
"""

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg

from bench import litellm_proxy, load, report
from bench.procs import (
    Process,
    cpu_of,
    cpu_seconds,
    free_port,
    metering_command,
    revision,
    start_sim,
    tree_cpu_seconds,
    tree_rss_kib,
)
from metering.db import SERVING_SETTINGS
from metering.testing import PgBouncer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt-sim"
SIM_KEY = "sim-key"
SIM_KEY_ENV = "BENCH_SIM_KEY"
# Large enough never to be reached by a run (a counter holds at most 9,223,372 USD).
BIG_LIMIT = "1000000"
# The paths, in the order of the tables; the direct row comes first, the others compare with it.
MODES = (
    "direct",
    "floor",
    "floor-commits",
    "floor-grouped",
    "pg",
    "pg-traced",
    "pg-base",
    "pg-nosync",
    "pg-pgbouncer",
    "pg-limits",
    "pg-end-users",
    "pg-end-user-budgets",
    "pg-off",
    "pg-responses",
    "sqlite",
    "litellm",
)
SERVER_OF = {
    "pg": "pg",
    "pg-traced": "pg-traced",
    "pg-base": "pg-base",
    "pg-nosync": "pg-nosync",
    "pg-pgbouncer": "pg-pgbouncer",
    "pg-limits": "pg",
    "pg-responses": "pg",
    "pg-end-users": "pg",
    "pg-end-user-budgets": "pg",
    "pg-off": "pg",
    "sqlite": "sqlite",
    "floor": "floor",
    "floor-commits": "floor-commits",
    "floor-grouped": "floor-grouped",
    "litellm": "litellm",
}
# --limits: rate and parallel limits on the token, its user and its team, far above any load.
FAR_LIMITS = {
    "rpm_limit": 100_000_000,
    "tpm_limit": 100_000_000_000,
    "max_parallel_requests": 100_000,
}
PACED = {"wait_ms": 50, "delay_ms": 5, "chunks": 20}
# pg-end-users and pg-end-user-budgets: each request made for one of this many end users, in turn.
END_USERS = 1000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--concurrency", default="1,16,64", help="comma-separated concurrency levels (1,16,64)"
    )
    p.add_argument(
        "--requests",
        default="1000,4000,4000",
        help="measured requests per path, one count per concurrency level (1000,4000,4000)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests before each batch (default max(20, 2*C))",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="split each scenario into this many batches, the paths taking turns (default 3)",
    )
    p.add_argument(
        "--batch-timeout",
        type=float,
        default=600,
        help="give up (exit 1) when one batch takes longer than this many seconds",
    )
    p.add_argument(
        "--modes",
        default="direct,floor,floor-commits,pg,sqlite",
        help="subset of direct,floor,floor-commits,floor-grouped,pg,pg-traced,pg-limits,"
        "pg-end-users,"
        "pg-end-user-budgets,pg-off,sqlite (floor-commits: the floor with a hold committed "
        "before the upstream call and an event before the answer ends; floor-grouped: the same "
        "written in groups, as ours writes them; pg-off: ours on PostgreSQL, budgets off; "
        "pg-limits: budgets and rate limits on; pg-end-users: an end user (x-metering-end-user, "
        f"{END_USERS} in turn) on every request; pg-end-user-budgets: the same, its team giving "
        "each end user a budget)",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help="also ours on PostgreSQL with rpm_limit, tpm_limit and max_parallel_requests set "
        "on the token, its user and its team, far above the load (the pg-limits mode)",
    )
    p.add_argument(
        "--traced",
        action="store_true",
        help="also ours on PostgreSQL with OpenTelemetry traces on, exported over OTLP/HTTP to "
        "a local receiver (bench/otlp_sink.py; the pg-traced mode)",
    )
    p.add_argument("--no-sqlite", action="store_true", help="leave out ours on SQLite")
    p.add_argument("--kinds", default="json,stream", help="subset of json,stream")
    p.add_argument("--tokens", type=int, default=20, help="completion tokens per answer")
    p.add_argument("--chunks", type=int, default=20, help="content chunks per streamed answer")
    p.add_argument(
        "--hot",
        default="32,4000",
        help="hot budget scenario: C,N (C on one token against C over C teams); 0 skips it",
    )
    p.add_argument(
        "--paced",
        default="16,320",
        help="paced stream scenario: C,N (50 ms to the first token, 5 ms between 20 chunks); "
        "0 skips it",
    )
    p.add_argument(
        "--litellm",
        action="store_true",
        help="also LiteLLM's proxy (pip install 'litellm[proxy]' into its own virtualenv under "
        f"{litellm_proxy.WORK} the first time)",
    )
    p.add_argument("--litellm-venv", type=Path, default=litellm_proxy.VENV)
    p.add_argument(
        "--litellm-share",
        type=float,
        default=0.25,
        help="LiteLLM's rows send this share of the others' request counts (it is slow)",
    )
    p.add_argument(
        "--pg",
        default=os.environ.get(
            "METERING_BENCH_PG",
            os.environ.get("METERING_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"),
        ),
        help="a PostgreSQL database to connect to for CREATE/DROP DATABASE",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="metering serve --workers N on PostgreSQL (CPU and RSS summed over its processes)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of this repository (git worktree add PATH REV): its server runs "
        "as a second ours on PostgreSQL (pg-base), taking turns with the others, to compare two "
        "trees in one run",
    )
    p.add_argument(
        "--nosync",
        action="store_true",
        help="also ours on a second PostgreSQL database whose commits do not wait for their "
        "WAL flush (ALTER DATABASE ... SET synchronous_commit = off; the pg-nosync mode): what "
        "the commits' fsync costs ours. A diagnosis, never a setting for production",
    )
    p.add_argument(
        "--pgbouncer",
        action="store_true",
        help="also ours on a second PostgreSQL database reached through PgBouncer in transaction "
        "mode (Debian's pgbouncer, `make pgbouncer`), with METERING_DATABASE_POOLER=pgbouncer "
        "(the pg-pgbouncer mode; the pooler's CPU is not counted)",
    )
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument(
        "--profile",
        type=Path,
        help="record ours on PostgreSQL with py-spy into PATH.postgresql.txt (collapsed "
        "stacks; summarize with python -m bench.hotspots). Slows the server: not for --write",
    )
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.requests = [int(n) for n in args.requests.split(",")]
    if len(args.requests) == 1:
        args.requests *= len(args.concurrency)
    if len(args.requests) != len(args.concurrency):
        p.error("--requests needs one count per --concurrency level")
    modes, kinds = set(args.modes.split(",")) - {""}, set(args.kinds.split(",")) - {""}
    if args.litellm:
        modes.add("litellm")
    if args.limits:
        modes.add("pg-limits")
    if args.nosync:
        modes.add("pg-nosync")
    if args.traced:
        modes.add("pg-traced")
    if args.pgbouncer:
        modes.add("pg-pgbouncer")
    if args.no_sqlite:
        modes.discard("sqlite")
    if args.baseline is not None:
        cli = args.baseline / "metering" / "cli"
        if not (cli.with_suffix(".py").is_file() or (cli / "__init__.py").is_file()):
            p.error(f"--baseline: no checkout of metering at {args.baseline}")
        modes.add("pg-base")
    elif "pg-base" in modes:
        p.error("the pg-base mode needs --baseline PATH")
    if modes - set(MODES) or kinds - {"json", "stream"}:
        p.error("unknown mode or kind")
    args.modes = [m for m in MODES if m in modes]
    args.kinds = [k for k in ("json", "stream") if k in kinds]
    args.hot = _pair(p, "--hot", args.hot)
    args.paced = _pair(p, "--paced", args.paced)
    if args.write and args.baseline:
        p.error("--baseline compares two trees: its figures are not for BENCHMARKS.md")
    if args.write and "pg-nosync" in modes:
        p.error("--nosync is a diagnosis: its figures are not for BENCHMARKS.md")
    if args.write and args.profile:
        p.error("--profile slows the server down: its figures are not for BENCHMARKS.md")
    return args


def _pair(p, name: str, value: str) -> tuple[int, int] | None:
    if value.strip() == "0":
        return None
    try:
        c, n = (int(x) for x in value.split(","))
    except ValueError:
        p.error(f"{name} takes C,N or 0")
    return c, n


# --- setup -------------------------------------------------------------------------------------


def catalog_toml(sim_port: int) -> str:
    return f"""\
[providers.sim]
base_url = "http://127.0.0.1:{sim_port}/openai/v1"
api_key_env = "{SIM_KEY_ENV}"
dialect = "openai"
timeout_s = 60

[[models]]
name = "{MODEL}"
provider = "sim"
upstream_model = "{MODEL}"
input_usd_per_mtok = "0.15"
output_usd_per_mtok = "0.60"
cached_input_usd_per_mtok = "0.075"
max_output_tokens = 4096
"""


def chat_body(
    stream: bool, tokens: int, chunks: int, direct: bool, delay_ms: int = 0, wait_ms: int = 0
) -> bytes:
    text = f"Benchmark request, please answer. sim:tokens={tokens}"
    if stream:
        text += f" sim:chunks={chunks}"
        if delay_ms:
            text += f" sim:delay_ms={delay_ms}"
    if wait_ms:
        text += f" sim:wait_ms={wait_ms}"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max(64, 2 * tokens),
        "stream": stream,
    }
    if stream and direct:
        # What the proxy sends upstream for a stream: it always asks for usage.
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def responses_body(chat: bytes) -> bytes:
    """A chat body's request through the Responses API (not stored: as Codex sends it)."""
    body = json.loads(chat)
    return json.dumps(
        {
            "model": body["model"],
            "input": body["messages"][0]["content"],
            "max_output_tokens": body["max_tokens"],
            "stream": body["stream"],
            "store": False,
        }
    ).encode()


class Admin:
    def __init__(self, url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=url, timeout=60, headers={"authorization": f"Bearer {key}"}
        )

    def ok(self, method: str, path: str, expect: int = 200, **kwargs) -> dict:
        response = self.http.request(method, path, **kwargs)
        if response.status_code != expect:
            raise RuntimeError(f"{method} {path}: HTTP {response.status_code} {response.text}")
        return response.json()

    def principal(self, limit: str | None) -> dict:
        """A team, a user in it and a token of the user, each with this limit (or none)."""
        tag = uuid.uuid4().hex[:8]
        team = self.ok(
            "POST",
            "/v1/teams",
            201,
            json={"name": f"bench-{tag}", "credit_limit": limit, "reset_interval": "never"},
        )
        user = self.ok(
            "POST",
            "/v1/users",
            201,
            json={
                "email": f"bench-{tag}@example.com",
                "name": "bench",
                "team_id": team["id"],
                "credit_limit": limit,
                "reset_interval": "never",
            },
        )
        token = self.ok(
            "POST",
            f"/v1/users/{user['id']}/tokens",
            201,
            json={"name": "bench", "credit_limit": limit, "reset_interval": "never"},
        )
        return {"team": team, "user": user, "token": token}

    def events(self, token_id: str) -> list[dict]:
        out, cursor = [], None
        while True:
            params = {"token_id": token_id, "limit": 1000}
            if cursor:
                params["cursor"] = cursor
            page = self.ok("GET", "/v1/usage", params=params)
            out.extend(page["data"])
            cursor = page["next_cursor"]
            if not cursor:
                return out


@contextlib.contextmanager
def postgres_database(admin_dsn: str):
    name = f"metering_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.conninfo_to_dict(admin_dsn)
    url["dbname"] = name
    host, port, user = url.get("host", "127.0.0.1"), url.get("port", 5432), url.get("user", "")
    password = f":{url['password']}" if url.get("password") else ""
    try:
        yield name, f"postgresql://{user}{password}@{host}:{port}/{name}"
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_backend_pids(admin_dsn: str, dbname: str) -> list[int]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        ).fetchall()
    return [row[0] for row in rows]


def pg_stat(admin_dsn: str, dbname: str, column: str) -> int:
    """A counter of pg_stat_database: `sessions` (PostgreSQL 14+) for pool churn, `deadlocks`."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT {column} FROM pg_stat_database WHERE datname = %s", (dbname,)
        ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def postgres_version(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        return conn.execute("SHOW server_version").fetchone()[0]


def lock_waits(admin_dsn: str, dbname: str) -> str:
    """What the database's sessions are waiting on, for a stalled run's error message."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'running'), count(*)"
            " FROM pg_stat_activity WHERE datname = %s GROUP BY 1, 2 ORDER BY 3 DESC",
            (dbname,),
        ).fetchall()
    return ", ".join(f"{n} {state} ({wait})" for state, wait, n in rows)


# --- the servers under test --------------------------------------------------------------------


@dataclass
class Server:
    """One server under test: the floor, LiteLLM, or ours on one database."""

    name: str
    process: Process
    base: str
    pg: tuple[str, str] | None = None  # (admin DSN, database) of ours on PostgreSQL
    admin: Admin | None = None
    principals: dict[str, dict] = field(default_factory=dict)
    request_ids: list[str] = field(default_factory=list)  # of every 2xx answer, warm-ups too
    failed: int = 0
    rss_start_kib: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid


def start_ours(
    args,
    backend: str,
    sim_port: int,
    tmp: Path,
    stack,
    source: Path | None = None,
    nosync: bool = False,
    traces_to: str | None = None,
    pooler: PgBouncer | None = None,
) -> Server:
    """Ours on `backend` ("pg" or "sqlite"); `source`: run another checkout's code (its
    metering package first on the path) instead of the installed one; `nosync`: on a database
    whose commits return before their WAL is flushed (pg-nosync); `traces_to`: an OTLP/HTTP
    endpoint its traces are exported to (pg-traced; the others trace nothing); `pooler`:
    through that PgBouncer (pg-pgbouncer)."""
    admin_key = "bench-admin-" + uuid.uuid4().hex
    pg = None
    workers = 1
    if backend == "pg":
        dbname, database_url = stack.enter_context(postgres_database(args.pg))
        pg = (args.pg, dbname)
        if nosync:
            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = off')
            with psycopg.connect(psycopg.conninfo.make_conninfo(args.pg, dbname=dbname)) as conn:
                setting = conn.execute("SHOW synchronous_commit").fetchone()[0]
            if setting != "off":
                raise RuntimeError(f"pg-nosync: synchronous_commit is {setting} on {dbname}")
        workers = args.workers
    else:
        database_url = f"sqlite:///{tmp / 'bench.db'}"
    config = tmp / "metering.toml"
    config.write_text(catalog_toml(sim_port))
    pooled = {}
    if pooler is not None and pg is not None:
        user = psycopg.conninfo.conninfo_to_dict(args.pg).get("user") or "postgres"
        pooled = {
            "METERING_DATABASE_URL": pooler.url(pg[1], str(user)),
            "METERING_DATABASE_POOLER": "pgbouncer",
            "METERING_DATABASE_DIRECT_URL": database_url,
        }
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "METERING_DATABASE_URL": database_url,
        **pooled,
        "METERING_ADMIN_KEY": admin_key,
        "METERING_CONFIG": str(config),
        SIM_KEY_ENV: SIM_KEY,
    }
    if traces_to is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = traces_to
        env["OTEL_SERVICE_NAME"] = "metering-bench"
    command = metering_command()
    if source is not None:
        env["PYTHONPATH"] = str(source.resolve())
        command = [sys.executable, "-m", "metering.cli"]
    name = (
        "pg-base"
        if source is not None
        else "pg-nosync"
        if nosync
        else "pg-traced"
        if traces_to
        else "pg-pgbouncer"
        if pooler
        else backend
    )
    # Ready when it knows this run's admin key: the port was free when chosen, but another
    # process may bind it first (and would answer /healthz as well); ours then exits, and is
    # started again on another port.
    admin_headers = {"authorization": f"Bearer {admin_key}"}
    for tries_left in reversed(range(3)):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        # cwd is the temp dir so no .env or metering.toml from the checkout is read.
        process = Process(
            f"metering-{name}",
            [*command, "serve", "--port", str(port), "--log-level", "warning"]
            + ["--workers", str(workers)],
            env,
            tmp,
            tmp,
        )
        stack.callback(process.stop)
        try:
            process.wait_http(f"{base}/v1/teams", headers=admin_headers, timeout=120)
            break
        except RuntimeError:
            if not tries_left or "address already in use" not in process.log_tail().lower():
                raise
    server = Server(name, process, base, pg=pg, admin=Admin(base, admin_key))
    server.principals["on"] = server.admin.principal(BIG_LIMIT)
    if "pg-off" in args.modes and backend == "pg":
        server.principals["off"] = server.admin.principal(None)
    if "pg-limits" in args.modes and backend == "pg":
        limited = server.admin.principal(BIG_LIMIT)
        for scope in ("team", "user", "token"):
            subject_id = limited[scope]["id"]
            server.admin.ok("PATCH", f"/v1/{scope}s/{subject_id}", json=FAR_LIMITS)
        server.principals["limits"] = limited
    if "pg-end-users" in args.modes and backend == "pg":
        server.principals["end-users"] = server.admin.principal(BIG_LIMIT)
    if "pg-end-user-budgets" in args.modes and backend == "pg":
        budgets = server.admin.principal(BIG_LIMIT)
        terms = {"end_user_credit_limit": BIG_LIMIT, "end_user_reset_interval": "monthly"}
        server.admin.ok("PATCH", f"/v1/teams/{budgets['team']['id']}", json=terms)
        server.principals["end-user-budgets"] = budgets
    if args.hot and backend == "pg":
        for i in range(args.hot[0]):
            server.principals[f"team-{i}"] = server.admin.principal(BIG_LIMIT)
    print(f"ours on {backend}: pid {process.pid} on {base}", file=sys.stderr)
    return server


def start_floor(
    sim_port: int, tmp: Path, stack, admin_dsn: str | None = None, grouped: bool = False
) -> Server:
    """The floor; with `admin_dsn`, the floor with commits (`grouped`: written in groups), on a
    database of its own."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor", "--port", str(port)]
    argv += ["--upstream", f"http://127.0.0.1:{sim_port}/openai/v1", "--key", SIM_KEY]
    name, pg = "floor", None
    if admin_dsn is not None:
        dbname, database_url = stack.enter_context(postgres_database(admin_dsn))
        argv += ["--commits", database_url] + (["--grouped"] if grouped else [])
        name, pg = "floor-grouped" if grouped else "floor-commits", (admin_dsn, dbname)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    process = Process(name, argv, env, tmp, tmp)
    stack.callback(process.stop)
    base = f"http://127.0.0.1:{port}"
    body = chat_body(False, 5, 1, True)
    deadline = time.monotonic() + 60
    while True:
        try:
            answer = httpx.post(f"{base}/v1/chat/completions", content=body, timeout=5)
            if answer.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or process.popen.poll() is not None:
            raise RuntimeError(f"the {name} did not start:\n{process.log_tail()}")
        time.sleep(0.1)
    print(f"{name}: pid {process.pid} on {base}", file=sys.stderr)
    server = Server(name, process, base, pg=pg)
    if pg is not None:  # this answer has its event too
        server.request_ids.append(answer.headers["x-request-id"])
    return server


def start_litellm(args, sim_port: int, tmp: Path, stack) -> Server:
    try:
        litellm_proxy.ensure(args.litellm_venv)
    except litellm_proxy.Unavailable as exc:
        raise SystemExit(str(exc)) from None
    config = tmp / "litellm.yaml"
    config.write_text(
        litellm_proxy.config_yaml(MODEL, f"http://127.0.0.1:{sim_port}/openai/v1", SIM_KEY)
    )
    port = free_port()
    process = Process(
        "litellm",
        litellm_proxy.argv(args.litellm_venv, config, port),
        litellm_proxy.env(dict(os.environ)),
        tmp,
        tmp,
    )
    stack.callback(process.stop)
    base = f"http://127.0.0.1:{port}"
    process.wait_http(f"{base}/health/liveliness", timeout=180)
    print(
        f"LiteLLM {litellm_proxy.version(args.litellm_venv)}: pid {process.pid} on {base}",
        file=sys.stderr,
    )
    return Server("litellm", process, base)


# --- measuring ---------------------------------------------------------------------------------


class Sampler:
    """CPU of a server, the sim and the database's backends around the measured part of each
    batch, summed over the batches of one row."""

    def __init__(self, server: Server | None, sim_pid: int) -> None:
        self.server, self.sim_pid = server, sim_pid
        self.pg = server.pg if server else None
        self.start: dict = {}
        self.delta: dict = {"pg_connections": 0, "server": 0.0, "sim": 0.0, "pg": 0.0}

    def _pg_cpu(self) -> dict[int, float]:
        return cpu_of(pg_backend_pids(*self.pg)) if self.pg else {}

    def __call__(self, phase: str) -> None:
        server_pid = self.server.pid if self.server else None
        if phase == "start":
            # The database's backends first: listing them costs a connection of our own.
            self.start = {
                "sessions": pg_stat(*self.pg, "sessions") if self.pg else None,
                "pg": self._pg_cpu(),
                "server": tree_cpu_seconds(server_pid) if server_pid else 0.0,
                "sim": cpu_seconds(self.sim_pid),
            }
            return
        server = tree_cpu_seconds(server_pid) if server_pid else 0.0
        sim = cpu_seconds(self.sim_pid)
        pg_end = self._pg_cpu()
        # Backends that closed during the run are lost; new ones count from zero.
        pg = sum(cpu - self.start["pg"].get(pid, 0.0) for pid, cpu in pg_end.items())
        d = self.delta
        if self.pg:
            # Ours go to the admin database, not this one. The counter may lag by ~1 s.
            d["pg_connections"] += pg_stat(*self.pg, "sessions") - self.start["sessions"]
            d["pg"] += pg
        d["rss_kib"] = tree_rss_kib(server_pid) if server_pid else None
        d["server"] += server - self.start["server"]
        d["sim"] += sim - self.start["sim"]


def stop_profiler(profiler: subprocess.Popen) -> None:
    """py-spy writes its file on SIGINT."""
    if profiler.poll() is None:
        profiler.send_signal(signal.SIGINT)
        try:
            profiler.wait(60)
        except subprocess.TimeoutExpired:
            profiler.kill()


def target_for(
    mode: str,
    servers: dict[str, Server],
    sim_port: int,
    stream: bool,
    args,
    paced: bool = False,
    principal: str = "on",
) -> load.Target:
    body_args = (args.tokens, PACED["chunks"] if paced else args.chunks)
    extra = {"delay_ms": PACED["delay_ms"], "wait_ms": PACED["wait_ms"]} if paced else {}
    json_type = {"content-type": "application/json"}
    if mode == "direct":
        return load.Target(
            f"http://127.0.0.1:{sim_port}/openai/v1/chat/completions",
            {"authorization": f"Bearer {SIM_KEY}", **json_type},
            chat_body(stream, *body_args, True, **extra),
            stream,
        )
    server = servers[SERVER_OF[mode]]
    url = f"{server.base}/v1/chat/completions"
    if mode in ("floor", "floor-commits", "floor-grouped"):
        # The floor relays the body unchanged: it gets what the proxy would send upstream.
        return load.Target(url, json_type, chat_body(stream, *body_args, True, **extra), stream)
    body = chat_body(stream, *body_args, False, **extra)
    if mode == "pg-responses":
        # The same request through the Responses API: bridged to the same chat upstream.
        token = server.principals[principal]["token"]["token"]
        headers = {"authorization": f"Bearer {token}", **json_type}
        return load.Target(
            f"{server.base}/v1/responses",
            headers,
            responses_body(body),
            stream,
            ends=b"event: response.completed",
        )
    if mode == "litellm":
        headers = {"authorization": f"Bearer {litellm_proxy.MASTER_KEY}", **json_type}
        return load.Target(url, headers, body, stream)
    if mode == "pg-off":
        principal = "off"
    if mode == "pg-limits":
        principal = "limits"
    if mode in ("pg-end-users", "pg-end-user-budgets"):
        token = server.principals[mode.removeprefix("pg-")]["token"]["token"]
        spread = [
            {
                "authorization": f"Bearer {token}",
                "x-metering-end-user": f"customer-{n}",
                **json_type,
            }
            for n in range(END_USERS)
        ]
        return load.Target(url, spread[0], body, stream, spread=spread)
    if principal == "spread":
        spread = [
            {"authorization": f"Bearer {p['token']['token']}", **json_type}
            for name, p in server.principals.items()
            if name.startswith("team-")
        ]
        return load.Target(url, spread[0], body, stream, spread=spread)
    token = server.principals[principal]["token"]["token"]
    return load.Target(url, {"authorization": f"Bearer {token}", **json_type}, body, stream)


def batch_ratios(rps: list[float], floor_rps: list[float]) -> list[float]:
    """A path's throughput over the floor's, batch by batch: batch i of each path ran in the
    same round, next to each other, so each ratio compares two batches that saw the machine
    alike. Their spread is how far one run's ratio can be trusted on a noisy machine."""
    return [r / f for r, f in zip(rps, floor_rps, strict=False) if f > 0]


def measure(
    args,
    scenario: str,
    targets: dict[str, load.Target],
    servers: dict[str, Server],
    sim: Process,
    c: int,
    n: int,
    stream: bool,
) -> list[dict]:
    """The targets take turns, batch by batch, so a burst of load from elsewhere on the machine
    falls on all of them alike; each batch warms up its own connections."""
    warmup = args.warmup if args.warmup is not None else max(20, 2 * c)
    rounds = max(1, min(args.rounds, n // max(c, 1)))
    samplers = {}
    for key in targets:
        server = servers.get(SERVER_OF.get(key.split(":")[0], ""))
        samplers[key] = Sampler(server, sim.pid)
    results: dict[str, load.LoadResult] = {}
    batch_rps: dict[str, list[float]] = {key: [] for key in targets}
    for i in range(rounds):
        for key, target in targets.items():
            mode = key.split(":")[0]
            total = max(c, round(n * args.litellm_share)) if mode == "litellm" else n
            batch = total // rounds + (1 if i < total % rounds else 0)
            server = servers.get(SERVER_OF.get(mode, ""))
            try:
                measured, warm = load.run(
                    target,
                    batch,
                    c,
                    warmup,
                    on_measure=samplers[key],
                    deadline_s=args.batch_timeout,
                )
            except load.Stalled as exc:
                where = ""
                if server and server.pg:
                    where = f"; PostgreSQL sessions: {lock_waits(*server.pg)}"
                tail = server.process.log_tail() if server else ""
                raise SystemExit(
                    f"{scenario} {key} C={c}: {exc}{where}\nlog tail:\n{tail}"
                ) from None
            batch_rps[key].append(measured.rps)
            results[key] = results[key].add(measured) if key in results else measured
            if server is not None and (server.admin is not None or server.pg is not None):
                for result in (warm, measured):
                    if result is not None:
                        server.request_ids += result.request_ids
                        server.failed += result.failed
    rows = []
    for key, measured in results.items():
        mode = key.split(":")[0]
        delta = samplers[key].delta
        ok = max(measured.ok, 1)
        row = {
            "scenario": scenario,
            "key": key,
            "mode": mode,
            "stream": stream,
            "concurrency": c,
            "requests": measured.requests,
            "failed": measured.failed,
            "statuses": {str(k): v for k, v in measured.statuses.items()},
            "errors": measured.errors,
            "elapsed_s": measured.elapsed_s,
            "rps": measured.rps,
            "p50_ms": measured.percentile_ms(50),
            "p95_ms": measured.percentile_ms(95),
            "p99_ms": measured.percentile_ms(99),
            "ttfb_p50_ms": measured.ttfb_percentile_ms(50),
            "ttfb_p99_ms": measured.ttfb_percentile_ms(99),
            "client_cpu_ms": measured.client_cpu_s * 1000 / ok,
            "sim_cpu_ms": delta["sim"] * 1000 / ok,
            "server_cpu_ms": delta["server"] * 1000 / ok if mode != "direct" else None,
            "pg_cpu_ms": delta["pg"] * 1000 / ok if samplers[key].pg else None,
            "pg_connections_opened": delta["pg_connections"] if samplers[key].pg else None,
            "server_rss_kib": delta.get("rss_kib"),
            "batch_rps": batch_rps[key],
        }
        rows.append(row)
        print(
            f"[{scenario}] {'stream' if stream else 'json':6} {key:12} C={c:<3} "
            f"{row['rps']:8.0f} req/s  p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f} ms"
            + (f"  ttfb p50 {row['ttfb_p50_ms']:6.2f}" if stream else "")
            + (f"  CPU {row['server_cpu_ms']:.2f} ms/req" if row["server_cpu_ms"] else "")
            + f"  failed {row['failed']}"
            + (f"  {measured.errors[:2]}" if measured.errors else ""),
            file=sys.stderr,
        )
    direct = next((r for r in rows if r["mode"] == "direct"), None)
    floor = next((r for r in rows if r["mode"] == "floor"), None)
    for row in rows:
        if direct is not None and row is not direct:
            row["added_p50_ms"] = row["p50_ms"] - direct["p50_ms"]
            row["added_p99_ms"] = row["p99_ms"] - direct["p99_ms"]
            row["added_ttfb_p50_ms"] = row["ttfb_p50_ms"] - direct["ttfb_p50_ms"]
        if floor is not None and row["mode"] not in ("direct", "floor"):
            row["vs_floor"] = row["rps"] / floor["rps"] if floor["rps"] else float("nan")
            row["vs_floor_batches"] = batch_ratios(row["batch_rps"], floor["batch_rps"])
    return rows


def check_floor_commits(server: Server) -> list[tuple[bool, str]]:
    """The floor with commits wrote one event per answer, and no hold is left."""
    admin_dsn, dbname = server.pg
    with psycopg.connect(psycopg.conninfo.make_conninfo(admin_dsn, dbname=dbname)) as conn:
        events = {row[0] for row in conn.execute("SELECT id FROM floor_events")}
        holds = conn.execute("SELECT count(*) FROM floor_holds").fetchone()[0]
    ids = set(server.request_ids)
    label = report.SERVER_LABEL[server.name]
    return [
        (
            events == ids and len(ids) == len(server.request_ids),
            f"{label}: {len(events)} events for {len(server.request_ids)} 2xx answers, ids "
            "equal to the answers' x-request-id",
        ),
        (holds == 0, f"{label}: {holds} holds left"),
    ]


def check_end_users(server: Server, label: str, events: list[dict]) -> list[tuple[bool, str]]:
    """pg-end-users: every event of its token names its end user; pg-end-user-budgets: each end
    user's budget spent the sum of its events' costs, nothing left reserved."""
    checks = []
    for name in ("end-users", "end-user-budgets"):
        principal = server.principals.get(name)
        if principal is None:
            continue
        own = [e for e in events if e["token_id"] == principal["token"]["id"]]
        named = sum(1 for e in own if (e["end_user"] or "").startswith("customer-"))
        checks.append(
            (named == len(own), f"{label}: {named} of {len(own)} {name} events name their end user")
        )
        if name != "end-user-budgets":
            continue
        by_end_user: dict[str, Decimal] = {}
        for e in own:
            by_end_user[e["end_user"]] = by_end_user.get(e["end_user"], Decimal(0)) + Decimal(
                e["cost"]
            )
        wrong = []
        team_id = principal["team"]["id"]
        for end_user, cost in by_end_user.items():
            budget = server.admin.ok("GET", f"/v1/teams/{team_id}/end-users/{end_user}/budget")
            if Decimal(budget["spent"]) != cost or Decimal(budget["reserved"]) != 0:
                wrong.append(
                    f"{end_user} spent {budget['spent']} reserved {budget['reserved']} != {cost}"
                )
        checks.append(
            (
                not wrong,
                f"{label}: spent on each of the {len(by_end_user)} end users' budgets = the sum of "
                "its events' costs, reserved 0"
                + (f"; not: {', '.join(wrong[:5])}" if wrong else ""),
            )
        )
    return checks


def start_sink(tmp: Path, stack) -> str:
    """The OTLP/HTTP receiver of pg-traced's spans (bench/otlp_sink.py): its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "bench.otlp_sink", "--port", str(port)]
    process = Process("otlp-sink", argv, env, tmp, tmp)
    stack.callback(process.stop)
    base = f"http://127.0.0.1:{port}"
    process.wait_http(f"{base}/stats")
    return base


def check_traces(server: Server, sink: str, wait_s: float = 30.0) -> list[tuple[bool, str]]:
    """Every answer of the traced server exported as its five spans (the last batch may wait
    for the batch processor's next export, every 5 s)."""
    answered = len(server.request_ids)
    deadline = time.monotonic() + wait_s
    while True:
        stats = httpx.get(f"{sink}/stats", timeout=5).json()
        if stats["requests"] >= answered or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ok = stats["requests"] == answered and stats["spans"] == 5 * answered
    return [
        (
            ok,
            f"ours on PostgreSQL, traced: {stats['requests']} request spans and "
            f"{stats['spans']} spans in all for {answered} proxied 2xx answers (5 each: the "
            f"request, admission, hold, upstream, settle), in {stats['exports']} OTLP exports "
            f"of {stats['bytes'] / 1e6:.1f} MB",
        )
    ]


def check(server: Server) -> list[tuple[bool, str]]:
    """The ledger against what the load generator saw, and every hold released."""
    label = report.SERVER_LABEL.get(server.name, server.name)
    checks = []
    events = []
    for principal in server.principals.values():
        events += server.admin.events(principal["token"]["id"])
    ids = server.request_ids
    event_ids = [e["id"] for e in events]
    checks.append(
        (
            len(events) == len(ids) and set(event_ids) == set(ids),
            f"{label}: {len(events)} ledger events for {len(ids)} proxied 2xx answers over "
            f"{len(server.principals)} token{'s' if len(server.principals) > 1 else ''}, one per answer, ids equal to the answers' "
            "x-request-id" + (f" ({server.failed} requests failed)" if server.failed else ""),
        )
    )
    bad = [e for e in events if e["status"] != "ok" or e["usage_source"] != "reported"]
    checks.append((not bad, f"{label}: every event status ok with reported usage ({len(bad)} not)"))
    reserved_nonzero, spent_wrong = [], []
    by_token: dict[str, Decimal] = {}
    for e in events:
        by_token[e["token_id"]] = by_token.get(e["token_id"], Decimal(0)) + Decimal(e["cost"])
    for name, principal in server.principals.items():
        cost = by_token.get(principal["token"]["id"], Decimal(0))
        for scope, key in (("tokens", "token"), ("users", "user"), ("teams", "team")):
            budget = server.admin.ok("GET", f"/v1/{scope}/{principal[key]['id']}/budget")
            if Decimal(budget["reserved"]) != 0:
                reserved_nonzero.append(f"{name} {key} {budget['reserved']}")
            if Decimal(budget["spent"]) != cost:
                spent_wrong.append(f"{name} {key} {budget['spent']} != {cost}")
    scopes = 3 * len(server.principals)
    checks.append(
        (
            not reserved_nonzero,
            f"{label}: reserved 0 on all {scopes} budgets (token, user and team of each token)"
            + (f"; not: {', '.join(reserved_nonzero[:5])}" if reserved_nonzero else ""),
        )
    )
    total = sum(by_token.values(), Decimal(0))
    checks.append(
        (
            not spent_wrong,
            f"{label}: spent on each of the {scopes} budgets = the sum of its events' costs "
            f"({total} USD in all)"
            + (f"; not: {', '.join(spent_wrong[:5])}" if spent_wrong else ""),
        )
    )
    limited = server.principals.get("limits")
    if limited is not None:
        in_flight = {
            key: server.admin.ok("GET", f"/v1/{key}s/{limited[key]['id']}/limits")["in_flight"]
            for key in ("token", "user", "team")
        }
        checks.append(
            (
                not any(in_flight.values()),
                f"{label}: rate limits: no request in flight left on the token, its user and its "
                f"team ({in_flight})",
            )
        )
    checks += check_end_users(server, label, events)
    log = server.process.log_path.read_text(errors="replace")
    errors = sum(1 for line in log.splitlines() if "ERROR" in line or "Traceback" in line)
    checks.append((errors == 0, f"{label}: server log: {errors} error lines"))
    if server.pg:
        time.sleep(1.5)  # backends publish their statistics about once a second
        deadlocks = pg_stat(*server.pg, "deadlocks")
        checks.append(
            (deadlocks == 0, f"{label}: PostgreSQL deadlocks in the bench database: {deadlocks}")
        )
    return checks


# --- main --------------------------------------------------------------------------------------


def machine(args) -> dict:
    cpu_model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": postgres_version(args.pg),
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def run(args, meta: dict) -> dict:
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="metering-bench-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        sim, sim_port = start_sim(tmp, stack, SIM_KEY)
        print(f"sim: pid {sim.pid} on port {sim_port}", file=sys.stderr)
        servers: dict[str, Server] = {}
        if "floor" in args.modes:
            servers["floor"] = start_floor(sim_port, tmp, stack)
        if "floor-commits" in args.modes:
            commits_tmp = tmp / "floor-commits"
            commits_tmp.mkdir()
            servers["floor-commits"] = start_floor(sim_port, commits_tmp, stack, args.pg)
        if "floor-grouped" in args.modes:
            grouped_tmp = tmp / "floor-grouped"
            grouped_tmp.mkdir()
            servers["floor-grouped"] = start_floor(
                sim_port, grouped_tmp, stack, args.pg, grouped=True
            )
        if {"pg", "pg-off", "pg-limits", "pg-end-users", "pg-end-user-budgets"} & set(
            args.modes
        ) or args.hot:
            pg_tmp = tmp / "pg"
            pg_tmp.mkdir()
            servers["pg"] = start_ours(args, "pg", sim_port, pg_tmp, stack)
        if "pg-base" in args.modes:
            base_tmp = tmp / "pg-base"
            base_tmp.mkdir()
            servers["pg-base"] = start_ours(
                args, "pg", sim_port, base_tmp, stack, source=args.baseline
            )
        if "pg-nosync" in args.modes:
            nosync_tmp = tmp / "pg-nosync"
            nosync_tmp.mkdir()
            servers["pg-nosync"] = start_ours(args, "pg", sim_port, nosync_tmp, stack, nosync=True)
        sink = None
        if "pg-traced" in args.modes:
            traced_tmp = tmp / "pg-traced"
            traced_tmp.mkdir()
            sink = start_sink(traced_tmp, stack)
            servers["pg-traced"] = start_ours(
                args, "pg", sim_port, traced_tmp, stack, traces_to=sink
            )
        if "pg-pgbouncer" in args.modes:
            pooled_tmp = tmp / "pg-pgbouncer"
            pooled_tmp.mkdir()
            server = psycopg.conninfo.conninfo_to_dict(args.pg)
            pooler = PgBouncer(
                host=str(server.get("host") or "127.0.0.1"),
                port=int(server.get("port") or 5432),
                # The serving settings, on each server connection (docs/operator/pgbouncer.md).
                connect_query="; ".join(f"SET {k} = {v}" for k, v in SERVING_SETTINGS.items()),
            ).start()
            stack.callback(pooler.stop)
            servers["pg-pgbouncer"] = start_ours(
                args, "pg", sim_port, pooled_tmp, stack, pooler=pooler
            )
        if "sqlite" in args.modes:
            sqlite_tmp = tmp / "sqlite"
            sqlite_tmp.mkdir()
            servers["sqlite"] = start_ours(args, "sqlite", sim_port, sqlite_tmp, stack)
        if "litellm" in args.modes:
            servers["litellm"] = start_litellm(args, sim_port, tmp, stack)
            meta["litellm"] = litellm_proxy.version(args.litellm_venv)
        for server in servers.values():
            server.rss_start_kib = tree_rss_kib(server.pid)

        profiler = None
        if args.profile and "pg" in servers:
            out = args.profile.with_name(f"{args.profile.name}.postgresql.txt")
            # --gil: only the thread holding the GIL is sampled, so a thread waiting (the event
            # loop in epoll, an idle worker thread) is not counted as time spent.
            py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
            profiler = subprocess.Popen(
                [py_spy, "record", "--pid", str(servers["pg"].pid), "--rate", "250"]
                + [
                    "--format",
                    "raw",
                    "--gil",
                    "--nonblocking",
                    "--subprocesses",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(stop_profiler, profiler)
            time.sleep(1)

        started = time.monotonic()
        for c, n in zip(args.concurrency, args.requests, strict=True):
            for kind in args.kinds:
                stream = kind == "stream"
                targets = {m: target_for(m, servers, sim_port, stream, args) for m in args.modes}
                rows += measure(args, "matrix", targets, servers, sim, c, n, stream)
        if args.hot:
            c, n = args.hot
            targets = {
                f"pg:{p}": target_for("pg", servers, sim_port, False, args, principal=p)
                for p in ("on", "spread")
            }
            rows += measure(args, "hot", targets, servers, sim, c, n, False)
        if args.paced:
            c, n = args.paced
            paced_modes = [
                m
                for m in args.modes
                if m
                not in (
                    "pg-off",
                    "pg-limits",
                    "pg-end-users",
                    "pg-end-user-budgets",
                    "pg-base",
                    "pg-nosync",
                    "pg-traced",
                    "pg-pgbouncer",
                )
            ]
            targets = {
                m: target_for(m, servers, sim_port, True, args, paced=True) for m in paced_modes
            }
            rows += measure(args, "paced", targets, servers, sim, c, n, True)
        meta["measure_s"] = time.monotonic() - started

        if profiler is not None:
            stop_profiler(profiler)
        memory = {
            name: {"start_kib": server.rss_start_kib, "end_kib": tree_rss_kib(server.pid)}
            for name, server in servers.items()
        }
        checks = []
        for server in servers.values():
            if server.admin is not None:
                checks += check(server)
            elif server.pg is not None:
                checks += check_floor_commits(server)
        if sink is not None:
            checks += check_traces(servers["pg-traced"], sink)
        proxied = {n: len(s.request_ids) for n, s in servers.items() if s.admin is not None}
    return {"rows": rows, "memory": memory, "checks": checks, "proxied": proxied}


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = {
        "command": "python -m bench.run" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": revision(),
        **machine(args),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "tokens": args.tokens,
        "chunks": args.chunks,
        "hot": args.hot,
        "paced": args.paced,
        "paced_shape": PACED,
        "modes": args.modes,
        "workers": args.workers,
        "litellm_share": args.litellm_share,
    }
    started = time.monotonic()
    result = run(args, meta)
    meta["total_s"] = time.monotonic() - started
    generated = report.markdown(meta, result)
    print(generated)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, **result}, indent=2, default=str))
    if args.write:
        report.write_benchmarks(ROOT / "BENCHMARKS.md", generated)
        print(f"updated {ROOT / 'BENCHMARKS.md'}", file=sys.stderr)
    failed = [text for ok, text in result["checks"] if not ok]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
