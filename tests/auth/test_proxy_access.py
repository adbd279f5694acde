"""The proxy with an access token, and with the `refresh-token` header once it has expired."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from metering.auth import sessions
from metering.auth.tokens import Signer
from tests.auth.conftest import CHAT, error_code, expired_twin, signing_key


def assert_successor(api, old_access: str, new_access: str) -> None:
    """new_access is a validly signed token of the same session, expiring later. (Using it would
    race its one-second lifetime.)"""
    key = signing_key(api.settings.database_url)
    old, new = Signer.read(key, old_access), Signer.read(key, new_access)
    assert new.session_id == old.session_id
    assert new.expires_at > old.expires_at


def test_access_token_is_charged_to_user_and_team_without_a_token(api, client, account):
    access = client.tokens(account.email, account.password)["access_token"]
    completion = api.openai(access).chat.completions.with_raw_response.create(
        model="gpt-sim", messages=[{"role": "user", "content": "hello sim:tokens=4"}]
    )
    request_id = completion.headers["x-request-id"]
    assert completion.parse().usage.completion_tokens == 4
    [event] = [e for e in api.events(user_id=account.id) if e["id"] == request_id]
    assert event["token_id"] is None
    assert event["user_id"] == account.id
    assert event["team_id"] == account.team["id"]
    assert event["completion_tokens"] == 4
    assert event["status"] == "ok"


def test_access_token_spend_counts_against_user_and_team_budgets(api, client, account):
    access = client.tokens(account.email, account.password)["access_token"]
    assert client.chat(access).status_code == 200
    user_budget = api.ok("GET", f"/v1/users/{account.id}/budget")
    team_budget = api.ok("GET", f"/v1/teams/{account.team['id']}/budget")
    token_budget = api.ok("GET", f"/v1/tokens/{account.api_token['id']}/budget")
    assert user_budget["spent"] == team_budget["spent"] != "0"
    assert token_budget["spent"] in ("0", "0.000000")


def test_a_valid_access_token_ignores_the_refresh_header(client, account):
    pair = client.tokens(account.email, account.password)
    response = client.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    assert response.status_code == 200
    assert "x-access-token" not in response.headers
    # The refresh token was not spent.
    assert client.refresh(pair["refresh_token"]).status_code == 200


@pytest.fixture
def short(replica):
    """A server whose access tokens live one second."""
    return replica(access_token_ttl_s=1)


def expired_pair(short, account, clock) -> dict:
    """A pair whose access token has really expired, on the one-second server: its clock moved
    past the expiry."""
    pair = short.tokens(account.email, account.password)
    assert pair["expires_in"] == 1
    clock.advance(2.1)  # expiry has a resolution of one second
    return pair


@pytest.fixture
def expired(api, client, account) -> dict:
    """A fresh pair whose access token is replaced by its validly signed, expired twin: the
    header flow without waiting, on the main server."""
    pair = client.tokens(account.email, account.password)
    return {**pair, "access_token": expired_twin(api.settings.database_url, pair["access_token"])}


def test_an_expired_access_token_alone_is_401(short, account, clock):
    pair = expired_pair(short, account, clock)
    response = short.chat(pair["access_token"])
    assert response.status_code == 401
    assert error_code(response) == "invalid_api_key"
    assert "expired" in response.json()["error"]["message"]


def test_an_expired_access_token_with_a_refresh_header_is_served_with_a_new_pair(
    api, short, account, clock
):
    pair = expired_pair(short, account, clock)
    response = short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    new_access = response.headers["x-access-token"]
    new_refresh = response.headers["x-refresh-token"]
    assert new_refresh != pair["refresh_token"]
    assert_successor(api, pair["access_token"], new_access)
    # The new refresh token works; the old one is spent.
    assert short.refresh(new_refresh).status_code == 200


def test_a_streaming_response_carries_the_new_pair_too(client, expired):
    short, pair = client, expired
    headers = {"authorization": f"Bearer {pair['access_token']}"}
    headers["refresh-token"] = pair["refresh_token"]
    with short.http.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        new_access = response.headers["x-access-token"]
        new_refresh = response.headers["x-refresh-token"]
        body = response.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    assert short.chat(new_access).status_code == 200
    assert short.refresh(new_refresh).status_code == 200


def test_an_error_answer_still_carries_the_new_pair(client, expired):
    """The old refresh token is spent by then: the client must get the new one whatever happens."""
    short, pair = client, expired
    response = short.call(
        "POST",
        "/v1/chat/completions",
        pair["access_token"],
        json={**CHAT, "model": "no-such-model"},
        headers={"refresh-token": pair["refresh_token"]},
    )
    assert response.status_code == 404
    assert short.chat(response.headers["x-access-token"]).status_code == 200
    assert short.refresh(response.headers["x-refresh-token"]).status_code == 200


def test_the_refresh_header_works_on_self_endpoints(client, expired, account):
    short, pair = client, expired
    response = short.call(
        "GET",
        f"/v1/users/{account.id}",
        pair["access_token"],
        headers={"refresh-token": pair["refresh_token"]},
    )
    assert response.status_code == 200
    assert response.headers["x-refresh-token"].startswith("mrt_")


def test_a_refresh_header_from_another_session_is_refused(client, expired, account):
    short, pair = client, expired
    other = short.tokens(account.email, account.password)
    response = short.chat(pair["access_token"], **{"refresh-token": other["refresh_token"]})
    assert response.status_code == 401
    # Nothing was spent.
    assert short.refresh(other["refresh_token"]).status_code == 200


def test_a_garbage_refresh_header_is_401(client, expired):
    short, pair = client, expired
    response = short.chat(pair["access_token"], **{"refresh-token": "mrt_garbage"})
    assert response.status_code == 401


def test_requests_sent_together_with_one_expired_pair_are_all_served(client, expired):
    """Within the leeway, the concurrent requests that lost the rotation race are served without
    new tokens, and the session survives: one new pair, one live chain."""
    short, pair = client, expired

    def call(_):
        return short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(call, range(6)))
    assert [r.status_code for r in responses] == [200] * 6
    fresh = [r for r in responses if "x-refresh-token" in r.headers]
    assert len(fresh) == 1
    assert short.chat(fresh[0].headers["x-access-token"]).status_code == 200
    assert short.refresh(fresh[0].headers["x-refresh-token"]).status_code == 200


def test_the_header_leeway_ends_once_the_successor_is_used(client, expired):
    short, pair = client, expired
    served = short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    successor = served.headers["x-refresh-token"]
    newest = short.refresh(successor).json()
    # The first refresh token, two generations old, is reuse: the session is revoked.
    reuse = short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    assert reuse.status_code == 401
    assert short.refresh(newest["refresh_token"]).status_code == 401
    assert short.chat(newest["access_token"]).status_code == 401


def test_the_header_leeway_ends_after_its_grace(client, expired, monkeypatch):
    monkeypatch.setattr(sessions, "REUSE_GRACE_S", 0)
    short, pair = client, expired
    served = short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    assert served.status_code == 200
    reuse = short.chat(pair["access_token"], **{"refresh-token": pair["refresh_token"]})
    assert reuse.status_code == 401
    assert short.chat(served.headers["x-access-token"]).status_code == 401
    assert short.refresh(served.headers["x-refresh-token"]).status_code == 401


def test_the_refresh_endpoint_has_no_leeway(client, account):
    pair = client.tokens(account.email, account.password)
    assert client.refresh(pair["refresh_token"]).status_code == 200
    reuse = client.refresh(pair["refresh_token"])
    assert reuse.status_code == 401
    assert json.loads(reuse.text)["error"]["code"] == "invalid_api_key"
