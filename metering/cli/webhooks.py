"""`metering webhooks ...`: receivers of alert events (the API has no update: delete and create
again)."""

import argparse
from typing import Any
from urllib.parse import quote

from metering.cli.admin import leaf
from metering.cli.client import Api
from metering.cli.options import command, connection_options, from_env, positive, subparsers
from metering.cli.output import note, show, show_one

# The event types a webhook may ask for (metering.alerts.record.TYPES; a test keeps them equal).
EVENT_TYPES = (
    "budget.threshold_crossed",
    "budget.soft_limit_reached",
    "budget.exhausted",
    "budget.window_reset",
    "token.expiring",
    "reconciliation.differs",
)
COLUMNS = ("id", "url", "events", "team_id", "created_at")
DELIVERY_COLUMNS = (
    "id",
    "event_type",
    "status",
    "attempts",
    "last_status_code",
    "created_at",
    "finished_at",
)


def path(webhook_id: str, *rest: str) -> str:
    return "/".join(("/v1/webhooks", quote(webhook_id, safe=""), *rest))


def list_webhooks(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        found = api.json("GET", "/v1/webhooks")
    show(found["data"], args.format, COLUMNS, found)
    return 0


def create_webhook(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"url": args.target, "events": args.events, "team_id": args.team_id}
    if args.secret_env:
        body["secret"] = from_env(args.secret_env, "webhook's signing secret")
    with Api.of(args) as api:
        made = api.json("POST", "/v1/webhooks", body=body)
    show_one(made, args.format, (*COLUMNS, "secret"))
    note("the signing secret is shown this once: keep it now")
    return 0


def delete_webhook(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        api.send("DELETE", path(args.id))
    note(f"deleted webhook {args.id}")
    return 0


def test_webhook(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        show_one(api.json("POST", path(args.id, "test")), args.format)
    return 0


def list_deliveries(args: argparse.Namespace) -> int:
    with Api.of(args) as api:
        found = api.json("GET", path(args.id, "deliveries"), params={"limit": args.limit})
    show(found["data"], args.format, DELIVERY_COLUMNS, found)
    return 0


def add_commands(group: Any) -> None:
    parser = command(
        group,
        "webhooks",
        "webhooks: where alert events are sent",
        "Webhooks: where alert events are sent. The API has no update of a webhook: delete it "
        "and create it again.",
    )
    connection_options(parser)
    webhooks = subparsers(parser, "webhook_command")
    leaf(webhooks, "list", "list webhooks (without their secrets)", list_webhooks)
    create = leaf(webhooks, "create", "register a receiver of alert events", create_webhook)
    create.add_argument(
        "target", metavar="URL", help="where to POST the events: https://... (http:// to "
        "loopback only where the server allows it)"
    )  # fmt: skip
    create.add_argument(
        "--event",
        dest="events",
        action="append",
        required=True,
        metavar="TYPE",
        help=f"an event type to send, repeatable: {', '.join(EVENT_TYPES)} (default: none; "
        "one at least)",
    )
    create.add_argument(
        "--team", dest="team_id", help="only this team's events (default: every team's)"
    )
    create.add_argument(
        "--secret-env",
        metavar="NAME",
        help="the environment variable holding the signing secret, 16 to 200 printable "
        "characters (default: one generated, printed once)",
    )
    leaf(webhooks, "delete", "stop sending to a webhook", delete_webhook).add_argument(
        "id", help="the webhook's id"
    )
    leaf(webhooks, "test", "send a webhook.test event", test_webhook).add_argument(
        "id", help="the webhook's id"
    )
    deliveries = leaf(
        webhooks, "deliveries", "recent deliveries, newest first, with their attempts",
        list_deliveries,
    )  # fmt: skip
    deliveries.add_argument("id", help="the webhook's id")
    deliveries.add_argument(
        "--limit", type=positive, default=50, help="the most deliveries to list"
    )
