"""`metering spend` and `metering usage`: GET /v1/spend and /v1/usage with every filter as an
option, as a table, CSV (the server's own) or JSON (the API's own objects)."""

import argparse
import csv
import io
import json
from typing import Any

from metering.cli.client import Api, decoded
from metering.cli.options import command, connection_options, format_option, positive
from metering.cli.output import note, table, write

METRICS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
           "cost")  # fmt: skip
# A row's sums not shown in the table (the JSON and the CSV have them).
OTHER_SUMS = ("uncharged", "adjustments")
GROUP_KEYS = (
    "team, user, token, model, provider, day, hour; end_user, tag:<key> and endpoint where the "
    "server's /v1/spend has them"
)
SPEND_ROWS = 10_000  # the server's page of a report
USAGE_COLUMNS = ("created_at", "id", "token_id", "model", "provider", "status", "prompt_tokens",
                 "completion_tokens", "cost")  # fmt: skip
USAGE_PAGE = 1000  # the largest page /v1/usage gives


def filter_options(parser: argparse.ArgumentParser) -> None:
    """The filters /v1/spend and /v1/usage share; each narrows, all must match."""
    parser.add_argument(
        "--start", metavar="TIME", help="from this time, inclusive, RFC 3339 with its zone "
        "(2026-12-01T00:00:00Z) (default: spend: 30 days before --end; usage: the first event)"
    )  # fmt: skip
    parser.add_argument(
        "--end", metavar="TIME", help="to this time, exclusive, RFC 3339 (default: now)"
    )
    for flag, dest, what in (
        ("--team", "team_id", "a team's id"),
        ("--user", "user_id", "a user's id"),
        ("--token", "token_id", "a token's id"),
        ("--model", "model", "a model's catalog name"),
        ("--provider", "provider", "a provider's catalog name"),
        ("--end-user", "end_user", "the end user requests named (x-metering-end-user, user)"),
    ):
        parser.add_argument(flag, dest=dest, help=f"only {what} (default: all)")
    parser.add_argument(
        "--tag",
        action="append",
        metavar="KEY:VALUE",
        help="only requests with this tag, repeatable: all must match (default: any)",
    )
    parser.add_argument(
        "--labels",
        action="store_true",
        help="names beside ids: team_name, user_email, token_name (default: ids only)",
    )


def query(args: argparse.Namespace, *names: str) -> list[tuple[str, Any]]:
    """The query parameters of the options given (tags repeated, as the API takes them)."""
    keys = ("start", "end", "team_id", "user_id", "token_id", "model", "provider", "end_user")
    params: list[tuple[str, Any]] = [
        (k, getattr(args, k)) for k in (*keys, *names) if getattr(args, k, None) is not None
    ]
    params += [("tag", tag) for tag in args.tag or ()]
    if args.labels:
        params.append(("labels", "true"))
    return params


def spend(args: argparse.Namespace) -> int:
    params = query(args, "adjustments", "limit", "page")
    if args.group_by:
        params.append(("group_by", ",".join(args.group_by)))
    if args.format == "csv":
        params.append(("format", "csv"))
    with Api.of(args) as api:
        response = api.send("GET", "/v1/spend", params=params)
    if args.format == "csv":
        write(response.text)
    else:
        report = decoded(response)
        write(json.dumps(report, indent=2) + "\n" if args.format == "json" else spend_table(report))
    if "x-next-page" in response.headers:
        note(
            f"{response.headers['x-row-count']} rows in all: the next ones with "
            f"--page {response.headers['x-next-page']}"
        )
    return 0


def spend_table(report: dict) -> str:
    rows = report["rows"]
    keys = [k for k in (rows[0] if rows else {}) if k not in (*METRICS, *OTHER_SUMS)]
    if not rows:  # the group keys as the rows would name them
        keys = [key_name(name) for name in report["group_by"]]
    if not keys:  # no grouping: the one row is the totals
        return table([report["total"]], METRICS)
    return table(rows, [*keys, *METRICS], footer={**report["total"], keys[0]: "total"})


def key_name(group: str) -> str:
    return f"{group}_id" if group in ("team", "user", "token") else group


def usage(args: argparse.Namespace) -> int:
    params = query(args)
    cursor, left = args.cursor, args.limit
    events: list[dict] = []
    pages: list[str] = []  # CSV: the server's own pages, each with its header line
    with Api.of(args) as api:
        while left > 0:
            paging = [*params, ("limit", min(USAGE_PAGE, left))]
            paging += [("cursor", cursor)] if cursor else []
            if args.format == "csv":
                response = api.send("GET", "/v1/usage", params=[*paging, ("format", "csv")])
                pages.append(response.text)
                cursor = response.headers.get("x-next-cursor")
                left -= csv_rows(response.text)
            else:
                page = api.json("GET", "/v1/usage", params=paging)
                events.extend(page["data"])
                cursor = page["next_cursor"]
                left -= len(page["data"])
            if not cursor:
                break
    if args.format == "csv":
        write(join_csv(pages))
    elif args.format == "json":
        write(json.dumps({"object": "list", "data": events, "next_cursor": cursor}, indent=2))
        write("\n")
    else:
        write(table(events, usage_columns(events)))
    if cursor and args.format != "json":
        note(f"more events: the next ones with --cursor {cursor}")
    return 0


def csv_rows(text: str) -> int:
    """The records of a CSV page, its header not counted (a quoted cell may hold a newline)."""
    return max(0, sum(1 for _ in csv.reader(io.StringIO(text))) - 1)


def join_csv(pages: list[str]) -> str:
    """One CSV of the pages: the first one's header line, then every page's rows."""
    if not pages:
        return ""
    rest = [page.partition("\n")[2] for page in pages[1:]]
    return pages[0] + "".join(rest)


def usage_columns(events: list[dict]) -> list[str]:
    """The table's columns: the usual ones, then the end user and the names beside the ids
    when the events have them."""
    extra = ("end_user", "team_name", "user_email", "token_name")
    return [*USAGE_COLUMNS, *(c for c in extra if any(e.get(c) for e in events))]


def add_commands(group: Any) -> None:
    parser = command(
        group,
        "spend",
        "spend summed by the keys of --group-by over a range (GET /v1/spend)",
        "Spend summed by the keys of --group-by over [start, end), exact to the picodollar; "
        "without --group-by, the totals. The admin key sees everyone's; a user's token (with "
        "--key-env) its own.",
    )
    connection_options(parser)
    format_option(parser)
    filter_options(parser)
    parser.add_argument(
        "--group-by",
        action="append",
        metavar="KEYS",
        help=f"group by these keys, comma-separated or repeated: {GROUP_KEYS} (default: none, "
        "the totals only)",
    )
    parser.add_argument(
        "--adjustments",
        choices=("include", "exclude"),
        default="include",
        help="include: the cost with price corrections and credits; exclude: as the requests "
        "were first charged",
    )
    parser.add_argument("--limit", type=positive, default=SPEND_ROWS, help="rows per page")
    parser.add_argument("--page", type=positive, default=1, help="which page of --limit rows")
    parser.set_defaults(func=spend)

    parser = command(
        group,
        "usage",
        "ledger events, newest first (GET /v1/usage)",
        "Ledger events, newest first, paged through with the cursor up to --limit events. The "
        "admin key sees everyone's; a user's token (with --key-env) its own.",
    )
    connection_options(parser)
    format_option(parser)
    filter_options(parser)
    parser.add_argument("--limit", type=positive, default=100, help="the most events to list")
    parser.add_argument(
        "--cursor",
        help="continue after an earlier listing: its next_cursor (default: the newest event)",
    )
    parser.set_defaults(func=usage)
