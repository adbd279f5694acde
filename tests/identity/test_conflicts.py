"""A 409 names the object that holds the name, as that object spells it: team names and user
emails are compared without case."""

import uuid


def conflict(response, code: str, message: str, param: str) -> None:
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("conflict_error", code, param)
    assert error["message"] == message


def test_a_team_name_taken_in_another_case_names_the_holder_as_spelled(api):
    name = f"research-{uuid.uuid4().hex[:8]}"
    holder = api.ok("POST", "/v1/teams", 201, json={"name": name})
    response = api.request("POST", "/v1/teams", json={"name": name.upper()})
    expected = f"a team named {name!r} already exists (id {holder['id']})"
    conflict(response, "team_name_taken", expected, "name")
    other = api.team()
    renamed = api.request("PATCH", f"/v1/teams/{other['id']}", json={"name": name.title()})
    conflict(renamed, "team_name_taken", expected, "name")


def test_an_email_taken_in_another_case_names_the_holder_as_spelled(api):
    team = api.team()
    email = f"Alice.{uuid.uuid4().hex[:8]}@Example.com"
    holder = api.ok(
        "POST", "/v1/users", 201, json={"email": email, "name": "Alice", "team_id": team["id"]}
    )
    body = {"email": email.lower(), "name": "Alice", "team_id": team["id"]}
    expected = f"a user with email {email!r} already exists (id {holder['id']})"
    conflict(api.request("POST", "/v1/users", json=body), "email_taken", expected, "email")
    other = api.user(team["id"])
    patched = api.request("PATCH", f"/v1/users/{other['id']}", json={"email": email.upper()})
    conflict(patched, "email_taken", expected, "email")
