"""Thresholds are recorded where spend changes, once per budget, threshold and window, whatever
the interleaving; a window that resets re-arms them; the first refusal of a window is
budget.exhausted (again when the limit changes)."""

import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import openai
import pytest

from metering.timefmt import parse_rfc3339
from tests.alerts.conftest import alerts, ask, hold_of, start_server, wait_for
from tests.budgets.conftest import budget

KEY = "metrics-" + uuid.uuid4().hex


def tag() -> str:
    return f"t{uuid.uuid4().hex[:16]}"  # one length: every request has the same hold


def _try(api, key: str) -> bool:
    try:
        ask(api, key, tag())
        return True
    except openai.APIStatusError as exc:
        assert exc.status_code == 402, exc  # noqa: PT017 - a helper that answers, not a test
        return False


def _fill(apis, key: str, requests: int) -> None:
    """A burst of requests spread over the replicas, all at once."""
    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(lambda i: _try(apis[i % len(apis)], key), range(requests)))


def _top_up(api, token_id: str, key: str, limit: Decimal) -> None:
    """Requests until the budget is full (a replica's unused lease is returned within a
    second of its last use, so a refusal meanwhile is retried)."""

    def full() -> bool:
        if Decimal(budget(api, "token", token_id)["spent"]) >= limit:
            return True
        _try(api, key)
        return Decimal(budget(api, "token", token_id)["spent"]) >= limit

    wait_for(full, timeout=30, interval=0.2, message="the budget filling up")


def _crossed(api, subject_id: str) -> list[int]:
    return sorted(
        e["data"]["threshold"]
        for e in alerts(api, subject_id=subject_id, type="budget.threshold_crossed")
    )


def test_a_burst_over_two_replicas_crosses_each_threshold_once(alerts_db, alerts_api, sim):
    second, other = start_server(alerts_db, sim)
    try:
        apis = [alerts_api, other] if alerts_api.backend == "postgresql" else [alerts_api]
        hold = Decimal(hold_of(alerts_api, tag()))
        limit = hold * 10
        _, _, token = alerts_api.principal(token_limit=str(limit))
        _fill(apis, token["token"], 16)
        _top_up(alerts_api, token["id"], token["token"], limit)
        assert not _try(alerts_api, token["token"])  # full: refused

        assert _crossed(alerts_api, token["id"]) == [50, 80, 100]
        crossed = alerts(alerts_api, subject_id=token["id"], type="budget.threshold_crossed")
        (data,) = [e["data"] for e in crossed if e["data"]["threshold"] == 100]
        assert data["scope"] == "token" and data["credit_limit"] == str(limit).rstrip("0")
        assert Decimal(data["spent"]) == limit and Decimal(data["remaining"]) == 0
        assert data["threshold"] == 100 and data["resets_at"] is None
        exhausted = alerts(alerts_api, subject_id=token["id"], type="budget.exhausted")
        assert len(exhausted) == 1
        assert exhausted[0]["data"]["team_id"] is not None
    finally:
        second.stop()


def test_a_changed_limit_re_arms_budget_exhausted(alerts_api):
    hold = Decimal(hold_of(alerts_api, tag()))
    _, _, token = alerts_api.principal(token_limit=str(hold))
    key = token["token"]
    _top_up(alerts_api, token["id"], key, hold)
    assert not _try(alerts_api, key) and not _try(alerts_api, key)  # refused twice: one event
    (first,) = alerts(alerts_api, subject_id=token["id"], type="budget.exhausted")

    raised = hold * 2
    alerts_api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": str(raised)})
    _top_up(alerts_api, token["id"], key, raised)
    assert not _try(alerts_api, key) and not _try(alerts_api, key)
    exhausted = alerts(alerts_api, subject_id=token["id"], type="budget.exhausted")
    assert len(exhausted) == 2
    limits = sorted(Decimal(e["data"]["credit_limit"]) for e in exhausted)
    assert limits == [hold, raised]
    assert first["id"] in {e["id"] for e in exhausted}


def test_a_soft_limit_alerts_once_and_never_refuses(alerts_api):
    hold = Decimal(hold_of(alerts_api, tag()))
    team = alerts_api.team()
    user = alerts_api.user(team["id"])
    token = alerts_api.ok(
        "POST",
        f"/v1/users/{user['id']}/tokens",
        201,
        json={"name": "soft", "soft_limit": str(hold * 2), "alert_thresholds": []},
    )
    assert token["soft_limit"] == str(hold * 2).rstrip("0") and token["alert_thresholds"] == []
    for _ in range(4):
        assert _try(alerts_api, token["token"])  # past the soft limit: still served
    (soft,) = alerts(alerts_api, subject_id=token["id"], type="budget.soft_limit_reached")
    assert Decimal(soft["data"]["spent"]) == hold * 2
    assert soft["data"]["soft_limit"] == token["soft_limit"]
    assert _crossed(alerts_api, token["id"]) == []


def test_a_window_reset_re_arms_the_thresholds(alerts_api, alerts_clock):
    hold = Decimal(hold_of(alerts_api, tag()))
    _, _, token = alerts_api.principal(token_limit=str(hold * 3 / 2), interval="3s")
    key = token["token"]
    assert _try(alerts_api, key)  # 2/3 of the limit: 50% crossed
    first = budget(alerts_api, "token", token["id"])
    assert _crossed(alerts_api, token["id"]) == [50]
    # Into the next window (the first request after the boundary rolls it).
    alerts_clock.move_to(parse_rfc3339(first["resets_at"]))
    wait_for(
        lambda: budget(alerts_api, "token", token["id"])["window_start"] != first["window_start"],
        message="the next window",
    )
    assert _try(alerts_api, key)
    assert _crossed(alerts_api, token["id"]) == [50, 50]
    (reset,) = alerts(alerts_api, subject_id=token["id"], type="budget.window_reset")
    assert reset["data"]["window_start"] == first["window_start"]
    assert Decimal(reset["data"]["spent"]) == hold


def test_a_user_sees_its_own_alerts_and_the_admin_all(alerts_api):
    hold = Decimal(hold_of(alerts_api, tag()))
    _, user, token = alerts_api.principal(token_limit=str(hold * 3 / 2))
    _, _, other = alerts_api.principal(token_limit=str(hold * 3 / 2))
    assert _try(alerts_api, token["token"]) and _try(alerts_api, other["token"])
    mine = alerts(alerts_api, key=token["token"])
    assert {e["data"]["subject_id"] for e in mine} == {token["id"]}
    assert {e["data"]["subject_id"] for e in alerts(alerts_api)} >= {token["id"], other["id"]}
    assert alerts(alerts_api, key=token["token"], scope="team") == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("alert_thresholds", [0]),
        ("alert_thresholds", [101]),
        ("alert_thresholds", ["50"]),
        ("alert_thresholds", 50),
        ("alert_thresholds", list(range(1, 12))),
        ("soft_limit", 1.5),
        ("soft_limit", "-1"),
    ],
)
def test_alert_fields_out_of_bounds_are_refused(alerts_api, field, value):
    answer = alerts_api.request(
        "POST", "/v1/teams", json={"name": "t", "credit_limit": "1", field: value}
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"


def test_thresholds_are_set_and_changed_with_the_budget(alerts_api):
    team = alerts_api.ok(
        "POST",
        "/v1/teams",
        201,
        json={"name": "t", "credit_limit": "10", "alert_thresholds": [90, 25, 25]},
    )
    assert team["alert_thresholds"] == [25, 90] and team["soft_limit"] is None
    patched = alerts_api.ok(
        "PATCH", f"/v1/teams/{team['id']}", json={"alert_thresholds": None, "soft_limit": "7"}
    )
    assert patched["alert_thresholds"] == [50, 80, 100] and patched["soft_limit"] == "7"


def test_metrics_show_how_much_of_a_budget_is_used(alerts_api, sim):
    """Behind METERING_METRICS_KEY: read from a replica with the key on the same database."""
    hold = Decimal(hold_of(alerts_api, tag()))
    _, _, token = alerts_api.principal(token_limit=str(hold * 4))
    assert _try(alerts_api, token["token"])
    keyed, api = start_server(alerts_api.settings.database_url, sim, False, metrics_key=KEY)
    try:
        text = api.request("GET", "/metrics", key=KEY).text
    finally:
        keyed.stop()
    line = f'metering_budget_used_ratio{{scope="token",subject_id="{token["id"]}"}} 0.25'
    assert line in text.splitlines()
