"""A token's expiry follows the limits' rule: a user's own credential (its API token or an access
token of its login) may set an expiry or bring it closer, never push it out or remove it; the
admin key may do anything."""

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.billing.test_ingest import rfc

DAY = timedelta(days=1)


def expiring(api, user_id: str, expires_at: datetime | None) -> dict:
    at = None if expires_at is None else rfc(expires_at)
    body = {"name": "t", "expires_at": at}
    return api.ok("POST", f"/v1/users/{user_id}/tokens", 201, json=body)


def patch(api, token: dict, key: str | None, **body):
    return api.request("PATCH", f"/v1/tokens/{token['id']}", key=key, json=body)


def expiry(api, token: dict) -> datetime | None:
    shown = api.ok("GET", f"/v1/tokens/{token['id']}")["expires_at"]
    return None if shown is None else datetime.fromisoformat(shown)


def forbidden(response, param: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("forbidden", param)
    assert "only the admin key" in error["message"]


@pytest.fixture
def user(api):
    return api.user(api.team()["id"])


@pytest.fixture
def owned(api, user):
    """A token the admin gave an expiry a day out, and the user's own credential for it."""
    token = expiring(api, user["id"], datetime.now(UTC) + DAY)
    return token, token["token"]


def test_a_user_cannot_remove_its_tokens_expiry(api, owned):
    token, own = owned
    before = expiry(api, token)
    forbidden(patch(api, token, own, expires_at=None), "expires_at")
    forbidden(patch(api, token, own, expires_in=None), "expires_in")
    assert expiry(api, token) == before


def test_a_user_cannot_extend_its_tokens_expiry(api, owned):
    token, own = owned
    before = expiry(api, token)
    forbidden(patch(api, token, own, expires_at=rfc(before + timedelta(hours=1))), "expires_at")
    forbidden(patch(api, token, own, expires_in=2 * 86400), "expires_in")
    assert expiry(api, token) == before


def test_a_user_may_shorten_its_tokens_expiry_but_not_undo_that(api, owned):
    token, own = owned
    before = expiry(api, token)
    sooner = datetime.now(UTC) + timedelta(hours=12)
    shortened = patch(api, token, own, expires_at=rfc(sooner))
    assert shortened.status_code == 200, shortened.text
    assert expiry(api, token) == sooner
    assert patch(api, token, own, expires_in=3600).status_code == 200
    assert expiry(api, token) < sooner
    # As it is: not an extension.
    same = expiry(api, token)
    assert patch(api, token, own, expires_at=rfc(same)).status_code == 200
    forbidden(patch(api, token, own, expires_at=rfc(before)), "expires_at")
    assert expiry(api, token) == same


def test_a_user_may_set_an_expiry_where_there_was_none_and_not_lift_it(api, user):
    token = expiring(api, user["id"], None)
    own = token["token"]
    set_ = patch(api, token, own, expires_in=7200)
    assert set_.status_code == 200, set_.text
    assert expiry(api, token) is not None
    forbidden(patch(api, token, own, expires_at=None), "expires_at")
    forbidden(patch(api, token, own, expires_in=3 * 3600), "expires_in")
    other = expiring(api, user["id"], None)
    at = datetime.now(UTC) + DAY
    assert patch(api, other, other["token"], expires_at=rfc(at)).status_code == 200
    assert expiry(api, other) == at


def test_the_admin_may_extend_and_remove_what_the_user_may_not(api, owned):
    token, own = owned
    later = datetime.now(UTC) + 10 * DAY
    forbidden(patch(api, token, own, expires_at=rfc(later)), "expires_at")
    assert patch(api, token, None, expires_at=rfc(later)).status_code == 200
    assert expiry(api, token) == later
    assert patch(api, token, None, expires_in=30 * 86400).status_code == 200
    assert expiry(api, token) > later
    assert patch(api, token, None, expires_at=None).status_code == 200
    assert expiry(api, token) is None
    assert patch(api, token, None, expires_in=3600).status_code == 200
    assert patch(api, token, None, expires_in=None).status_code == 200
    assert expiry(api, token) is None


def test_an_access_token_of_the_users_login_follows_the_same_rule(api):
    team = api.team()
    email, password = f"exp-{uuid.uuid4().hex[:12]}@example.com", f"pw-{uuid.uuid4().hex}"
    body = {"email": email, "name": "Expiry", "team_id": team["id"], "password": password}
    user = api.ok("POST", "/v1/users", 201, json=body)
    login = httpx.post(f"{api.url}/v1/auth/login", json={"email": email, "password": password})
    assert login.status_code == 200, login.text
    access = login.json()["access_token"]
    token = expiring(api, user["id"], datetime.now(UTC) + DAY)
    before = expiry(api, token)
    forbidden(patch(api, token, access, expires_at=None), "expires_at")
    forbidden(patch(api, token, access, expires_in=5 * 86400), "expires_in")
    assert expiry(api, token) == before
    assert patch(api, token, access, expires_in=60).status_code == 200
    assert expiry(api, token) < before
