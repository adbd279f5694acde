"""GET /v1/me: who a credential is."""


def test_me_names_the_admin(api):
    assert api.ok("GET", "/v1/me") == {
        "kind": "admin",
        "user_id": None,
        "team_id": None,
        "token_id": None,
    }


def test_me_names_an_api_tokens_user_team_and_token(api):
    team, user, token = api.principal()
    assert api.ok("GET", "/v1/me", key=token["token"]) == {
        "kind": "api_token",
        "user_id": user["id"],
        "team_id": team["id"],
        "token_id": token["id"],
    }


def test_me_refuses_a_revoked_token(api):
    _, _, token = api.principal()
    api.ok("DELETE", f"/v1/tokens/{token['id']}", 204)
    response = api.request("GET", "/v1/me", key=token["token"])
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
