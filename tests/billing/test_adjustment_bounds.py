"""Corrections inside bounds: an adjustment is at most 1,000,000 USD either way, never takes a
counter it changes below zero or past its ceiling, counts at a moment that is not in the future
and not past the reach of ingested usage, and is checked and written in one transaction; a
rerate never refuses, but reports the budgets it took past their limit and alerts for them."""

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx

from metering.money import cost_pico, format_usd
from tests.billing.test_ingest import post, rfc, usage_event
from tests.billing.test_rerate import RIGHT
from tests.budgets.conftest import wait_for

MILLION = "1000000"


def adjust(api, **body):
    return api.request("POST", "/v1/adjustments", json={"reason": "probe", **body})


def refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)
    return error["message"]


def spent(api, scope: str, subject_id: str) -> Decimal:
    return Decimal(api.ok("GET", f"/v1/{scope}s/{subject_id}/budget")["spent"])


def adjustments_of(api, team_id: str) -> list[dict]:
    return [e for e in api.events(team_id=team_id) if e["kind"] == "adjustment"]


def test_adjustments_of_a_million_stop_at_the_counters_ceiling(api):
    team = api.team()
    answers = [adjust(api, team_id=team["id"], amount=MILLION) for _ in range(10)]
    assert [a.status_code for a in answers[:9]] == [201] * 9
    message = refused(answers[9], "amount")
    assert "9000000" in message
    assert spent(api, "team", team["id"]) == Decimal("9000000")
    assert len(adjustments_of(api, team["id"])) == 9
    now = datetime.now(UTC)
    params = {"team_id": team["id"], "start": rfc(now - timedelta(days=1)), "end": rfc(now)}
    assert api.ok("GET", "/v1/spend", params=params)["total"]["cost"] == "9000000"
    # A credit still goes through: the bound is on where the counter ends, not on its state.
    assert adjust(api, team_id=team["id"], amount="-" + MILLION).status_code == 201


def test_an_amount_beyond_a_million_either_way_is_refused(api):
    team = api.team()
    for amount in ("1000001", "-1000001", "1000000.000000000001"):
        message = refused(adjust(api, team_id=team["id"], amount=amount), "amount")
        assert "between -1000000 and 1000000" in message, message
    assert adjustments_of(api, team["id"]) == []


def test_a_credit_that_would_take_spent_below_zero_is_refused_and_changes_nothing(api):
    team, user, token = api.principal(team_limit="1")
    assert adjust(api, team_id=team["id"], amount="0.5").status_code == 201
    message = refused(adjust(api, team_id=team["id"], amount="-0.6"), "amount")
    assert "below zero" in message, message
    shown = api.ok("GET", f"/v1/teams/{team['id']}/budget")
    assert (shown["spent"], shown["remaining"]) == ("0.5", "0.5")
    # A credit to a user counts in its team too: the user's own spent is the bound.
    refused(adjust(api, user_id=user["id"], amount="-0.1"), "amount")
    assert spent(api, "user", user["id"]) == 0
    assert [a["cost"] for a in adjustments_of(api, team["id"])] == ["0.5"]
    assert adjust(api, team_id=team["id"], amount="-0.5").status_code == 201
    assert spent(api, "team", team["id"]) == 0


def test_a_credit_to_a_closed_window_stops_at_zero_too(api):
    team, _, token = api.principal(token_limit="1", interval="daily")
    yesterday = rfc(datetime.now(UTC) - timedelta(days=1))
    refused(adjust(api, token_id=token["id"], amount="-0.1", at=yesterday), "amount")
    assert adjustments_of(api, team["id"]) == []
    assert adjust(api, token_id=token["id"], amount="0.2", at=yesterday).status_code == 201
    assert adjust(api, token_id=token["id"], amount="-0.2", at=yesterday).status_code == 201
    assert spent(api, "token", token["id"]) == 0  # today's window was never touched


def test_a_rollup_past_the_ceiling_is_refused_though_the_window_has_room(api):
    """Hourly budgets: each hour's window is fresh, but the day's rollup row sums them all."""
    team = api.team(reset_interval="hourly")
    now = datetime.now(UTC)
    day = (now - timedelta(days=1)).replace(hour=10, minute=30, second=0, microsecond=0)
    first, second = rfc(day), rfc(day + timedelta(hours=1))
    for _ in range(9):
        assert adjust(api, team_id=team["id"], amount=MILLION, at=first).status_code == 201
    message = refused(adjust(api, team_id=team["id"], amount=MILLION, at=second), "amount")
    assert "spend_daily" in message, message
    assert adjust(api, team_id=team["id"], amount="-1", at=first).status_code == 201
    params = {"team_id": team["id"], "start": rfc(day.replace(hour=0)), "end": rfc(now)}
    assert api.ok("GET", "/v1/spend", params=params)["total"]["cost"] == "8999999"


def test_at_is_neither_in_the_future_nor_past_the_reach_of_ingested_usage(api):
    team = api.team()
    now = datetime.now(UTC)
    for at in (
        rfc(now + timedelta(hours=1)),
        "9999-12-31T23:30:00Z",
        rfc(now - timedelta(days=36)),
        "0001-01-01T00:00:00Z",
    ):
        refused(adjust(api, team_id=team["id"], amount="1", at=at), "at")
    assert adjustments_of(api, team["id"]) == []
    assert spent(api, "team", team["id"]) == 0
    past = rfc(now - timedelta(days=34))
    assert adjust(api, team_id=team["id"], amount="1", at=past).status_code == 201


def test_concurrent_credits_together_never_pass_zero(api):
    team = api.team()
    assert adjust(api, team_id=team["id"], amount="1").status_code == 201

    def credit(_: int) -> int:
        with httpx.Client(base_url=api.url, timeout=60) as client:
            response = client.post(
                "/v1/adjustments",
                json={"team_id": team["id"], "amount": "-0.25", "reason": "race"},
                headers={"authorization": f"Bearer {api.settings.admin_key}"},
            )
            return response.status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(credit, range(8)))
    assert sorted(statuses) == [201] * 4 + [400] * 4
    assert spent(api, "team", team["id"]) == 0
    assert len(adjustments_of(api, team["id"])) == 5


CHEAP = {  # planted: ten times too cheap
    "input_usd_per_mtok": "0.015",
    "cached_input_usd_per_mtok": "0.0075",
    "output_usd_per_mtok": "0.06",
}


def test_a_rerate_past_a_limit_reports_the_budget_and_alerts(own_server):
    own = own_server(gpt=CHEAP)
    api = own.api
    now = datetime.now(UTC)
    team = api.team()
    user = api.user(team["id"])
    token = api.token(user["id"], "0.001")
    events = [usage_event(token_id=token["id"]) for _ in range(5)]
    assert {r["status"] for r in post(api, events)} == {"created"}
    assert spent(api, "token", token["id"]) == Decimal("0.0001575")  # under its 0.001

    effective = (now - timedelta(days=1)).replace(microsecond=0)
    own.write_catalog(effective_from=rfc(effective))
    body = {
        "provider": "sim-openai",
        "model": "gpt-sim",
        "start": rfc(now - timedelta(hours=1)),
        "end": rfc(now + timedelta(hours=1)),
        "reason": "gpt-sim was priced a tenth",
    }

    def rerated():
        result = api.ok("POST", "/v1/rerate", json=body)
        return result if result["adjusted"] else None

    result = wait_for(rerated, message="the back-dated price")
    right = 5 * cost_pico(1000, 200, 300, *RIGHT)
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert budget["spent"] == format_usd(right) == "0.001575"
    assert result == {
        "adjusted": 5,
        "difference": "0.0014175",
        "over_limit": [
            {
                "scope": "token",
                "id": token["id"],
                "window_start": budget["window_start"],
                "credit_limit": "0.001",
                "spent": "0.001575",
            }
        ],
    }
    found = api.ok(
        "GET",
        "/v1/alerts",
        params={"type": "budget.exhausted", "subject_id": token["id"]},
    )["data"]
    assert len(found) == 1
    data = found[0]["data"]
    assert (data["scope"], data["team_id"]) == ("token", team["id"])
    assert (data["credit_limit"], data["spent"], data["remaining"]) == ("0.001", "0.001575", "0")
    # Nothing left to correct: nothing reported.
    again = api.ok("POST", "/v1/rerate", json=body)
    assert again == {"adjusted": 0, "difference": "0", "over_limit": []}


def test_reports_add_up_teams_past_what_one_counter_holds(api):
    """Each team under the counters' ceiling, together past 64 bits of picodollars: every
    report still adds them up exactly (SQLite's own sum() would raise "integer overflow")."""
    teams = [api.team() for _ in range(2)]
    for team in teams:
        for _ in range(9):
            assert adjust(api, team_id=team["id"], amount=MILLION).status_code == 201
    ids = [t["id"] for t in teams]
    for group_by in ("team", "day", "team,day"):
        report = api.ok("GET", "/v1/spend", params={"group_by": group_by, "limit": 1000})
        assert Decimal(report["total"]["cost"]) >= Decimal("18000000"), group_by
        if "team" in group_by:
            ours = [r for r in report["rows"] if r["team_id"] in ids]
            assert sorted(Decimal(r["cost"]) for r in ours) == [Decimal("9000000")] * 2
    everything = api.request("GET", "/v1/spend", params={"group_by": "team", "format": "csv"})
    assert everything.status_code == 200, everything.text
