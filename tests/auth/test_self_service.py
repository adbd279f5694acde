"""A user manages their own tokens and reads their own budgets and usage, with an API token or
an access token, and nothing of anyone else's."""

from decimal import Decimal

import pytest

from tests.auth.conftest import error_code, new_account


@pytest.fixture(params=["api_token", "access_token"])
def me(request, api, client):
    """(account, credential): the user's own API token or access token."""
    account = new_account(api)
    if request.param == "api_token":
        return account, account.api_token["token"]
    return account, client.tokens(account.email, account.password)["access_token"]


def test_a_user_creates_lists_renames_and_revokes_their_own_tokens(client, me):
    account, credential = me
    created = client.call(
        "POST",
        f"/v1/users/{account.id}/tokens",
        credential,
        json={"name": "ci", "credit_limit": "5", "reset_interval": "daily"},
    )
    assert created.status_code == 201, created.text
    token = created.json()
    assert token["token"].startswith("mtr_")
    assert (token["name"], Decimal(token["credit_limit"]), token["reset_interval"]) == (
        "ci",
        Decimal(5),
        "daily",
    )

    listed = client.call("GET", f"/v1/users/{account.id}/tokens", credential).json()["data"]
    assert {t["id"] for t in listed} == {account.api_token["id"], token["id"]}
    assert all("token" not in t for t in listed)

    renamed = client.call("PATCH", f"/v1/tokens/{token['id']}", credential, json={"name": "ci-2"})
    assert renamed.status_code == 200
    assert renamed.json()["name"] == "ci-2"

    assert client.call("DELETE", f"/v1/tokens/{token['id']}", credential).status_code == 204
    assert client.chat(token["token"]).status_code == 401


def test_a_user_may_set_limits_on_their_own_token(client, me):
    """Documented choice: token limits are the user's own tool; user and team budgets bound it."""
    account, credential = me
    token_id = account.api_token["id"]
    response = client.call(
        "PATCH", f"/v1/tokens/{token_id}", credential, json={"credit_limit": "1000"}
    )
    assert response.status_code == 200
    assert Decimal(response.json()["credit_limit"]) == 1000


def test_the_eleventh_self_made_token_is_refused(client, me):
    account, credential = me
    path = f"/v1/users/{account.id}/tokens"
    for _ in range(9):  # the account has one already
        assert client.call("POST", path, credential, json={"name": "t"}).status_code == 201
    response = client.call("POST", path, credential, json={"name": "t"})
    assert response.status_code == 409
    assert error_code(response) == "token_limit_reached"


def test_a_user_reads_their_own_budgets_and_usage(api, client, me):
    account, credential = me
    assert client.chat(credential).status_code == 200
    for path in (
        f"/v1/users/{account.id}/budget",
        f"/v1/teams/{account.team['id']}/budget",
        f"/v1/tokens/{account.api_token['id']}/budget",
        f"/v1/users/{account.id}",
    ):
        assert client.call("GET", path, credential).status_code == 200, path
    usage = client.call("GET", "/v1/usage", credential).json()["data"]
    assert usage and {e["user_id"] for e in usage} == {account.id}


def test_a_user_sees_nothing_of_another_user(api, client, me):
    account, credential = me
    other = new_account(api)
    assert client.chat(other.api_token["token"]).status_code == 200
    for method, path in (
        ("GET", f"/v1/users/{other.id}"),
        ("GET", f"/v1/users/{other.id}/budget"),
        ("GET", f"/v1/users/{other.id}/tokens"),
        ("POST", f"/v1/users/{other.id}/tokens"),
        ("GET", f"/v1/tokens/{other.api_token['id']}"),
        ("PATCH", f"/v1/tokens/{other.api_token['id']}"),
        ("DELETE", f"/v1/tokens/{other.api_token['id']}"),
        ("GET", f"/v1/tokens/{other.api_token['id']}/budget"),
        ("GET", f"/v1/teams/{other.team['id']}/budget"),
    ):
        body = {"json": {"name": "x"}} if method in ("POST", "PATCH") else {}
        response = client.call(method, path, credential, **body)
        assert response.status_code == 403, f"{method} {path}: {response.text}"
        assert error_code(response) == "forbidden"
    # Their token still works: nothing was revoked.
    assert client.chat(other.api_token["token"]).status_code == 200
    # Usage and spend filtered on the other user are refused alike.
    for path in ("/v1/usage", "/v1/spend"):
        response = client.call("GET", path, credential, params={"user_id": other.id})
        assert response.status_code == 403, f"{path}: {response.text}"
        assert error_code(response) == "forbidden"


def test_admin_endpoints_refuse_user_credentials(client, me):
    account, credential = me
    for method, path in (
        ("GET", "/v1/users"),
        ("GET", "/v1/teams"),
        ("PATCH", f"/v1/users/{account.id}"),
        ("DELETE", f"/v1/users/{account.id}"),
        ("GET", f"/v1/teams/{account.team['id']}"),
    ):
        body = {"json": {}} if method == "PATCH" else {}
        response = client.call(method, path, credential, **body)
        assert response.status_code == 403, f"{method} {path}"
        assert error_code(response) == "forbidden"
