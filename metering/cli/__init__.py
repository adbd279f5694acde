"""The `metering` command: the server's commands (serve, db upgrade, demo, reconcile, rerate)
and an admin client of its HTTP API (teams, users, tokens, end users, webhooks, spend, usage),
which works against any replica."""

import argparse
import logging
import sys

from metering import __version__
from metering.cli import admin, end_users, local, reports, webhooks
from metering.cli.local import (
    GC_THRESHOLD,
    PLACEHOLDER_ADMIN_KEY,
    placeholder_admin_key,
    serving_app,
)
from metering.cli.options import CliError, HelpFormatter, connection_options

__all__ = [
    "GC_THRESHOLD",
    "PLACEHOLDER_ADMIN_KEY",
    "main",
    "parser",
    "placeholder_admin_key",
    "serving_app",
]

CLIENT_HELP = """\
The admin client's commands (teams, users, tokens, end-users, webhooks, spend, usage) call the
HTTP API of the server at --url (default $METERING_URL, else http://127.0.0.1:8080) with the key
in $METERING_ADMIN_KEY (or the variable --key-env names). `metering COMMAND --help` says more."""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="metering", description=__doc__, epilog=CLIENT_HELP, formatter_class=HelpFormatter
    )
    top.add_argument("--version", action="version", version=f"metering {__version__}")
    connection_options(top)
    group = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    local.add_commands(group)
    admin.add_commands(group)
    end_users.add_commands(group)
    webhooks.add_commands(group)
    reports.add_commands(group)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("apscheduler", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # a line per job run or request
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"metering: {exc.message}", file=sys.stderr)
        return exc.code
