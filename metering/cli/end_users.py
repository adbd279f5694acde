"""`metering end-users ...`: the budgets of a team's end users (the end user a request names,
x-metering-end-user): each on its team's default, or on terms of its own set here."""

import argparse
from typing import Any
from urllib.parse import quote

from metering.cli.admin import leaf
from metering.cli.client import Api
from metering.cli.options import (
    command,
    connection_options,
    nullable,
    positive,
    subparsers,
)
from metering.cli.output import note, show, show_one

COLUMNS = ("end_user", "override", "credit_limit", "reset_interval", "spent", "remaining",
           "resets_at")  # fmt: skip


def path(team_id: str, end_user: str | None = None) -> str:
    base = f"/v1/teams/{quote(team_id, safe='')}/end-users"
    return base if end_user is None else f"{base}/{quote(end_user, safe='')}/budget"


def list_end_users(args: argparse.Namespace) -> int:
    params = {"after": args.after} if args.after else {}
    with Api.of(args) as api:
        rows = api.pages(path(args.team_id), args.limit, params, key="end_user")
    show(rows, args.format, COLUMNS, {"object": "list", "data": rows})
    return 0


def get_budget(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        show_one(api.json("GET", path(args.team_id, args.end_user)), args.format, COLUMNS)
    return 0


def set_budget(args: argparse.Namespace) -> int:
    body = {"credit_limit": args.credit_limit, "reset_interval": args.reset_interval}
    with Api.of(args) as api:
        show_one(
            api.json("PUT", path(args.team_id, args.end_user), body=body), args.format, COLUMNS
        )
    return 0


def clear_budget(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        api.send("DELETE", path(args.team_id, args.end_user))
    note(f"{args.end_user} of team {args.team_id} is back on the team's default budget")
    return 0


def add_commands(group: Any) -> None:
    parser = command(
        group,
        "end-users",
        "end users' budgets: a team's default, or terms of their own",
        "The budgets of a team's end users (the end user a request names): each is on its "
        "team's default (teams create|update --end-user-credit-limit) unless given terms of its "
        "own here.",
    )
    connection_options(parser)
    end_users = subparsers(parser, "end_user_command")
    listing = leaf(
        end_users, "list", "a team's end users that have a budget, with their spend", list_end_users
    )
    listing.add_argument("--limit", type=positive, default=1000, help="the most end users to list")
    listing.add_argument(
        "--after",
        metavar="END_USER",
        help="start after this end user, the last one of an earlier listing (default: from the "
        "first)",
    )
    get = leaf(end_users, "get", "an end user's budget as it stands now", get_budget)
    put = leaf(end_users, "set", "give an end user a budget of its own", set_budget)
    put.add_argument(
        "--credit-limit",
        type=nullable(str, "none"),
        metavar="USD",
        required=True,
        help="its budget in USD, a decimal (0.50); none: not limited",
    )
    put.add_argument(
        "--reset-interval",
        default="never",
        help="when it starts again: never, hourly, daily, weekly, monthly or <N>s|m|h|d",
    )
    clear = leaf(
        end_users, "clear", "put an end user back on its team's default budget", clear_budget
    )
    for parser in (listing, get, put, clear):
        parser.add_argument("--team", dest="team_id", required=True, help="the team's id")
    for parser in (get, put, clear):
        parser.add_argument("end_user", help="the end user, as requests name it")
