"""Benchmark: what the metering proxy adds to a chat completion, next to a direct call.

    python -m bench.run            # PostgreSQL; prints a markdown table
    python -m bench.run --write    # ... and replaces the generated section of BENCHMARKS.md
    python -m bench.run --sqlite   # also the same against a SQLite file

Starts the simulated upstream (`python -m metering.sim`) and `metering serve` as subprocesses
on a fresh PostgreSQL database (created and dropped here), makes one team/user/token without
limits ("budgets off") and one with limits too large to be hit ("budgets on"), then runs each
scenario (direct to the sim, proxy budgets off, proxy budgets on; non-stream and stream; each
concurrency) from an asyncio/aiohttp load generator in this process. Every row of one run is
measured on the same machine minutes apart, so compare rows, not absolute figures across runs.
"""

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg

from bench import load, report
from bench.procs import (
    Process,
    cpu_of,
    cpu_seconds,
    free_port,
    metering_command,
    tree_cpu_seconds,
    tree_rss_kib,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gpt-sim"
SIM_KEY_ENV = "BENCH_SIM_KEY"
# Large enough never to be reached by a run (a counter holds at most 9,223,372 USD).
BIG_LIMIT = "1000000"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--concurrency", default="1,32", help="comma-separated concurrency levels (default 1,32)"
    )
    p.add_argument(
        "--requests",
        default="300,2000",
        help="measured requests per scenario, one per concurrency level (default 300,2000)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests before each scenario (default max(30, 4*C))",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="split each scenario into this many batches, the scenarios of one kind and "
        "concurrency taking turns (default 3)",
    )
    p.add_argument(
        "--batch-timeout",
        type=float,
        default=600,
        help="give up (exit 1) when one batch takes longer than this many seconds",
    )
    p.add_argument("--modes", default="direct,off,on", help="subset of direct,off,on")
    p.add_argument("--kinds", default="json,stream", help="subset of json,stream")
    p.add_argument("--tokens", type=int, default=20, help="completion tokens per answer")
    p.add_argument("--chunks", type=int, default=20, help="content chunks per streamed answer")
    p.add_argument(
        "--delay-ms",
        type=int,
        default=0,
        help="the sim's pause between stream chunks (default 0: the proxy's cost stands alone)",
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
        help="metering serve --workers N (CPU and RSS are summed over its processes)",
    )
    p.add_argument("--sqlite", action="store_true", help="also run against a SQLite file")
    p.add_argument("--no-postgres", action="store_true", help="skip PostgreSQL (with --sqlite)")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument(
        "--profile",
        type=Path,
        help="record the metering server with py-spy into PATH.<backend>.txt (collapsed "
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
    if modes - {"direct", "off", "on"} or kinds - {"json", "stream"}:
        p.error("unknown mode or kind")
    # The direct row comes first: the proxied rows are compared with it.
    args.modes = [m for m in ("direct", "off", "on") if m in modes]
    args.kinds = [k for k in ("json", "stream") if k in kinds]
    if args.sqlite and args.workers > 1:
        p.error("SQLite serves one process: --workers needs PostgreSQL only")
    if args.write and args.profile:
        p.error("--profile slows the server down: its figures are not for BENCHMARKS.md")
    return args


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


def chat_body(stream: bool, tokens: int, chunks: int, direct: bool, delay_ms: int = 0) -> bytes:
    text = f"Benchmark request, please answer. sim:tokens={tokens}"
    if stream:
        text += f" sim:chunks={chunks}"
        if delay_ms:
            text += f" sim:delay_ms={delay_ms}"
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


def pg_sessions(admin_dsn: str, dbname: str) -> int:
    return pg_stat(admin_dsn, dbname, "sessions")


def postgres_version(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        return conn.execute("SHOW server_version").fetchone()[0]


# --- one backend -------------------------------------------------------------------------------


class Sampler:
    """CPU of the server, the sim and the database's backends around the measured part."""

    def __init__(self, server_pid: int, sim_pid: int, pg: tuple[str, str] | None) -> None:
        self.server_pid, self.sim_pid, self.pg = server_pid, sim_pid, pg
        self.start: dict = {}
        # Summed over the scenario's batches.
        self.delta: dict = {"pg_connections": 0, "server": 0.0, "sim": 0.0, "pg": 0.0}

    def _pg_cpu(self) -> dict[int, float]:
        return cpu_of(pg_backend_pids(*self.pg)) if self.pg else {}

    def __call__(self, phase: str) -> None:
        if phase == "start":
            # The database's backends first: listing them costs a connection of our own.
            self.start = {
                "sessions": pg_sessions(*self.pg) if self.pg else None,
                "pg": self._pg_cpu(),
                "server": tree_cpu_seconds(self.server_pid),
                "sim": cpu_seconds(self.sim_pid),
            }
            return
        server, sim = tree_cpu_seconds(self.server_pid), cpu_seconds(self.sim_pid)
        pg_end = self._pg_cpu()
        # Backends that closed during the run are lost; new ones count from zero.
        pg = sum(cpu - self.start["pg"].get(pid, 0.0) for pid, cpu in pg_end.items())
        sessions = pg_sessions(*self.pg) if self.pg else None
        d = self.delta
        # Ours go to the admin database, not this one. The counter may lag by ~1 s.
        d["pg_connections"] = (
            d["pg_connections"] + sessions - self.start["sessions"] if self.pg else None
        )
        d["rss_kib"] = tree_rss_kib(self.server_pid)
        d["server"] += server - self.start["server"]
        d["sim"] += sim - self.start["sim"]
        d["pg"] = d["pg"] + pg if self.pg else None


def stop_profiler(profiler: subprocess.Popen) -> None:
    """py-spy writes its file on SIGINT."""
    if profiler.poll() is None:
        profiler.send_signal(signal.SIGINT)
        try:
            profiler.wait(60)
        except subprocess.TimeoutExpired:
            profiler.kill()


def lock_waits(admin_dsn: str, dbname: str) -> str:
    """What the database's sessions are waiting on, for a stalled run's error message."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'running'), count(*)"
            " FROM pg_stat_activity WHERE datname = %s GROUP BY 1, 2 ORDER BY 3 DESC",
            (dbname,),
        ).fetchall()
    return ", ".join(f"{n} {state} ({wait})" for state, wait, n in rows)


def run_backend(args, backend: str, sim: Process, sim_port: int, tmp: Path, stack) -> dict:
    admin_key = "bench-admin-" + uuid.uuid4().hex
    pg = None
    if backend == "postgresql":
        dbname, database_url = stack.enter_context(postgres_database(args.pg))
        pg = (args.pg, dbname)
        label = "PostgreSQL"
    else:
        database_url = f"sqlite:///{tmp / 'bench.db'}"
        label = "SQLite"
    config = tmp / "metering.toml"
    config.write_text(catalog_toml(sim_port))
    env = {
        **os.environ,
        "METERING_DATABASE_URL": database_url,
        "METERING_ADMIN_KEY": admin_key,
        "METERING_CONFIG": str(config),
        SIM_KEY_ENV: "sim-key",
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # cwd is the temp dir so no .env or metering.toml from the checkout is read.
    server = Process(
        f"metering-{backend}",
        [*metering_command(), "serve", "--port", str(port), "--log-level", "warning"]
        + ["--workers", str(args.workers)],
        env,
        tmp,
        tmp,
    )
    stack.callback(server.stop)
    server.wait_http(f"{base}/healthz")
    print(f"[{label}] metering serve pid {server.pid} on {base}", file=sys.stderr)
    if args.workers > 1:
        label += f", --workers {args.workers}"

    admin = Admin(base, admin_key)
    principals = {"off": admin.principal(None), "on": admin.principal(BIG_LIMIT)}
    rss_before = tree_rss_kib(server.pid)
    cpu_before = tree_cpu_seconds(server.pid)

    profiler = None
    if args.profile:
        out = args.profile.with_name(f"{args.profile.name}.{backend}.txt")
        profiler = subprocess.Popen(
            ["py-spy", "record", "--pid", str(server.pid), "--rate", "250", "--format", "raw"]
            + ["--nonblocking", "--subprocesses", "--output", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stack.callback(stop_profiler, profiler)
        time.sleep(1)

    request_ids: dict[str, list[str]] = {"off": [], "on": []}
    failed = {"off": 0, "on": 0}
    rows = []
    for c, n in zip(args.concurrency, args.requests, strict=True):
        warmup = args.warmup if args.warmup is not None else max(30, 4 * c)
        rounds = max(1, min(args.rounds, n // max(c, 1)))
        batches = [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]
        for kind in args.kinds:
            stream = kind == "stream"
            targets = {}
            for mode in args.modes:
                if mode == "direct":
                    target = load.Target(
                        f"http://127.0.0.1:{sim_port}/openai/v1/chat/completions",
                        {"authorization": "Bearer sim-key", "content-type": "application/json"},
                        chat_body(stream, args.tokens, args.chunks, True, args.delay_ms),
                        stream,
                    )
                else:
                    token = principals[mode]["token"]["token"]
                    target = load.Target(
                        f"{base}/v1/chat/completions",
                        {"authorization": f"Bearer {token}", "content-type": "application/json"},
                        chat_body(stream, args.tokens, args.chunks, False, args.delay_ms),
                        stream,
                    )
                targets[mode] = target
            # The modes take turns, batch by batch, so a burst of load from elsewhere on the
            # machine falls on all of them alike; each batch warms up its own connections.
            samplers = {mode: Sampler(server.pid, sim.pid, pg) for mode in targets}
            results: dict[str, load.LoadResult] = {}
            for batch in batches:
                for mode, target in targets.items():
                    try:
                        measured, warm = load.run(
                            target,
                            batch,
                            c,
                            warmup,
                            on_measure=samplers[mode],
                            deadline_s=args.batch_timeout,
                        )
                    except load.Stalled as exc:
                        where = f"; PostgreSQL sessions: {lock_waits(*pg)}" if pg else ""
                        raise SystemExit(
                            f"[{label}] {kind} {mode} C={c}: {exc}{where}\n"
                            f"server log tail:\n{server.log_tail()}"
                        ) from None
                    results[mode] = results[mode].add(measured) if mode in results else measured
                    if mode != "direct":
                        for result in (warm, measured):
                            if result is not None:
                                request_ids[mode] += result.request_ids
                                failed[mode] += result.failed
            direct_row = None
            for mode, measured in results.items():
                sampler = samplers[mode]
                ok = max(measured.ok, 1)
                row = {
                    "backend": backend,
                    "stream": stream,
                    "mode": mode,
                    "concurrency": c,
                    "requests": n,
                    "batches": len(batches),
                    "failed": measured.failed,
                    "statuses": {str(k): v for k, v in measured.statuses.items()},
                    "errors": measured.errors,
                    "elapsed_s": measured.elapsed_s,
                    "rps": measured.rps,
                    "p50_ms": measured.percentile_ms(50),
                    "p95_ms": measured.percentile_ms(95),
                    "p99_ms": measured.percentile_ms(99),
                    "client_cpu_ms": measured.client_cpu_s * 1000 / ok,
                    "sim_cpu_ms": sampler.delta["sim"] * 1000 / ok,
                    "proxy_cpu_ms": sampler.delta["server"] * 1000 / ok,
                    "pg_connections_opened": sampler.delta["pg_connections"],
                    "server_rss_kib": sampler.delta["rss_kib"],
                    "pg_cpu_ms": (
                        sampler.delta["pg"] * 1000 / ok if sampler.delta["pg"] is not None else None
                    ),
                }
                if mode == "direct":
                    direct_row = row
                elif direct_row is not None:
                    row["added_p50_ms"] = row["p50_ms"] - direct_row["p50_ms"]
                    row["added_p99_ms"] = row["p99_ms"] - direct_row["p99_ms"]
                    row["throughput_ratio"] = row["rps"] / direct_row["rps"]
                else:
                    row["throughput_ratio"] = float("nan")
                rows.append(row)
                print(
                    f"[{label}] {kind:6} {mode:6} C={c:<3} {row['rps']:8.0f} req/s  "
                    f"p50 {row['p50_ms']:7.2f}  p99 {row['p99_ms']:7.2f} ms  "
                    f"proxy CPU {row['proxy_cpu_ms']:.2f} ms/req  failed {row['failed']}"
                    + (f"  {measured.errors[:2]}" if measured.errors else ""),
                    file=sys.stderr,
                )

    if profiler is not None:
        stop_profiler(profiler)

    server_cpu = tree_cpu_seconds(server.pid) - cpu_before
    rss_after = tree_rss_kib(server.pid)
    checks = check(admin, principals, request_ids, failed, server)
    if pg:
        time.sleep(1.5)  # backends publish their statistics about once a second
        deadlocks = pg_stat(*pg, "deadlocks")
        checks.append((deadlocks == 0, f"PostgreSQL deadlocks in the bench database: {deadlocks}"))
    server.stop()
    proxied = sum(len(ids) for ids in request_ids.values())
    return {
        "backend": backend,
        "backend_label": label,
        "rows": rows,
        "memory": {"before_kib": rss_before, "after_kib": rss_after},
        "server_cpu_s": server_cpu,
        "proxied_requests": proxied,
        "checks": checks,
    }


def check(admin: Admin, principals: dict, request_ids: dict, failed: dict, server: Process):
    """The ledger against what the load generator saw, and every hold released."""
    checks = []
    for mode, principal in principals.items():
        label = f"budgets {mode}"
        ids = request_ids[mode]
        if not ids and not failed[mode]:
            continue
        events = admin.events(principal["token"]["id"])
        event_ids = [e["id"] for e in events]
        checks.append(
            (
                len(events) == len(ids) and set(event_ids) == set(ids),
                f"{label}: {len(events)} ledger events for {len(ids)} proxied 2xx answers, "
                f"one per answer, ids equal to the answers' x-request-id"
                + (f" ({failed[mode]} requests failed)" if failed[mode] else ""),
            )
        )
        bad = [e for e in events if e["status"] != "ok" or e["usage_source"] != "reported"]
        checks.append(
            (not bad, f"{label}: every event status ok with reported usage ({len(bad)} not)")
        )
        reserved = {}
        spent = {}
        for scope, key in (("tokens", "token"), ("users", "user"), ("teams", "team")):
            budget = admin.ok("GET", f"/v1/{scope}/{principal[key]['id']}/budget")
            reserved[key] = Decimal(budget["reserved"])
            spent[key] = Decimal(budget["spent"])
        checks.append(
            (
                all(v == 0 for v in reserved.values()),
                f"{label}: reserved 0 on token, user and team "
                f"({', '.join(f'{k} {v}' for k, v in reserved.items())})",
            )
        )
        total = sum((Decimal(e["cost"]) for e in events), Decimal(0))
        checks.append(
            (
                all(v == total for v in spent.values()),
                f"{label}: spent on token, user and team = sum of event costs ({total} USD)",
            )
        )
    log = server.log_path.read_text(errors="replace")
    errors = sum(1 for line in log.splitlines() if "ERROR" in line or "Traceback" in line)
    checks.append((errors == 0, f"server log: {errors} error lines"))
    return checks


# --- main --------------------------------------------------------------------------------------


def revision() -> str:
    """The commit measured, and whether the product's files differed from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "metering", "migrations", "pyproject.toml"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head or "unknown"


def machine(args) -> dict:
    cpu_model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    postgres = "not used"
    if not args.no_postgres:
        postgres = postgres_version(args.pg)
    return {
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgres": postgres,
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    backends = ([] if args.no_postgres else ["postgresql"]) + (["sqlite"] if args.sqlite else [])
    if not backends:
        raise SystemExit("nothing to run: --no-postgres needs --sqlite")
    meta = {
        "command": "python -m bench.run" + "".join(f" {a}" for a in (argv or sys.argv[1:])),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": revision(),
        **machine(args),
        "workload": (
            f"{', '.join(f'{n} requests at C={c}' for c, n in zip(args.concurrency, args.requests, strict=True))}"
            f" per scenario, in {args.rounds} batch{'es' if args.rounds > 1 else ''} (the scenarios of one kind and "
            f"concurrency take turns batch by batch), each after a warm-up of "
            f"{args.warmup if args.warmup is not None else 'max(30, 4*C)'} requests; one short "
            f"user message, answers of {args.tokens} completion tokens, streams in "
            f"{args.chunks} content chunks"
            + (
                f" {args.delay_ms} ms apart"
                if args.delay_ms
                else "; the sim answers at once (no generation delay), so the direct row is the "
                "floor and every added millisecond is the proxy's"
            )
            + "."
        ),
    }
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="metering-bench-") as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        sim_port = free_port()
        sim = Process(
            "sim",
            [sys.executable, "-m", "metering.sim", "--port", str(sim_port)],
            dict(os.environ),
            tmp,
            tmp,
        )
        stack.callback(sim.stop)
        sim.wait_http(
            f"http://127.0.0.1:{sim_port}/openai/v1/models",
            headers={"authorization": "Bearer sim-key"},
        )
        print(f"sim pid {sim.pid} on port {sim_port}", file=sys.stderr)
        for backend in backends:
            with contextlib.ExitStack() as backend_stack:
                results.append(run_backend(args, backend, sim, sim_port, tmp, backend_stack))
    generated = report.markdown(meta, results)
    print(generated)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    if args.write:
        report.write_benchmarks(ROOT / "BENCHMARKS.md", generated)
        print(f"updated {ROOT / 'BENCHMARKS.md'}", file=sys.stderr)
    failed = [text for result in results for ok, text in result["checks"] if not ok]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
