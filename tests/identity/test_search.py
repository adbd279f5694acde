"""`q` on the lists of teams, users and tokens: a substring of a name (an email, a token's
prefix) in any case, or an exact id; `%`, `_` and `\\` taken literally; paged with limit and
after; a user's credential finds only its own tokens; a bad `q` is a 400 naming it. Both
databases, the real server."""

import uuid

import pytest


def tag() -> str:
    return uuid.uuid4().hex[:10]


def team(api, name: str) -> dict:
    return api.ok("POST", "/v1/teams", 201, json={"name": name})


def user(api, team_id: str, name: str, email: str | None = None) -> dict:
    email = email or f"u{tag()}@example.com"
    return api.ok("POST", "/v1/users", 201, json={"name": name, "email": email, "team_id": team_id})


def token(api, user_id: str, name: str) -> dict:
    return api.ok("POST", f"/v1/users/{user_id}/tokens", 201, json={"name": name})


def ids(api, path: str, key: str | None = None, **params) -> list[str]:
    return [row["id"] for row in api.ok("GET", path, key=key, params=params)["data"]]


def test_q_finds_teams_by_name_in_any_case_or_by_their_exact_id(api):
    t = tag()
    alpha = team(api, f"Alpha {t}")
    beta = team(api, f"beta {t.upper()}")
    other = team(api, f"other {tag()}")
    assert ids(api, "/v1/teams", q=t) == sorted([alpha["id"], beta["id"]])
    assert ids(api, "/v1/teams", q=f"ALPHA {t.upper()}") == [alpha["id"]]
    assert ids(api, "/v1/teams", q=other["id"]) == [other["id"]]
    # An id matches whole only: a part of one finds nothing.
    assert ids(api, "/v1/teams", q=other["id"][5:20]) == []
    # An empty q is no filter.
    assert other["id"] in ids(api, "/v1/teams", q="", limit=1000)


def test_percent_underscore_and_backslash_in_q_match_only_themselves(api):
    t = tag()
    names = {
        "percent": f"{t} 100% off",
        "letter": f"{t} 100x off",
        "underscore": f"{t} a_b",
        "other": f"{t} axb",
        "backslash": f"{t} c\\d",
        "plain": f"{t} c\\\\d",
    }
    made = {key: team(api, name)["id"] for key, name in names.items()}
    assert ids(api, "/v1/teams", q=f"{t} 100%") == [made["percent"]]
    assert ids(api, "/v1/teams", q="0% o") == [made["percent"]]
    assert ids(api, "/v1/teams", q=f"{t} a_b") == [made["underscore"]]
    assert ids(api, "/v1/teams", q=f"{t} c\\d") == [made["backslash"]]
    assert ids(api, "/v1/teams", q=f"{t} c\\\\d") == [made["plain"]]
    assert made["percent"] in ids(api, "/v1/teams", q="%", limit=1000)
    assert made["letter"] not in ids(api, "/v1/teams", q="%", limit=1000)
    assert made["other"] not in ids(api, "/v1/teams", q="_", limit=1000)
    assert ids(api, "/v1/teams", q=f"{t} %") == []


def test_q_is_paged_with_limit_and_after(api):
    t = tag()
    made = sorted(team(api, f"paged {t} {n}")["id"] for n in range(5))
    team(api, f"paged {tag()}")  # another search's: never among these pages
    pages, after = [], None
    while True:
        page = ids(api, "/v1/teams", q=f"paged {t}", limit=2, **({"after": after} if after else {}))
        pages.append(page)
        if len(page) < 2:
            break
        after = page[-1]
    assert pages == [made[0:2], made[2:4], made[4:5]]


def test_q_finds_users_by_name_or_email_within_a_team_filter(api):
    t = tag()
    first, second = team(api, f"people {t}"), team(api, f"more people {t}")
    by_name = user(api, first["id"], f"Zed {t}")
    by_email = user(api, second["id"], "Someone", email=f"{t}@Example.com")
    unrelated = user(api, first["id"], "Nobody")
    assert ids(api, "/v1/users", q=t) == sorted([by_name["id"], by_email["id"]])
    assert ids(api, "/v1/users", q=f"{t.upper()}@EXAMPLE") == [by_email["id"]]
    assert ids(api, "/v1/users", q=t, team_id=first["id"]) == [by_name["id"]]
    assert ids(api, "/v1/users", q=unrelated["id"]) == [unrelated["id"]]
    assert ids(api, "/v1/users", q=unrelated["id"], team_id=second["id"]) == []


def test_q_finds_tokens_by_name_or_prefix_and_a_user_only_its_own(api):
    t = tag()
    owner = team(api, f"tokens {t}")
    alice, bob = user(api, owner["id"], "Alice"), user(api, owner["id"], "Bob")
    laptop = token(api, alice["id"], f"Laptop {t}")
    phone = token(api, alice["id"], f"phone {t}")
    spare = token(api, alice["id"], "spare")
    theirs = token(api, bob["id"], f"laptop {t}")
    mine = f"/v1/users/{alice['id']}/tokens"
    assert set(ids(api, mine, q=t)) == {laptop["id"], phone["id"]}
    assert ids(api, mine, q=f"LAPTOP {t}") == [laptop["id"]]
    assert ids(api, mine, q=spare["prefix"]) == [spare["id"]]
    assert ids(api, mine, q=spare["id"]) == [spare["id"]]
    # Alice's own credential finds her tokens, never Bob's of the same name.
    key = laptop["token"]
    assert ids(api, mine, key=key, q=f"laptop {t}") == [laptop["id"]]
    assert ids(api, mine, key=key, q=theirs["id"]) == []
    refused = api.request("GET", f"/v1/users/{bob['id']}/tokens", key=key, params={"q": t})
    assert refused.status_code == 403, refused.text
    # With include_revoked a revoked token is found too.
    api.ok("DELETE", f"/v1/tokens/{phone['id']}", 204)
    assert ids(api, mine, q=f"phone {t}") == []
    assert ids(api, mine, q=f"phone {t}", include_revoked="true") == [phone["id"]]


def test_a_users_tokens_are_paged_in_the_order_they_were_made(api):
    """Past the 10 live tokens, revoked ones included: `limit` and `after` walk them all once,
    in creation order, with or without q; an `after` of another user's token starts nowhere."""
    t = tag()
    owner = team(api, f"paging {t}")
    alice, bob = user(api, owner["id"], "Alice"), user(api, owner["id"], "Bob")
    made = []
    for n in range(14):
        made.append(token(api, alice["id"], f"t{n:02d} {t}")["id"])
        if n < 6:  # revoked, so that 14 fit the cap of 10 live ones
            api.ok("DELETE", f"/v1/tokens/{made[-1]}", 204)
    mine = f"/v1/users/{alice['id']}/tokens"
    walked, after = [], None
    for _ in range(10):
        page = ids(
            api, mine, include_revoked="true", limit=4, **({"after": after} if after else {})
        )
        if not page:
            break
        assert len(page) <= 4
        walked += page
        after = page[-1]
    assert walked == made
    assert ids(api, mine, limit=3) == made[6:9]
    assert ids(api, mine, limit=3, after=made[8]) == made[9:12]
    assert ids(api, mine, include_revoked="true", q="t1", limit=2, after=made[10]) == made[11:13]
    theirs = token(api, bob["id"], "bob's")["id"]
    assert ids(api, mine, after=theirs) == []
    bad = api.request("GET", mine, params={"limit": "0"})
    assert bad.status_code == 400, bad.text


@pytest.mark.parametrize("path", ["/v1/teams", "/v1/users", "/v1/users/{user}/tokens"])
@pytest.mark.parametrize(
    ("q", "problem"),
    [("x" * 201, "at most 200 characters"), ("a\x01b", "control characters")],
)
def test_a_bad_q_is_a_400_naming_it(api, path, q, problem):
    owner = api.team()
    member = api.user(owner["id"])
    response = api.request("GET", path.format(user=member["id"]), params={"q": q})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("q", "invalid_request_error")
    assert problem in error["message"]


def test_q_is_declared_with_its_bound_in_openapi(api):
    paths = api.ok("GET", "/openapi.json")["paths"]
    for path in ("/v1/teams", "/v1/users", "/v1/users/{user_id}/tokens"):
        [q] = [p for p in paths[path]["get"]["parameters"] if p["name"] == "q"]
        declared = q["schema"]["anyOf"][0]
        assert (q["in"], declared["type"], declared["maxLength"]) == ("query", "string", 200)
        assert declared["pattern"] == "^[^\\x00-\\x1f\\x7f]*$"
