"""The `metering` command: serve, db upgrade, demo."""

import argparse
import logging
import sys

import uvicorn

from metering import migrate
from metering.settings import Settings


def serve(args: argparse.Namespace) -> None:
    settings = Settings()
    migrate.upgrade(settings.database_url)
    uvicorn.run(
        "metering.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
        access_log=False,
    )


def db_upgrade(_: argparse.Namespace) -> None:
    settings = Settings()
    migrate.upgrade(settings.database_url)
    print("database is at the latest schema")


def demo(args: argparse.Namespace) -> None:
    from metering.demo import run_demo

    run_demo(host=args.host, port=args.port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="metering", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("serve", help="run the proxy (applies pending migrations first)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=serve)

    db = commands.add_parser("db", help="database schema").add_subparsers(
        dest="db_command", required=True
    )
    db.add_parser("upgrade", help="apply pending migrations").set_defaults(func=db_upgrade)

    p = commands.add_parser("demo", help="serve with a simulated upstream and a demo token")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.set_defaults(func=demo)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
