"""API tokens: created once-shown, listed without secrets, revoked at once, at most 10 active."""

import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest

TOKEN_FIELDS = {
    "id",
    "user_id",
    "name",
    "prefix",
    "credit_limit",
    "alert_thresholds",
    "soft_limit",
    "rpm_limit",
    "tpm_limit",
    "max_parallel_requests",
    "allowed_models",
    "reset_interval",
    "expires_at",
    "created_at",
    "revoked_at",
}
CHAT = {"model": "gpt-sim", "messages": [{"role": "user", "content": "hi sim:tokens=2"}]}


def chat(api, secret: str) -> httpx.Response:
    return api.request("POST", "/v1/chat/completions", key=secret, json=CHAT)


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["code"] == code


def create(api, user_id: str, key: str | None = None, **body) -> httpx.Response:
    return api.request("POST", f"/v1/users/{user_id}/tokens", key=key, json={"name": "t", **body})


@pytest.fixture
def user(api):
    team = api.team()
    return api.user(team["id"])


def test_token_is_shown_once_and_never_listed(api, user):
    response = create(api, user["id"], name="laptop", credit_limit="5.50", reset_interval="daily")
    assert response.status_code == 201
    token = response.json()
    secret = token["token"]
    assert re.fullmatch(r"mtr_[A-Za-z0-9_-]{43}", secret)
    assert set(token) == TOKEN_FIELDS | {"token"}
    assert token["prefix"] == secret[:12]
    assert (token["name"], token["user_id"]) == ("laptop", user["id"])
    assert (token["credit_limit"], token["reset_interval"]) == ("5.5", "daily")
    assert token["expires_at"] is None and token["revoked_at"] is None

    listed = api.request("GET", f"/v1/users/{user['id']}/tokens")
    got = api.request("GET", f"/v1/tokens/{token['id']}")
    for response in (listed, got):
        assert response.status_code == 200
        assert secret not in response.text
        assert secret[12:] not in response.text
    assert [t["id"] for t in listed.json()["data"]] == [token["id"]]
    assert set(listed.json()["data"][0]) == TOKEN_FIELDS
    assert got.json() == {k: v for k, v in token.items() if k != "token"}


def test_token_name_can_be_changed(api, user):
    token = create(api, user["id"]).json()
    response = api.request("PATCH", f"/v1/tokens/{token['id']}", json={"name": "renamed"})
    assert response.status_code == 200
    assert response.json()["name"] == "renamed"
    assert api.ok("GET", f"/v1/tokens/{token['id']}")["name"] == "renamed"
    assert response.json()["prefix"] == token["prefix"]


def test_revoked_token_is_refused_by_the_proxy_at_once(api, user):
    token = create(api, user["id"]).json()
    assert chat(api, token["token"]).status_code == 200
    assert api.request("DELETE", f"/v1/tokens/{token['id']}").status_code == 204
    assert_error(chat(api, token["token"]), 401, "invalid_api_key")
    assert api.ok("GET", f"/v1/tokens/{token['id']}")["revoked_at"] is not None
    listed = api.ok("GET", f"/v1/users/{user['id']}/tokens")["data"]
    assert listed == []
    with_revoked = api.ok("GET", f"/v1/users/{user['id']}/tokens?include_revoked=true")["data"]
    assert [t["id"] for t in with_revoked] == [token["id"]]


def test_token_of_a_deleted_user_is_refused(api, user):
    token = create(api, user["id"]).json()
    assert api.request("DELETE", f"/v1/users/{user['id']}").status_code == 204
    assert_error(chat(api, token["token"]), 401, "invalid_api_key")
    assert_error(create(api, user["id"]), 404, "not_found")


def test_token_of_a_deleted_team_is_refused(api):
    team = api.team()
    user = api.user(team["id"])
    token = create(api, user["id"]).json()
    assert api.request("DELETE", f"/v1/teams/{team['id']}").status_code == 204
    assert_error(chat(api, token["token"]), 401, "invalid_api_key")


def test_user_manages_its_own_tokens_but_no_one_elses(api, user):
    own = create(api, user["id"]).json()
    other = api.user(api.team()["id"])
    assert create(api, user["id"], key=own["token"]).status_code == 201
    assert_error(create(api, other["id"], key=own["token"]), 403, "forbidden")
    others_token = create(api, other["id"]).json()
    for method in ("GET", "PATCH", "DELETE"):
        response = api.request(
            method, f"/v1/tokens/{others_token['id']}", key=own["token"], json={"name": "mine"}
        )
        assert_error(response, 403, "forbidden")
    assert api.ok("GET", f"/v1/tokens/{others_token['id']}")["name"] == "t"
    renamed = api.request(
        "PATCH", f"/v1/tokens/{own['id']}", key=own["token"], json={"name": "mine"}
    )
    assert renamed.status_code == 200 and renamed.json()["name"] == "mine"
    assert_error(
        api.request("GET", f"/v1/users/{other['id']}/tokens", key=own["token"]), 403, "forbidden"
    )
    assert api.request("DELETE", f"/v1/tokens/{own['id']}", key=own["token"]).status_code == 204


def test_unknown_token_id_is_404(api):
    assert_error(api.request("GET", "/v1/tokens/tok_nope"), 404, "not_found")
    assert_error(api.request("DELETE", "/v1/tokens/tok_nope"), 404, "not_found")


def test_token_for_an_unknown_user_is_404(api):
    assert_error(create(api, "user_nope"), 404, "not_found")


def test_eleventh_active_token_is_refused_and_a_revoked_one_frees_a_slot(api, user):
    tokens = [create(api, user["id"]) for _ in range(10)]
    assert [r.status_code for r in tokens] == [201] * 10
    assert_error(create(api, user["id"]), 409, "token_limit_reached")
    first = tokens[0].json()
    assert api.request("DELETE", f"/v1/tokens/{first['id']}").status_code == 204
    assert create(api, user["id"]).status_code == 201
    assert_error(create(api, user["id"]), 409, "token_limit_reached")
    assert len(api.ok("GET", f"/v1/users/{user['id']}/tokens")["data"]) == 10


def test_expired_token_frees_a_slot_and_is_refused(api, user, clock):
    expires = datetime.now(UTC) + timedelta(seconds=1.5)
    short = create(api, user["id"], expires_at=expires.isoformat())
    assert short.status_code == 201, short.text
    assert short.json()["expires_at"] == expires.isoformat().replace("+00:00", "Z")
    for _ in range(9):
        assert create(api, user["id"]).status_code == 201
    assert_error(create(api, user["id"]), 409, "token_limit_reached")
    clock.move_to(expires)
    assert_error(chat(api, short.json()["token"]), 401, "invalid_api_key")
    assert create(api, user["id"]).status_code == 201


def test_expiry_in_the_past_is_refused(api, user):
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    assert_error(create(api, user["id"], expires_at=past), 400, "invalid_request")
    assert_error(create(api, user["id"], expires_at="2030-01-01T00:00:00"), 400, "invalid_request")


def test_concurrent_creations_never_exceed_ten_active_tokens(api, user):
    def attempt(_: int) -> int:
        with httpx.Client(base_url=api.url, timeout=60) as client:
            response = client.post(
                f"/v1/users/{user['id']}/tokens",
                json={"name": "race"},
                headers={"authorization": f"Bearer {api.settings.admin_key}"},
            )
            return response.status_code

    with ThreadPoolExecutor(max_workers=20) as pool:
        statuses = list(pool.map(attempt, range(20)))
    assert sorted(statuses) == [201] * 10 + [409] * 10
    active = api.ok("GET", f"/v1/users/{user['id']}/tokens")["data"]
    assert len(active) == 10
    assert len({t["id"] for t in active}) == 10
