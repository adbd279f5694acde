"""`metering teams|users|tokens ...`: list, get, create, update, delete and budget, through the
admin API. Each option of create and update is a field of the API's body, sent only when given:
what a create leaves out is the API's default, what an update leaves out stays as it is."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from metering.cli.client import Api
from metering.cli.options import (
    CliError,
    command,
    connection_options,
    format_option,
    from_env,
    names,
    nullable,
    percentages,
    positive,
    subparsers,
    whole,
)
from metering.cli.output import note, show, show_one

LIST_LIMIT = 1000


@dataclass(frozen=True)
class Kind:
    """One kind of object of the identity API."""

    plural: str  # the command: teams
    one: str  # team
    columns: tuple[str, ...]  # the table's
    fields: tuple[str, ...]  # the body fields create and update send (their dests)

    def path(self, object_id: str | None = None) -> str:
        base = f"/v1/{self.plural}"
        return base if object_id is None else f"{base}/{quote(object_id, safe='')}"


LIMIT_FIELDS = (
    "credit_limit",
    "reset_interval",
    "alert_thresholds",
    "soft_limit",
    "rpm_limit",
    "tpm_limit",
    "max_parallel_requests",
    "allowed_models",
)
TEAMS = Kind(
    "teams",
    "team",
    ("id", "name", "credit_limit", "reset_interval", "rpm_limit", "tpm_limit", "created_at"),
    ("name", *LIMIT_FIELDS, "end_user_credit_limit", "end_user_reset_interval"),
)
USERS = Kind(
    "users",
    "user",
    ("id", "email", "name", "team_id", "credit_limit", "reset_interval", "created_at"),
    ("email", "name", "team_id", "password", *LIMIT_FIELDS),
)
TOKENS = Kind(
    "tokens",
    "token",
    ("id", "name", "prefix", "user_id", "credit_limit", "reset_interval", "expires_at",
     "revoked_at"),
    ("name", *LIMIT_FIELDS, "expires_at", "expires_in"),
)  # fmt: skip


def limit_options(parser: argparse.ArgumentParser, creating: bool) -> None:
    """The budget and the limits beyond credit every team, user and token has."""

    def default(created: str) -> str:
        return f"(default: {created if creating else 'unchanged'})"

    def option(flag: str, convert: Callable[[str], Any], metavar: str, help: str) -> None:
        parser.add_argument(
            flag, type=convert, metavar=metavar, default=argparse.SUPPRESS, help=help
        )

    option(
        "--credit-limit",
        nullable(str, "none"),
        "USD",
        "the budget in USD, a decimal (25, 0.50); none: unlimited " + default("unlimited"),
    )
    option(
        "--reset-interval",
        str,
        "INTERVAL",
        "when the budget starts again: never, hourly, daily, weekly, monthly (calendar windows "
        "in UTC) or a duration <N>s|m|h|d " + default("never"),
    )
    option(
        "--alert-thresholds",
        nullable(percentages, "default"),
        "PERCENTS",
        "percentages of the credit limit, comma-separated (50,80,100), whose crossing sends "
        "budget.threshold_crossed; none: no alerts " + default("50,80,100"),
    )
    option(
        "--soft-limit",
        nullable(str, "none"),
        "USD",
        "an amount in USD whose crossing sends budget.soft_limit_reached (it never refuses a "
        "request); none: no soft limit " + default("none"),
    )
    for flag, what in (
        ("--rpm-limit", "requests per UTC minute"),
        ("--tpm-limit", "tokens per UTC minute"),
        ("--max-parallel-requests", "requests in flight at once"),
    ):
        option(flag, nullable(whole, "none"), "N", f"{what}; none: no limit " + default("none"))
    option(
        "--allowed-models",
        nullable(names, "all"),
        "MODELS",
        "the catalog models it may call, comma-separated, * and ? as wildcards (gpt-*,"
        "minimax-m2.1); all: every model " + default("all"),
    )


def end_user_options(parser: argparse.ArgumentParser, creating: bool) -> None:
    """A team's default budget for each of its end users (those without one of their own)."""
    unchanged = "unchanged"
    parser.add_argument(
        "--end-user-credit-limit",
        type=nullable(str, "none"),
        metavar="USD",
        default=argparse.SUPPRESS,
        help="the budget in USD of each end user of the team that has none of its own; none: "
        f"not limited (default: {'none' if creating else unchanged})",
    )
    parser.add_argument(
        "--end-user-reset-interval",
        metavar="INTERVAL",
        default=argparse.SUPPRESS,
        help="when those end users' budgets start again, as --reset-interval (default: "
        f"{'never' if creating else unchanged})",
    )


def expiry_options(parser: argparse.ArgumentParser, creating: bool) -> None:
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--expires-at",
        type=nullable(str, "never"),
        metavar="TIME",
        default=argparse.SUPPRESS,
        help="when the token stops working, RFC 3339 (2027-01-01T00:00:00Z); never: no expiry "
        f"(default: {'never' if creating else 'unchanged'})",
    )
    when.add_argument(
        "--expires-in",
        type=whole,
        metavar="SECONDS",
        default=argparse.SUPPRESS,
        help="the token's lifetime from now, in seconds, instead of --expires-at (default: "
        f"{'never expires' if creating else 'unchanged'})",
    )


def password_option(parser: argparse.ArgumentParser, creating: bool) -> None:
    parser.add_argument(
        "--password-env",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help="the environment variable holding the user's password for POST /v1/auth/login, "
        "at least 8 characters (never given on the command line, where shell history keeps "
        f"it) (default: {'no password: no login' if creating else 'unchanged'})",
    )


def body_of(kind: Kind, args: argparse.Namespace) -> dict[str, Any]:
    """The fields given on the command line, under their API names."""
    body = {field: getattr(args, field) for field in kind.fields if hasattr(args, field)}
    if hasattr(args, "password_env"):
        body["password"] = from_env(args.password_env, "user's password")
    return body


# --- the handlers -------------------------------------------------------------------------


def list_objects(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with Api.of(args) as api:
            search = {"q": args.search} if args.search else {}
            if kind is TOKENS:
                params = {"include_revoked": "true"} if args.include_revoked else {}
                path = f"/v1/users/{quote(args.user_id, safe='')}/tokens"
                rows = api.json("GET", path, params={**params, **search})["data"]
            else:
                params = {"team_id": args.team_id} if getattr(args, "team_id", None) else {}
                params.update(search)
                if args.after:
                    params["after"] = args.after
                rows = api.pages(kind.path(), args.limit, params)
        show(rows, args.format, kind.columns, {"object": "list", "data": rows})
        return 0

    return run


def get_object(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with Api.of(args) as api:
            show_one(api.json("GET", kind.path(args.id)), args.format, kind.columns)
        return 0

    return run


def budget_of(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with Api.of(args) as api:
            show_one(api.json("GET", f"{kind.path(args.id)}/budget"), args.format)
        return 0

    return run


def create_object(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        body = body_of(kind, args)
        path = f"/v1/users/{quote(args.user_id, safe='')}/tokens" if kind is TOKENS else kind.path()
        with Api.of(args) as api:
            made = api.json("POST", path, body=body)
        show_one(made, args.format, ("id", "token", *kind.columns))
        if kind is TOKENS:
            note("the token (mtr_...) is shown this once: keep it now")
        return 0

    return run


def update_object(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        body = body_of(kind, args)
        if not body:
            raise CliError(f"nothing to change: give a field ({kind.plural} update --help)", 2)
        with Api.of(args) as api:
            show_one(api.json("PATCH", kind.path(args.id), body=body), args.format, kind.columns)
        return 0

    return run


def delete_object(kind: Kind) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with Api.of(args) as api:
            api.send("DELETE", kind.path(args.id))
        note(f"{'revoked' if kind is TOKENS else 'deleted'} {kind.one} {args.id}")
        return 0

    return run


# --- the parsers ----------------------------------------------------------------------------

DELETES = {
    "teams": "delete a team: its users' and tokens' requests are refused from then on",
    "users": "delete a user and revoke their tokens, at once on every replica",
    "tokens": "revoke a token, at once on every replica",
}


def add_commands(group: Any) -> None:
    for kind, describe in (
        (TEAMS, "teams: budgets and limits shared by their users"),
        (USERS, "users: each in one team, with up to 10 active tokens"),
        (TOKENS, "API tokens (mtr_...): a user's credentials for the proxy"),
    ):
        parser = command(group, kind.plural, describe)
        connection_options(parser)
        add_kind(subparsers(parser, f"{kind.one}_command"), kind)


def leaf(group: Any, name: str, help: str, run: Callable[[argparse.Namespace], int]) -> Any:
    parser = command(group, name, help)
    connection_options(parser)
    format_option(parser)
    parser.set_defaults(func=run)
    return parser


SEARCHED = {"team": "name", "user": "name or email", "token": "name or prefix"}


def add_kind(group: Any, kind: Kind) -> None:
    listing = leaf(group, "list", f"list {kind.plural}", list_objects(kind))
    listing.add_argument(
        "--search",
        metavar="TEXT",
        help=f"only the {kind.plural} whose id is TEXT or whose {SEARCHED[kind.one]} holds it, "
        "in any case (the API's q; default: all)",
    )
    if kind is TOKENS:
        listing.add_argument(
            "--user", dest="user_id", required=True, help="the user whose tokens to list"
        )
        listing.add_argument(
            "--include-revoked", action="store_true", help="revoked tokens too (default: not)"
        )
    else:
        if kind is USERS:
            listing.add_argument(
                "--team", dest="team_id", help="only this team's users (default: every team)"
            )
        listing.add_argument(
            "--limit", type=positive, default=LIST_LIMIT, help=f"the most {kind.plural} to list"
        )
        listing.add_argument(
            "--after",
            metavar="ID",
            help=f"start after this {kind.one} id, the last one of an earlier listing "
            "(default: from the first)",
        )
    leaf(group, "get", f"show one {kind.one}", get_object(kind)).add_argument(
        "id", help=f"the {kind.one}'s id"
    )
    leaf(group, "budget", f"the {kind.one}'s budget now", budget_of(kind)).add_argument(
        "id", help=f"the {kind.one}'s id"
    )
    create = leaf(group, "create", f"create a {kind.one}", create_object(kind))
    update = leaf(group, "update", f"change some of a {kind.one}'s fields", update_object(kind))
    update.add_argument("id", help=f"the {kind.one}'s id")
    identity_options(kind, create, update)
    limit_options(create, creating=True)
    limit_options(update, creating=False)
    if kind is TOKENS:
        expiry_options(create, creating=True)
        expiry_options(update, creating=False)
    leaf(group, "delete", DELETES[kind.plural], delete_object(kind)).add_argument(
        "id", help=f"the {kind.one}'s id"
    )


def identity_options(kind: Kind, create: Any, update: Any) -> None:
    """The fields that say who or what the object is."""
    if kind is TEAMS:
        create.add_argument("--name", required=True, help="unique, compared without case")
        update.add_argument("--name", default=argparse.SUPPRESS, help="(default: unchanged)")
        end_user_options(create, creating=True)
        end_user_options(update, creating=False)
    elif kind is USERS:
        create.add_argument("--email", required=True, help="unique")
        create.add_argument("--name", required=True, help="the user's name")
        create.add_argument("--team", dest="team_id", required=True, help="the team's id")
        for flag, dest, what in (
            ("--email", "email", "a new email"),
            ("--name", "name", "a new name"),
            ("--team", "team_id", "move the user to this team"),
        ):
            update.add_argument(
                flag, dest=dest, default=argparse.SUPPRESS, help=f"{what} (default: unchanged)"
            )
        password_option(create, creating=True)
        password_option(update, creating=False)
    else:
        create.add_argument("--user", dest="user_id", required=True, help="the owner's user id")
        create.add_argument(
            "--name", default=argparse.SUPPRESS, help="what it is for (default: default)"
        )
        update.add_argument(
            "--name", default=argparse.SUPPRESS, help="a new name (default: unchanged)"
        )
