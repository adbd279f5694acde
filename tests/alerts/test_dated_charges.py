"""Charges that do not come from a settle (POST /v1/adjustments, POST /v1/events) take the
settle's charge path: a threshold they pass alerts as a settle's would, once; a credit raises
nothing."""

from decimal import Decimal

from tests.alerts.conftest import alerts
from tests.billing.test_ingest import post, usage_event


def _crossed(api, subject_id: str) -> list[tuple[int, str]]:
    found = alerts(api, subject_id=subject_id, type="budget.threshold_crossed")
    return sorted((e["data"]["threshold"], e["data"]["spent"]) for e in found)


def _adjust(api, token_id: str, amount: str) -> dict:
    body = {"token_id": token_id, "amount": amount, "reason": "correction"}
    return api.ok("POST", "/v1/adjustments", 201, json=body)


def test_an_adjustment_that_passes_a_threshold_alerts_and_a_credit_does_not(alerts_api):
    team, user, token = alerts_api.principal(token_limit="1")
    assert _adjust(alerts_api, token["id"], "0.6")["cost"] == "0.6"
    assert _crossed(alerts_api, token["id"]) == [(50, "0.6")]
    (crossed,) = alerts(alerts_api, subject_id=token["id"], type="budget.threshold_crossed")
    assert crossed["data"]["team_id"] == team["id"] and crossed["data"]["scope"] == "token"
    # A credit passes no threshold; the next charge past 80% alerts that one only.
    assert _adjust(alerts_api, token["id"], "-0.2")["cost"] == "-0.2"
    assert _crossed(alerts_api, token["id"]) == [(50, "0.6")]
    _adjust(alerts_api, token["id"], "0.45")
    assert _crossed(alerts_api, token["id"]) == [(50, "0.6"), (80, "0.85")]
    budget = alerts_api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["spent"]) == Decimal("0.85")


def test_ingested_usage_that_passes_a_threshold_alerts(alerts_api):
    team, user, token = alerts_api.principal(user_limit="0.001")
    events = [usage_event(token_id=token["id"]) for _ in range(3)]
    assert {r["status"] for r in post(alerts_api, events)} == {"created"}
    spent = Decimal(alerts_api.ok("GET", f"/v1/users/{user['id']}/budget")["spent"])
    reached = [p for p in (50, 80, 100) if spent * 100 >= Decimal("0.001") * p]
    assert reached  # the three events pass at least the first threshold
    found = alerts(alerts_api, subject_id=user["id"], type="budget.threshold_crossed")
    assert sorted(e["data"]["threshold"] for e in found) == reached
    assert {e["data"]["team_id"] for e in found} == {team["id"]}
