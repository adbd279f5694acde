"""The commands run on the server's machine, with its settings and its database: serve, db
upgrade, demo, reconcile, rerate."""

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metering.cli.options import command, seconds, subparsers

if TYPE_CHECKING:
    from metering.settings import Settings

# Each command imports what it runs (the settings, the server, the migrations, the database)
# when it runs: `metering --version`, the admin client's commands, or a refusal of a wrong
# setting, answer before any of it is loaded.

# The admin key .env.example shows: every reader of the repository knows it.
PLACEHOLDER_ADMIN_KEY = "change-me-to-a-random-key-of-32-characters-or-more"


def placeholder_admin_key(key: str | None) -> bool:
    """A key left as an example wrote it (any key with `change-me` in it): never served with."""
    return key is not None and (key == PLACEHOLDER_ADMIN_KEY or "change-me" in key.lower())


def serve(args: argparse.Namespace) -> int:
    settings = load_settings()
    if settings is None:
        return 2
    if placeholder_admin_key(settings.admin_key):
        print(
            "metering: METERING_ADMIN_KEY is still the example's placeholder (it contains "
            "`change-me`): anyone who has read .env.example could use the admin API. Set a "
            "random key of at least 32 characters: `openssl rand -hex 32`",
            file=sys.stderr,
        )
        return 2
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from metering import migrate
    from metering.db import direct_url
    from metering.server import server_config

    migrations_url = direct_url(settings.database_url, settings.database_direct_url)
    if not args.no_migrate:
        migrate.upgrade(migrations_url)
    else:
        state, revision, head = migrate.schema_state(migrations_url)
        if state == "pending":
            print(
                f"metering: the database's schema is at {revision or 'none'}, this release "
                f"needs {head}: run `metering db upgrade` (the migration job) first",
                file=sys.stderr,
            )
            return 2
    config = server_config(
        "metering.cli:serving_app",
        settings,
        host=args.host,
        port=args.port,
        factory=True,
        workers=args.workers,
        log_level=args.log_level,
    )
    server = uvicorn.Server(config)
    with metrics_dir(args.workers):
        if config.workers > 1:
            Multiprocess(config, sockets=[config.bind_socket()]).run()
        else:
            server.run()
    return 0 if server.started or config.workers > 1 else 1


# Allocations between collections of the youngest generation (Python's default: 700). A
# request allocates thousands of short-lived objects that reference counting frees; collecting
# every 700 allocations mostly walks live ones.
GC_THRESHOLD = (20_000, 20, 20)


def serving_app():
    """The app as `metering serve` runs it (in each worker): what was built at import and
    start-up is moved out of the collector's sight (gc.freeze), and young objects are collected
    less often. Memory stays bounded: the collector still runs, on fewer, larger batches."""
    from metering.app import create_app

    app = create_app()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    return app


def load_settings() -> "Settings | None":
    """The settings, or None after saying on stderr which are wrong."""
    from pydantic import ValidationError

    from metering.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"])
            name = f"METERING_{where.upper()}" if where else "settings"
            message = str(error["msg"]).removeprefix("Value error, ")
            print(f"metering: {name}: {message}", file=sys.stderr)
        return None


@contextlib.contextmanager
def metrics_dir(workers: int):
    """Several workers share their Prometheus samples through files in one directory (set before
    they start, emptied first: samples of an earlier run must not count). One worker needs none."""
    from metering.metrics import MULTIPROC_ENV

    given = os.environ.get(MULTIPROC_ENV)
    if workers <= 1 and not given:
        yield
        return
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix="metering-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(path)
    try:
        yield
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def reconcile(args: argparse.Namespace) -> int:
    from metering.db import Database
    from metering.errors import InvalidRequest
    from metering.reports import reconciliation
    from metering.settings import Settings

    async def run() -> dict:
        settings = Settings()
        db = Database(
            settings.database_url,
            pooler=settings.database_pooler,
            direct=settings.database_direct_url,
        )
        try:
            return await reconciliation.reconcile(db, args.provider, tolerance, data)
        finally:
            await db.dispose()

    try:
        tolerance = reconciliation.parse_tolerance(args.tolerance)
        data = Path(args.file).read_bytes() if args.file != "-" else sys.stdin.buffer.read()
        result = asyncio.run(run())
    except (reconciliation.MalformedExport, InvalidRequest) as exc:
        print(f"metering reconcile: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"metering reconcile: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    summary = ", ".join(f"{n} {s}" for s, n in result["summary"].items())
    print(f"reconciliation {result['id']}: {summary}", file=sys.stderr)
    return 0


def rerate(args: argparse.Namespace) -> int:
    from metering.billing import rerate as rerating
    from metering.db import Database, utcnow
    from metering.errors import MeteringError
    from metering.settings import Settings

    async def run() -> dict:
        start = rerating.parse_moment(args.start, "start")
        end = rerating.parse_moment(args.end, "end") or utcnow()
        settings = Settings()
        db = Database(
            settings.database_url,
            pooler=settings.database_pooler,
            direct=settings.database_direct_url,
        )
        try:
            result = await rerating.rerate(
                db,
                provider=args.provider,
                model=args.model,
                start=start,
                end=end,
                reason=args.reason,
            )
        finally:
            await db.dispose()
        return result.out()

    try:
        result = asyncio.run(run())
    except MeteringError as exc:
        print(f"metering rerate: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def db_upgrade(_: argparse.Namespace) -> int:
    settings = load_settings()
    if settings is None:
        return 2
    from metering import migrate
    from metering.db import direct_url

    migrate.upgrade(direct_url(settings.database_url, settings.database_direct_url))
    print("database is at the latest schema")
    return 0


def db_check(_: argparse.Namespace) -> int:
    settings = load_settings()
    if settings is None:
        return 2
    from metering import migrate
    from metering.db import direct_url

    state, revision, head = migrate.schema_state(
        direct_url(settings.database_url, settings.database_direct_url)
    )
    print(f"schema {state}: database at {revision or 'none'}, this release's head {head}")
    return 1 if state == "pending" else 0


def db_wait(args: argparse.Namespace) -> int:
    settings = load_settings()
    if settings is None:
        return 2
    from metering import migrate
    from metering.db import direct_url

    url = direct_url(settings.database_url, settings.database_direct_url)
    state, revision, head = migrate.wait_current(url, args.timeout)
    print(f"schema {state}: database at {revision or 'none'}, this release's head {head}")
    return 1 if state == "pending" else 0


def demo(args: argparse.Namespace) -> int:
    from metering.demo import run_demo

    run_demo(host=args.host, port=args.port)
    return 0


def add_commands(group: Any) -> None:
    p = command(group, "serve", "run the proxy (applies pending migrations first)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8080, help="the port to listen on")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes sharing the port (each with its own pools; on SQLite keep 1)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="the least severe log lines written",
    )
    p.add_argument(
        "--no-migrate",
        action="store_true",
        help="do not apply pending migrations (a job runs `metering db upgrade`); refuse to "
        "start while the schema is behind this release (default: apply them at start)",
    )
    p.set_defaults(func=serve)

    db = command(group, "db", "the database's schema")
    db_commands = subparsers(db, "db_command")
    command(db_commands, "upgrade", "apply pending migrations").set_defaults(func=db_upgrade)
    command(
        db_commands,
        "check",
        "exit 0 when the schema is this release's (or a newer release's), 1 when migrations "
        "are pending",
    ).set_defaults(func=db_check)
    p = command(
        db_commands,
        "wait",
        "wait until the schema is this release's (or newer): exit 0, or 1 at the timeout",
    )
    p.add_argument(
        "--timeout",
        type=seconds,
        default=600.0,
        help="seconds to wait before giving up (at most a day)",
    )
    p.set_defaults(func=db_wait)

    p = command(
        group,
        "demo",
        "serve with a simulated upstream, demo traffic and a demo token",
        "Serve on the database of METERING_DATABASE_URL (default ./metering.db) with a "
        "simulated upstream, send a few seconds of demo traffic and print a demo token and the "
        "admin key. The admin key is METERING_ADMIN_KEY if set, else one made at the database's "
        "first demo and kept in it: the same at every start.",
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8080, help="the port to listen on")
    p.set_defaults(func=demo)

    p = command(group, "reconcile", "compare a provider's usage export (CSV) with the ledger")
    p.add_argument(
        "file",
        help="the export: CSV with date, provider, model, prompt_tokens, "
        "completion_tokens, cost[, upstream_id]; - reads standard input",
    )
    p.add_argument("--provider", required=True, help="the provider's name in the catalog")
    p.add_argument("--tolerance", help="relative tolerance for tokens and cost (default: 0.001)")
    p.set_defaults(func=reconcile)

    p = command(
        group,
        "rerate",
        "correct a model's events in a range to the price history (adjustment events)",
    )
    p.add_argument("--provider", required=True, help="the provider's name in the catalog")
    p.add_argument("--model", required=True, help="the model's name in the catalog")
    p.add_argument("--start", required=True, help="RFC 3339, inclusive")
    p.add_argument("--end", help="RFC 3339, exclusive (default: now)")
    p.add_argument("--reason", required=True, help="why: kept on every adjustment")
    p.set_defaults(func=rerate)
