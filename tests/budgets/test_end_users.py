"""Budgets per end user: a team's default budget for each of its end users, one end user's
override, the end user held as a fifth scope (402 x-budget-scope: end_user, max_tokens clamped
to fit), its window's reset, its alerts, and the routes' bad inputs. Both databases, the real
server, the openai SDK as the client."""

import uuid
from decimal import Decimal
from urllib.parse import quote

import openai
import pytest
from sqlalchemy import select

from metering.budgets.end_users import subject_of
from metering.models import BudgetWindow, Hold
from metering.timefmt import parse_rfc3339
from tests.budgets.conftest import marker, pico, query, usd

MESSAGES = [{"role": "user", "content": "count to three sim:tokens=64"}]
# One request with max_tokens=64: a hold of about 0.000065 USD, a cost of about 0.000041.
ONE = "0.0001"


def end_user_team(api, limit: str | None = ONE, interval: str = "never") -> dict:
    return api.ok(
        "POST",
        "/v1/teams",
        201,
        json={
            "name": f"team-{uuid.uuid4().hex[:8]}",
            "end_user_credit_limit": limit,
            "end_user_reset_interval": interval,
        },
    )


def member(api, team: dict) -> tuple[dict, dict]:
    user = api.user(team["id"])
    return user, api.token(user["id"])


def call(client, end_user: str | None, **fields):
    """(status, headers, body) of one completion, for `end_user` (None: without one)."""
    headers = {"x-metering-end-user": end_user} if end_user is not None else {}
    fields.setdefault("max_tokens", 64)
    if fields["max_tokens"] is None:
        del fields["max_tokens"]
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-sim",
            messages=[{"role": "user", "content": f"{marker()} sim:tokens=64"}],
            extra_headers=headers,
            **fields,
        )
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.headers, exc.response.json()
    return raw.http_response.status_code, raw.http_response.headers, raw.parse()


def path(team_id: str, end_user: str) -> str:
    return f"/v1/teams/{team_id}/end-users/{quote(end_user, safe='')}/budget"


def end_user_budget(api, team_id: str, end_user: str, key: str | None = None) -> dict:
    return api.ok("GET", path(team_id, end_user), key=key)


def costs(api, token_id: str, request_ids: list[str]) -> Decimal:
    """What the ledger charged for these requests."""
    events = {e["id"]: e for e in api.events(token_id=token_id)}
    return sum((Decimal(events[i]["cost"]) for i in request_ids), Decimal(0))


def test_a_team_default_refuses_one_end_user_while_others_are_served(api):
    team = end_user_team(api, ONE, "daily")
    assert (team["end_user_credit_limit"], team["end_user_reset_interval"]) == ("0.0001", "daily")
    shown = api.ok("GET", f"/v1/teams/{team['id']}")
    assert (shown["end_user_credit_limit"], shown["end_user_reset_interval"]) == ("0.0001", "daily")
    _, token = member(api, team)
    client = api.openai(token["token"])

    status, first, _ = call(client, "alice")
    assert status == 200
    status, headers, body = call(client, "alice")
    assert status == 402
    assert body["error"]["code"] == "budget_exceeded"
    assert headers["x-budget-scope"] == "end_user"
    alice = end_user_budget(api, team["id"], "alice")
    assert headers["x-budget-resets-at"] == alice["resets_at"]
    # Named by the body's `user` instead of the header: the same end user, the same budget.
    status, headers, _ = call(client, None, user="alice")
    assert status == 402 and headers["x-budget-scope"] == "end_user"
    assert parse_rfc3339(alice["resets_at"]).time().isoformat() == "00:00:00"
    # Another end user, and requests without one, are served.
    assert call(client, "bob")[0] == 200
    assert call(client, None)[0] == 200
    assert call(client, None)[0] == 200

    spent = costs(api, token["id"], [first["x-request-id"]])
    assert spent > 0
    assert alice["id"] == subject_of(team["id"], "alice")
    assert (alice["scope"], alice["team_id"], alice["end_user"]) == (
        "end_user",
        team["id"],
        "alice",
    )
    assert (alice["credit_limit"], alice["reset_interval"], alice["override"]) == (
        "0.0001",
        "daily",
        False,
    )
    assert usd(alice["spent"]) == spent and usd(alice["reserved"]) == 0
    assert usd(alice["remaining"]) == Decimal(ONE) - spent
    # The refusal is recorded, naming the end user's budget.
    refused = api.ok("GET", "/v1/refusals", params={"token_id": token["id"]})["data"]
    assert [(r["reason"], r["scope"], r["subject_id"]) for r in refused] == [
        ("budget", "end_user", alice["id"])
    ] * 2
    # Without an end user no hold names one; nothing is left held.
    assert not query(api.settings.database_url, select(Hold.id).where(Hold.team_id == team["id"]))


def test_an_override_raises_one_end_user_and_delete_returns_it_to_the_default(api):
    team = end_user_team(api)
    user, token = member(api, team)
    client = api.openai(token["token"])
    served = [call(client, "carol")[1]["x-request-id"]]
    assert call(client, "carol")[0] == 402

    raised = api.ok("PUT", path(team["id"], "carol"), json={"credit_limit": "0.001"})
    assert (raised["credit_limit"], raised["reset_interval"], raised["override"]) == (
        "0.001",
        "never",
        True,
    )
    for _ in range(2):
        status, headers, _ = call(client, "carol")
        assert status == 200
        served.append(headers["x-request-id"])
    spent = costs(api, token["id"], served)
    carol = end_user_budget(api, team["id"], "carol")
    assert usd(carol["spent"]) == spent and usd(carol["reserved"]) == 0
    assert usd(carol["remaining"]) == Decimal("0.001") - spent
    assert carol["override"] is True
    # Another end user keeps the team's default.
    assert end_user_budget(api, team["id"], "dave")["credit_limit"] == "0.0001"

    # A member of the team may read it, not change it; another team's member may not read it.
    assert end_user_budget(api, team["id"], "carol", key=token["token"]) == carol
    response = api.request(
        "PUT", path(team["id"], "carol"), key=token["token"], json={"credit_limit": "1"}
    )
    assert response.status_code == 403
    _, stranger = member(api, end_user_team(api))
    assert api.request("GET", path(team["id"], "carol"), key=stranger["token"]).status_code == 403

    api.ok("DELETE", path(team["id"], "carol"), 204)
    back = end_user_budget(api, team["id"], "carol")
    assert (back["credit_limit"], back["override"], usd(back["spent"])) == ("0.0001", False, spent)
    assert usd(back["remaining"]) == 0
    assert call(client, "carol")[0] == 402
    api.ok("DELETE", path(team["id"], "carol"), 204)  # already on the default: nothing to do
    assert user["team_id"] == team["id"]


def test_an_override_limits_an_end_user_of_a_team_without_a_default(api):
    team = end_user_team(api, limit=None)
    _, token = member(api, team)
    client = api.openai(token["token"])
    assert call(client, "erin")[0] == 200  # no default: not limited, no budget made
    assert api.ok("GET", f"/v1/teams/{team['id']}/end-users")["data"] == []
    api.ok("PUT", path(team["id"], "erin"), json={"credit_limit": "0.00007"})
    assert call(client, "erin")[0] == 200
    status, headers, _ = call(client, "erin")
    assert status == 402 and headers["x-budget-scope"] == "end_user"
    assert "x-budget-resets-at" not in headers  # never resets
    assert call(client, "frank")[0] == 200


def test_the_end_users_list_pages_with_their_spend(api):
    team = end_user_team(api, "0.01")
    _, token = member(api, team)
    client = api.openai(token["token"])
    names = ["zed", "a/b", "b c"]
    spent = {}
    for name in names:
        status, headers, _ = call(client, name)
        assert status == 200
        spent[name] = costs(api, token["id"], [headers["x-request-id"]])
    listing = f"/v1/teams/{team['id']}/end-users"
    first = api.ok("GET", listing, params={"limit": 2})["data"]
    assert [row["end_user"] for row in first] == ["a/b", "b c"]
    rest = api.ok("GET", listing, params={"limit": 2, "after": "b c"})["data"]
    assert [row["end_user"] for row in rest] == ["zed"]
    for row in first + rest:
        assert usd(row["spent"]) == spent[row["end_user"]]
        assert row["credit_limit"] == "0.01" and row["id"] == subject_of(
            team["id"], row["end_user"]
        )
        assert row == end_user_budget(api, team["id"], row["end_user"])
    assert api.ok("GET", listing, params={"after": "zed"})["data"] == []
    # An end user named in a path may be any printable text; an override lists it too.
    api.ok("PUT", path(team["id"], "zoë ☃"), json={"credit_limit": "1"})
    assert end_user_budget(api, team["id"], "zoë ☃")["end_user"] == "zoë ☃"
    assert len(api.ok("GET", listing)["data"]) == 4
    everyone = api.ok("GET", listing)["data"]
    assert {row["end_user"] for row in everyone} == {"a/b", "b c", "zed", "zoë ☃"}
    assert api.ok("GET", listing, key=token["token"])["data"] == everyone  # a member reads it


def test_max_tokens_is_clamped_to_fit_the_end_user_budget(api):
    team = end_user_team(api)
    _, token = member(api, team)
    client = api.openai(token["token"])
    status, headers, _ = call(client, "gina", max_tokens=None)
    assert status == 200
    clamped = int(headers["x-max-tokens-clamped"])
    assert 1 <= clamped < 4096
    spent = costs(api, token["id"], [headers["x-request-id"]])
    assert usd(end_user_budget(api, team["id"], "gina")["spent"]) == spent <= Decimal(ONE)
    # A max_tokens whose hold the budget cannot cover: refused, naming it.
    status, headers, body = call(client, "gina", max_tokens=4000)
    assert status == 402 and headers["x-budget-scope"] == "end_user"
    assert "end_user budget" in body["error"]["message"]


def test_an_end_users_window_resets(api, clock):
    team = end_user_team(api, ONE, "hourly")
    _, token = member(api, team)
    client = api.openai(token["token"])
    status, first, _ = call(client, "hank")
    assert status == 200
    status, headers, _ = call(client, "hank")
    assert status == 402
    before = end_user_budget(api, team["id"], "hank")
    resets_at = parse_rfc3339(headers["x-budget-resets-at"])
    assert before["resets_at"] == headers["x-budget-resets-at"]

    clock.move_to(resets_at)
    status, second, _ = call(client, "hank")
    assert status == 200
    after = end_user_budget(api, team["id"], "hank")
    assert parse_rfc3339(after["window_start"]) == resets_at
    assert usd(after["spent"]) == costs(api, token["id"], [second["x-request-id"]])
    assert usd(after["reserved"]) == 0
    windows = BudgetWindow.__table__
    rows = query(
        api.settings.database_url,
        select(windows.c.window_end, windows.c.spent, windows.c.scope).where(
            windows.c.subject_id == before["id"]
        ),
    )
    assert rows == [(resets_at, pico(before["spent"]), "end_user")]


def test_an_end_user_crossing_a_threshold_raises_an_alert(api):
    # One request's hold fits 0.00007; its cost (about 0.000041) passes 50% of it.
    team = end_user_team(api, "0.00007")
    _, token = member(api, team)
    client = api.openai(token["token"])
    assert call(client, "ivy")[0] == 200
    assert call(client, "ivy")[0] == 402
    subject = subject_of(team["id"], "ivy")
    found = api.ok("GET", "/v1/alerts", params={"scope": "end_user", "subject_id": subject})
    kinds = sorted((e["type"], e["data"].get("threshold")) for e in found["data"])
    assert kinds == [("budget.exhausted", None), ("budget.threshold_crossed", 50)]
    for event in found["data"]:
        assert (event["data"]["scope"], event["data"]["team_id"]) == ("end_user", team["id"])
        # The end user as its client named it, next to its budget's id.
        assert (event["data"]["subject_id"], event["data"]["end_user"]) == (subject, "ivy")
    # Another scope's events carry no end_user.
    others = api.ok("GET", "/v1/alerts", params={"scope": "token", "limit": 5})["data"]
    assert all("end_user" not in e["data"] for e in others)
    ivy = end_user_budget(api, team["id"], "ivy")
    crossed = next(e for e in found["data"] if e["type"] == "budget.threshold_crossed")
    assert crossed["data"]["spent"] == ivy["spent"]


def test_a_team_default_changed_later_applies_to_its_end_users(api):
    team = end_user_team(api)
    _, token = member(api, team)
    client = api.openai(token["token"])
    assert call(client, "jack")[0] == 200
    assert call(client, "jack")[0] == 402
    api.ok("PATCH", f"/v1/teams/{team['id']}", json={"end_user_credit_limit": "0.001"})
    assert end_user_budget(api, team["id"], "jack")["credit_limit"] == "0.001"
    assert call(client, "jack")[0] == 200
    patched = api.ok("PATCH", f"/v1/teams/{team['id']}", json={"end_user_credit_limit": None})
    assert patched["end_user_credit_limit"] is None
    assert end_user_budget(api, team["id"], "jack")["credit_limit"] is None
    for _ in range(3):
        assert call(client, "jack")[0] == 200  # no default, no override: not limited


@pytest.mark.parametrize(
    ("method", "where", "body", "param"),
    [
        ("PUT", "x" * 257, {"credit_limit": "1"}, "end_user"),
        ("PUT", "tab\there", {"credit_limit": "1"}, "end_user"),
        ("GET", "\x01", None, "end_user"),
        ("DELETE", "", None, "end_user"),
        ("PUT", "ok", {"credit_limit": "-1"}, "credit_limit"),
        ("PUT", "ok", {"credit_limit": "ten"}, "credit_limit"),
        ("PUT", "ok", {"credit_limit": 1.5}, "credit_limit"),
        ("PUT", "ok", {"credit_limit": "1", "reset_interval": "fortnightly"}, "reset_interval"),
        ("PUT", "ok", {}, "credit_limit"),
    ],
)
def test_bad_end_user_budget_inputs_are_400_naming_the_field(api, method, where, body, param):
    team = end_user_team(api)
    response = api.request(method, path(team["id"], where), json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("method", "body", "param"),
    [
        ("POST", {"end_user_credit_limit": "lots"}, "end_user_credit_limit"),
        ("POST", {"end_user_reset_interval": "5x"}, "end_user_reset_interval"),
        ("PATCH", {"end_user_credit_limit": -1}, "end_user_credit_limit"),
        ("PATCH", {"end_user_reset_interval": "DAILY"}, "end_user_reset_interval"),
    ],
)
def test_bad_team_end_user_defaults_are_400_naming_the_field(api, method, body, param):
    if method == "POST":
        response = api.request("POST", "/v1/teams", json={"name": f"t-{marker()}", **body})
    else:
        response = api.request("PATCH", f"/v1/teams/{end_user_team(api)['id']}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_unknown_team_is_404(api):
    assert api.request("GET", path("team_nope", "x")).status_code == 404
    assert api.request("PUT", path("team_nope", "x"), json={"credit_limit": "1"}).status_code == 404
    assert api.request("GET", "/v1/teams/team_nope/end-users").status_code == 404
