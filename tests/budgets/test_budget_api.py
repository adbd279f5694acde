"""GET /v1/{tokens,users,teams}/{id}/budget, and PATCH of limits and intervals."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from metering.timefmt import parse_rfc3339
from tests.budgets.conftest import budget, chat, marker, usd

SCOPES = ("token", "user", "team")


def _midnight(now: datetime) -> datetime:
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _subjects(team, user, token) -> dict[str, str]:
    return {"token": token["id"], "user": user["id"], "team": team["id"]}


def test_budgets_after_a_request(api):
    limits = {"token": "1.25", "user": "2.5", "team": "10"}
    team, user, token = api.principal(
        token_limit=limits["token"],
        user_limit=limits["user"],
        team_limit=limits["team"],
        interval="daily",
    )
    response = chat(api, token["token"], f"status {marker()} sim:tokens=12", max_tokens=40)
    assert response.status_code == 200, response.text
    [event] = api.events(token_id=token["id"])
    assert event["id"] == response.headers["x-request-id"]
    assert event["completion_tokens"] == 12
    cost = usd(event["cost"])
    assert cost == (
        Decimal(event["prompt_tokens"]) * Decimal("0.15") + 12 * Decimal("0.60")
    ) / Decimal(10**6)

    before = datetime.now(UTC)
    for scope, subject in _subjects(team, user, token).items():
        for key in (None, token["token"]):  # the admin, and the user's own token
            status = budget(api, scope, subject, key=key)
            assert set(status) == {
                "scope",
                "id",
                "credit_limit",
                "reset_interval",
                "window_start",
                "resets_at",
                "spent",
                "reserved",
                "remaining",
                "alert_thresholds",
                "threshold_passed",
            }
            assert status["alert_thresholds"] == [50, 80, 100]
            assert status["threshold_passed"] is None
            assert status["scope"] == scope
            assert status["id"] == subject
            assert usd(status["credit_limit"]) == Decimal(limits[scope])
            assert status["reset_interval"] == "daily"
            assert usd(status["spent"]) == cost
            assert usd(status["reserved"]) == 0
            assert usd(status["remaining"]) == Decimal(limits[scope]) - cost
            start = parse_rfc3339(status["window_start"])
            assert start == _midnight(before) or start == _midnight(datetime.now(UTC))
            assert parse_rfc3339(status["resets_at"]) == start + timedelta(days=1)


def test_resets_at_for_fixed_and_never(api):
    team, user, token = api.principal(token_limit="1", interval="never")
    status = budget(api, "token", token["id"])
    assert status["reset_interval"] == "never"
    assert status["resets_at"] is None
    assert parse_rfc3339(status["window_start"]) == parse_rfc3339(token["created_at"])
    assert usd(status["remaining"]) == Decimal(1)
    unlimited = budget(api, "user", user["id"])
    assert unlimited["credit_limit"] is None
    assert unlimited["remaining"] is None

    fixed = api.token(user["id"], credit_limit="1", reset_interval="3s")
    status = budget(api, "token", fixed["id"])
    now = datetime.now(UTC)
    created = parse_rfc3339(fixed["created_at"])
    start, resets = parse_rfc3339(status["window_start"]), parse_rfc3339(status["resets_at"])
    assert status["reset_interval"] == "3s"
    assert resets - start == timedelta(seconds=3)
    # Fixed windows are counted from the budget's creation.
    assert (start - created) % timedelta(seconds=3) == timedelta(0)
    assert start <= now < resets + timedelta(seconds=1)


def test_patch_credit_limit_applies_at_once(api):
    team, user, token = api.principal(token_limit="1")
    key = token["token"]
    assert chat(api, key, f"patch {marker()} sim:tokens=8", max_tokens=8).status_code == 200
    spent = usd(budget(api, "token", token["id"])["spent"])
    assert spent > 0

    patched = api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": str(spent)})
    assert usd(patched["credit_limit"]) == spent
    status = budget(api, "token", token["id"])
    assert usd(status["credit_limit"]) == spent
    assert usd(status["remaining"]) == 0
    refused = chat(api, key, f"patch {marker()} sim:tokens=8", max_tokens=8)
    assert refused.status_code == 402, refused.text
    assert refused.headers["x-budget-scope"] == "token"

    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": None})
    status = budget(api, "token", token["id"])
    assert status["credit_limit"] is None and status["remaining"] is None
    assert usd(status["spent"]) == spent  # a limit change keeps the window's spend
    assert chat(api, key, f"patch {marker()} sim:tokens=8", max_tokens=8).status_code == 200

    # Users and teams likewise, through their own PATCH.
    api.ok("PATCH", f"/v1/users/{user['id']}", json={"credit_limit": "0"})
    refused = chat(api, key, f"patch {marker()}", max_tokens=8)
    assert refused.status_code == 402 and refused.headers["x-budget-scope"] == "user"
    api.ok("PATCH", f"/v1/users/{user['id']}", json={"credit_limit": None})
    api.ok("PATCH", f"/v1/teams/{team['id']}", json={"credit_limit": "0.000001"})
    refused = chat(api, key, f"patch {marker()}", max_tokens=8)
    assert refused.status_code == 402 and refused.headers["x-budget-scope"] == "team"
    status = budget(api, "team", team["id"])
    assert usd(status["credit_limit"]) == Decimal("0.000001")


def test_patch_reset_interval_reanchors(api):
    team, user, token = api.principal(token_limit="1", user_limit="1", team_limit="1")
    assert chat(api, token["token"], f"anchor {marker()}", max_tokens=8).status_code == 200
    spent = usd(budget(api, "token", token["id"])["spent"])
    created = parse_rfc3339(token["created_at"])
    for scope, subject in _subjects(team, user, token).items():
        path = f"/v1/{scope}s/{subject}"
        assert budget(api, scope, subject)["resets_at"] is None

        before = datetime.now(UTC)
        patched = api.ok("PATCH", path, json={"reset_interval": "5m"})
        after = datetime.now(UTC)
        assert patched["reset_interval"] == "5m"
        status = budget(api, scope, subject)
        start = parse_rfc3339(status["window_start"])
        # A fixed window restarts at the moment of the change, the spend so far kept in it.
        assert before <= start <= after and start > created
        assert parse_rfc3339(status["resets_at"]) == start + timedelta(minutes=5)
        assert usd(status["spent"]) == spent
        assert usd(status["remaining"]) == Decimal(1) - spent

        api.ok("PATCH", path, json={"reset_interval": "daily"})
        status = budget(api, scope, subject)
        start = parse_rfc3339(status["window_start"])
        assert start in (_midnight(before), _midnight(datetime.now(UTC)))
        assert parse_rfc3339(status["resets_at"]) == start + timedelta(days=1)
        assert status["reset_interval"] == "daily"

        api.ok("PATCH", path, json={"reset_interval": "never"})
        status = budget(api, scope, subject)
        assert status["resets_at"] is None
        assert parse_rfc3339(status["window_start"]) >= after


def test_own_budgets_only(api):
    team, user, token = api.principal(token_limit="1")
    other_team, other_user, other_token = api.principal(token_limit="1")
    key = token["token"]
    for scope, subject in _subjects(team, user, token).items():
        assert budget(api, scope, subject, key=key)["id"] == subject
    for scope, subject in _subjects(other_team, other_user, other_token).items():
        response = api.request("GET", f"/v1/{scope}s/{subject}/budget", key=key)
        assert response.status_code == 403, (scope, response.text)
        assert response.json()["error"]["code"] == "forbidden"
    # A second user of the same team may read the team's budget but not the first user's.
    neighbour = api.user(team["id"])
    neighbour_key = api.token(neighbour["id"])["token"]
    assert budget(api, "team", team["id"], key=neighbour_key)["id"] == team["id"]
    for scope, subject in (("user", user["id"]), ("token", token["id"])):
        response = api.request("GET", f"/v1/{scope}s/{subject}/budget", key=neighbour_key)
        assert response.status_code == 403
    missing = api.request("GET", "/v1/budget-less", key=key)
    assert missing.status_code == 404
    unknown = api.request("GET", "/v1/tokens/tok_nope/budget")
    assert unknown.status_code == 404
