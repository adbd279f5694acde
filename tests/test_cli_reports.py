"""`metering spend` and `metering usage` against a live server on both databases, in the three
formats, their output parsed and compared with the API's own answers."""

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from metering.cli import parser, reports
from tests.cli_runner import table_rows


@pytest.fixture(scope="module")
def traffic(api):
    """A team, user and token of their own, with two gpt-sim requests (the second by the end
    user alice, tagged env:prod) and one minimax-m2.1."""
    team, user, token = api.principal()
    client = api.openai(token["token"])
    for model, tokens in (("gpt-sim", 7), ("gpt-sim", 11), ("minimax-m2.1", 5)):
        # the second request names an end user and carries tags
        attributed = tokens == 11
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"sim:tokens={tokens}"}],
            extra_headers={"x-metering-end-user": "alice", "x-metering-tags": '{"env": "prod"}'}
            if attributed
            else None,
        )
    return {"team": team, "user": user, "token": token}


def window() -> dict[str, str]:
    """A fixed range around now, so the CLI's report and the API's are the same report."""
    now = datetime.now(UTC).replace(microsecond=0)
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    return {
        "start": (now - timedelta(days=1)).strftime(fmt),
        "end": (now + timedelta(hours=1)).strftime(fmt),
    }


def rows_of(text: str) -> tuple[list[dict], dict]:
    """A spend table's rows and its total row (under the rule)."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "})
    header = lines[0]
    rows = table_rows("\n".join([header, *lines[1:rule]]))
    [total] = table_rows("\n".join([header, *lines[rule + 1 :]]))
    return rows, total


def test_spend_as_json_is_the_apis_report(api, cli, traffic):
    span = window()
    token_id = traffic["token"]["id"]
    got = cli.json("spend", "--token", token_id, "--group-by", "model", "--start", span["start"],
                   "--end", span["end"])  # fmt: skip
    expected = api.ok(
        "GET", "/v1/spend", params={**span, "token_id": token_id, "group_by": "model"}
    )
    assert got == expected
    assert [(r["model"], r["requests"]) for r in got["rows"]] == [
        ("gpt-sim", 2),
        ("minimax-m2.1", 1),
    ]


def test_spend_as_csv_and_as_a_table_has_the_same_rows(api, cli, traffic):
    span = window()
    args = ("spend", "--team", traffic["team"]["id"], "--group-by", "model,provider",
            "--start", span["start"], "--end", span["end"])  # fmt: skip
    report = cli.json(*args)
    lines = cli.csv(*args)
    assert [(r["model"], r["provider"], int(r["requests"]), Decimal(r["cost"])) for r in lines] == [
        (r["model"], r["provider"], r["requests"], Decimal(r["cost"])) for r in report["rows"]
    ]
    rows, total = rows_of(cli(*args))
    assert [(r["model"], r["provider"], int(r["requests"]), Decimal(r["cost"])) for r in rows] == [
        (r["model"], r["provider"], r["requests"], Decimal(r["cost"])) for r in report["rows"]
    ]
    assert (total["model"], int(total["requests"])) == ("total", 3)
    assert Decimal(total["cost"]) == Decimal(report["total"]["cost"]) > 0
    assert int(total["completion_tokens"]) == 7 + 11 + 5


def test_spend_filters_narrow_as_the_api_does(api, cli, traffic):
    span = window()
    for option, param, value in (
        ("--user", "user_id", traffic["user"]["id"]),
        ("--model", "model", "gpt-sim"),
        ("--provider", "provider", "sim-exascale"),
    ):
        got = cli.json("spend", option, value, "--team", traffic["team"]["id"],
                       "--start", span["start"], "--end", span["end"])["total"]  # fmt: skip
        params = {**span, param: value, "team_id": traffic["team"]["id"]}
        assert got == api.ok("GET", "/v1/spend", params=params)["total"], option
    by_day = cli.json("spend", "--token", traffic["token"]["id"], "--group-by", "model",
                      "--group-by", "day")  # fmt: skip
    assert by_day["group_by"] == ["model", "day"] and len(by_day["rows"]) == 2


def test_a_users_own_token_reads_its_own_spend(api, cli, traffic, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", traffic["token"]["token"])
    own = cli.json("spend", "--key-env", "MY_TOKEN")["total"]
    assert (own["requests"], own["completion_tokens"]) == (3, 23)


def test_usage_as_json_pages_through_with_the_cursor(api, cli, traffic):
    token_id = traffic["token"]["id"]
    events = api.events(token_id=token_id)
    first = cli.json("usage", "--token", token_id, "--limit", "2")
    assert [e["id"] for e in first["data"]] == [e["id"] for e in events[:2]]
    assert first["next_cursor"]
    rest = cli.json("usage", "--token", token_id, "--cursor", first["next_cursor"])
    assert [e["id"] for e in rest["data"]] == [events[2]["id"]] and rest["next_cursor"] is None
    assert first["data"] + rest["data"] == events


def test_usage_as_csv_is_the_servers_pages_under_one_header(api, cli, traffic, monkeypatch):
    monkeypatch.setattr(reports, "USAGE_PAGE", 2)  # three events: two pages
    token_id = traffic["token"]["id"]
    text = cli("usage", "--token", token_id, "--format", "csv")
    assert text.count("\nid,") == 0 and text.startswith("id,")
    lines = list(csv.DictReader(io.StringIO(text)))
    events = api.events(token_id=token_id)
    assert [(r["id"], r["model"], Decimal(r["cost"])) for r in lines] == [
        (e["id"], e["model"], Decimal(e["cost"])) for e in events
    ]
    limited = list(
        csv.DictReader(
            io.StringIO(cli("usage", "--token", token_id, "--format", "csv", "--limit", "1"))
        )
    )
    assert [r["id"] for r in limited] == [events[0]["id"]]
    assert "--cursor " in cli.err  # where the next ones start


def test_usage_as_a_table_and_its_filters(api, cli, traffic):
    token_id = traffic["token"]["id"]
    rows = cli.table("usage", "--token", token_id)
    events = api.events(token_id=token_id)
    assert [(r["id"], r["model"], r["status"], Decimal(r["cost"])) for r in rows] == [
        (e["id"], e["model"], e["status"], Decimal(e["cost"])) for e in events
    ]
    assert [int(r["completion_tokens"]) for r in rows] == [5, 11, 7]
    only = cli.json("usage", "--team", traffic["team"]["id"], "--model", "minimax-m2.1")["data"]
    assert [e["id"] for e in only] == [events[0]["id"]]
    labelled = cli.table("usage", "--user", traffic["user"]["id"], "--labels", "--limit", "1")
    assert labelled[0]["user_email"] == traffic["user"]["email"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_bad_filter_is_the_apis_400(cli):
    err = cli.error("spend", "--group-by", "weather")
    assert err.startswith("metering: 400 invalid_request: ") and "weather" in err
    err = cli.error("usage", "--start", "yesterday")
    assert err.startswith("metering: 400 invalid_request: ") and "start" in err


def test_tags_and_the_end_user_are_sent_as_the_api_takes_them():
    args = parser().parse_args(
        ["usage", "--end-user", "alice", "--tag", "team:ml", "--tag", "env:prod", "--labels"]
    )
    assert reports.query(args) == [
        ("end_user", "alice"), ("tag", "team:ml"), ("tag", "env:prod"), ("labels", "true")
    ]  # fmt: skip


def test_spend_without_grouping_is_one_line_of_totals(api, cli, traffic):
    [total] = cli.table("spend", "--token", traffic["token"]["id"])
    expected = api.ok("GET", "/v1/spend", params={"token_id": traffic["token"]["id"]})["total"]
    assert (int(total["requests"]), Decimal(total["cost"])) == (3, Decimal(expected["cost"]))
    assert int(total["completion_tokens"]) == expected["completion_tokens"] == 23


def test_usage_filters_on_the_end_user_and_tags(api, cli, traffic):
    token_id = traffic["token"]["id"]
    [event] = cli.json("usage", "--token", token_id, "--end-user", "alice")["data"]
    assert (event["end_user"], event["tags"], event["completion_tokens"]) == (
        "alice", {"env": "prod"}, 11
    )  # fmt: skip
    tagged = cli.json("usage", "--token", token_id, "--tag", "env:prod")["data"]
    assert [e["id"] for e in tagged] == [event["id"]]
    assert (
        cli.json("usage", "--token", token_id, "--tag", "env:prod", "--tag", "env:dev")["data"]
        == []
    )  # every tag must match
    rows = cli.table("usage", "--token", token_id)
    assert [r["end_user"] for r in rows] == ["-", "alice", "-"]  # shown when an event has one
    [line] = cli.csv("usage", "--token", token_id, "--end-user", "alice")
    assert (line["id"], line["end_user"], json.loads(line["tags"])) == (
        event["id"], "alice", {"env": "prod"}
    )  # fmt: skip
