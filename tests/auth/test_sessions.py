"""Login, refresh with rotation and reuse detection, logout; what ends a session."""

import pytest

from tests.auth.conftest import error_code, new_account, session_of


def test_login_answers_a_bearer_pair(client, account, api):
    response = client.login(account.email, account.password)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"access_token", "refresh_token", "token_type", "expires_in", "user_id"}
    assert body["token_type"] == "bearer"
    assert body["expires_in"] == api.settings.access_token_ttl_s == 900
    assert body["user_id"] == account.id
    assert body["access_token"].startswith("mat_")
    assert body["refresh_token"].startswith("mrt_")
    assert response.headers["cache-control"] == "no-store"


def test_login_email_is_case_insensitive(client, account):
    assert client.login(account.email.upper(), account.password).status_code == 200


def test_access_token_works_on_self_endpoints(client, account):
    pair = client.tokens(account.email, account.password)
    response = client.call("GET", f"/v1/users/{account.id}", pair["access_token"])
    assert response.status_code == 200, response.text
    assert response.json()["email"] == account.email


def test_wrong_password_and_unknown_email_get_the_same_401(client, account):
    wrong = client.login(account.email, "not-the-password")
    unknown = client.login(f"nobody-{account.email}", "not-the-password")
    assert wrong.status_code == unknown.status_code == 401
    assert error_code(wrong) == error_code(unknown) == "invalid_api_key"
    assert wrong.json() == unknown.json()


def test_user_without_password_cannot_log_in(client, api):
    team = api.team()
    user = api.user(team["id"])  # created without a password
    response = client.login(user["email"], "anything-at-all")
    assert response.status_code == 401
    assert response.json()["error"]["message"] == "invalid email or password"


def test_refresh_rotates_the_pair(client, account):
    first = client.tokens(account.email, account.password)
    response = client.refresh(first["refresh_token"])
    assert response.status_code == 200, response.text
    second = response.json()
    assert second["token_type"] == "bearer"
    assert second["refresh_token"] != first["refresh_token"]
    assert session_of(second["access_token"]) == session_of(first["access_token"])
    assert response.headers["cache-control"] == "no-store"
    me = f"/v1/users/{account.id}"
    assert client.call("GET", me, second["access_token"]).status_code == 200
    # The next rotation works from the new token.
    assert client.refresh(second["refresh_token"]).status_code == 200


def test_reusing_a_spent_refresh_token_revokes_the_whole_chain(client, account):
    first = client.tokens(account.email, account.password)
    second = client.refresh(first["refresh_token"]).json()
    third = client.refresh(second["refresh_token"]).json()

    reuse = client.refresh(first["refresh_token"])
    assert reuse.status_code == 401
    assert error_code(reuse) == "invalid_api_key"
    assert "revoked" in reuse.json()["error"]["message"]

    me = f"/v1/users/{account.id}"
    # The newest refresh token and every access token of the chain stop working.
    assert client.refresh(third["refresh_token"]).status_code == 401
    for pair in (first, second, third):
        assert client.call("GET", me, pair["access_token"]).status_code == 401
    # Another session of the same user is not affected.
    other = client.tokens(account.email, account.password)
    assert client.call("GET", me, other["access_token"]).status_code == 200


def test_logout_revokes_the_chain_and_its_access_tokens(client, account):
    first = client.tokens(account.email, account.password)
    second = client.refresh(first["refresh_token"]).json()
    response = client.logout(second["refresh_token"])
    assert response.status_code == 204
    me = f"/v1/users/{account.id}"
    assert client.call("GET", me, first["access_token"]).status_code == 401
    assert client.call("GET", me, second["access_token"]).status_code == 401
    assert client.refresh(second["refresh_token"]).status_code == 401


def test_logout_with_an_unknown_refresh_token_is_401(client):
    response = client.logout("mrt_not-a-real-token")
    assert response.status_code == 401
    assert error_code(response) == "invalid_api_key"


@pytest.mark.parametrize("body", [{}, {"refresh_token": ""}, {"refresh_token": 5}])
def test_refresh_with_a_bad_body_is_400(client, body):
    response = client.call("POST", "/v1/auth/refresh", json=body)
    assert response.status_code == 400
    assert error_code(response) == "invalid_request"


def test_a_tampered_access_token_is_refused(client, account):
    access = client.tokens(account.email, account.password)["access_token"]
    body, _, signature = access.rpartition(".")
    session, expiry = body.split(".")
    later = f"{session}.{int(expiry) + 86400}.{signature}"
    me = f"/v1/users/{account.id}"
    for forged in (later, body + ".AAAA", access[:-1], "mat_", "mat_x.y.z"):
        response = client.call("GET", me, forged)
        assert response.status_code == 401, forged
        assert error_code(response) == "invalid_api_key"


def test_deleting_the_user_stops_their_access_and_refresh_tokens(client, api, account):
    pair = client.tokens(account.email, account.password)
    api.ok("DELETE", f"/v1/users/{account.id}", 204)
    assert client.call("GET", f"/v1/users/{account.id}", pair["access_token"]).status_code == 401
    assert client.refresh(pair["refresh_token"]).status_code == 401
    assert client.login(account.email, account.password).status_code == 401


def test_a_new_password_ends_existing_sessions(client, api, account):
    pair = client.tokens(account.email, account.password)
    api.ok("PATCH", f"/v1/users/{account.id}", json={"password": "a-brand-new-password"})
    me = f"/v1/users/{account.id}"
    assert client.call("GET", me, pair["access_token"]).status_code == 401
    assert client.refresh(pair["refresh_token"]).status_code == 401
    assert client.login(account.email, account.password).status_code == 401
    fresh = client.tokens(account.email, "a-brand-new-password")
    assert client.call("GET", me, fresh["access_token"]).status_code == 200


def test_logout_on_one_replica_stops_the_session_on_another(client, account, replica):
    other = replica()
    pair = client.tokens(account.email, account.password)
    me = f"/v1/users/{account.id}"
    assert other.call("GET", me, pair["access_token"]).status_code == 200
    assert client.logout(pair["refresh_token"]).status_code == 204
    assert other.call("GET", me, pair["access_token"]).status_code == 401


def test_a_replica_refreshes_a_pair_another_issued(client, account, replica):
    other = replica()
    pair = client.tokens(account.email, account.password)
    response = other.refresh(pair["refresh_token"])
    assert response.status_code == 200
    # Reuse is seen by every replica: the first server now refuses the spent token.
    assert client.refresh(pair["refresh_token"]).status_code == 401
    assert other.refresh(response.json()["refresh_token"]).status_code == 401


def test_each_login_is_its_own_session(client, api):
    account = new_account(api)
    one = client.tokens(account.email, account.password)
    two = client.tokens(account.email, account.password)
    assert session_of(one["access_token"]) != session_of(two["access_token"])
    assert client.logout(one["refresh_token"]).status_code == 204
    me = f"/v1/users/{account.id}"
    assert client.call("GET", me, two["access_token"]).status_code == 200
