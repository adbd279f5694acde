"""GET /v1/usage by end user and by tag, on both databases: each row carries `end_user` and
`tags` (an object in JSON; in CSV an `end_user` column and one `tags` column of JSON text);
`end_user=` and `tag=<key>:<value>` (repeatable, every one must match) filter in SQL; a user's
credential sees only its own events whatever it filters on."""

import csv
import io
import json
import uuid

import pytest

from tests.proxy.conftest import wait_events

# A key with the characters a JSON path would have to quote: matched as any other.
ODD_KEY = 'a."b[0]'


def ingest(api, user_id: str, end_user: str | None, tags: dict | None) -> str:
    event = {
        "idempotency_key": f"k-{uuid.uuid4().hex}",
        "model": "gpt-sim",
        "user_id": user_id,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "end_user": end_user,
        "tags": tags,
    }
    [result] = api.ok("POST", "/v1/events", json={"events": [event]})["data"]
    assert result["status"] == "created", result
    return result["event_id"]


@pytest.fixture(scope="module")
def world(api):
    """Two users of one team; events of end users c1, c2 and none, with tags."""
    team = api.team()
    one, two = api.user(team["id"]), api.user(team["id"])
    suffix = uuid.uuid4().hex[:8]
    c1, c2 = f"c1-{suffix}", f"c2-{suffix}"
    made = {
        "a": ingest(api, one["id"], c1, {"env": "prod", "feature": "search"}),
        "b": ingest(api, one["id"], c1, {"env": "dev", "feature": "search"}),
        "c": ingest(api, one["id"], c2, {"env": "prod", "url": "http://x:8080/"}),
        "d": ingest(api, one["id"], None, {ODD_KEY: "odd"}),
        "e": ingest(api, two["id"], c1, {"env": "prod", "feature": "search"}),
    }
    return {"team": team, "one": one, "two": two, "c1": c1, "c2": c2, "ids": made}


def ids(api, world, **params) -> set[str]:
    names = {v: k for k, v in world["ids"].items()}
    return {names[e["id"]] for e in api.events(team_id=world["team"]["id"], **params)}


def test_rows_carry_end_user_and_tags_as_an_object(api, world):
    events = {e["id"]: e for e in api.events(team_id=world["team"]["id"])}
    a, d = events[world["ids"]["a"]], events[world["ids"]["d"]]
    assert (a["end_user"], a["tags"]) == (world["c1"], {"env": "prod", "feature": "search"})
    assert (d["end_user"], d["tags"]) == (None, {ODD_KEY: "odd"})


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        pytest.param(lambda w: {"end_user": w["c1"]}, {"a", "b", "e"}, id="end-user"),
        pytest.param(lambda w: {"end_user": w["c2"]}, {"c"}, id="another-end-user"),
        pytest.param(lambda w: {"tag": "env:prod"}, {"a", "c", "e"}, id="one-tag"),
        pytest.param(lambda w: {"tag": ["env:prod", "feature:search"]}, {"a", "e"}, id="two-tags"),
        pytest.param(
            lambda w: {
                "tag": ["env:prod", "feature:search"],
                "end_user": w["c1"],
                "user_id": w["one"]["id"],
            },
            {"a"},
            id="tags-end-user-and-user",
        ),
        pytest.param(lambda w: {"tag": "url:http://x:8080/"}, {"c"}, id="split-at-first-colon"),
        pytest.param(lambda w: {"tag": f"{ODD_KEY}:odd"}, {"d"}, id="a-key-a-path-would-quote"),
        pytest.param(lambda w: {"tag": "env:"}, set(), id="an-empty-value"),
        pytest.param(lambda w: {"tag": "missing:x"}, set(), id="no-such-key"),
        pytest.param(lambda w: {"tag": ["env:prod", "env:dev"]}, set(), id="all-must-match"),
    ],
)
def test_filters_by_end_user_and_tags(api, world, params, expected):
    assert ids(api, world, **params(world)) == expected


@pytest.mark.parametrize(
    "tag",
    [
        pytest.param("no-colon", id="no-colon"),
        pytest.param(":value", id="empty-key"),
        pytest.param("k" * 65 + ":v", id="65-char-key"),
        pytest.param("k:" + "v" * 513, id="513-char-value"),
    ],
)
def test_a_tag_filter_of_another_form_is_a_400_naming_tag(api, tag):
    response = api.request("GET", "/v1/usage", params={"tag": tag})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("tag", "invalid_request_error")


def test_seventeen_tag_filters_are_a_400(api):
    response = api.request("GET", "/v1/usage", params={"tag": [f"k{i}:v" for i in range(17)]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tag"


@pytest.mark.parametrize("paged", [False, True], ids=["streamed", "paged"])
def test_csv_has_an_end_user_column_and_one_tags_column_of_json(api, world, paged):
    params = {"team_id": world["team"]["id"], "format": "csv", "tag": "env:prod"}
    if paged:
        params["limit"] = 10
    response = api.request("GET", "/v1/usage", params=params)
    assert response.status_code == 200, response.text
    rows = list(csv.DictReader(io.StringIO(response.text)))
    by_id = {row["id"]: row for row in rows}
    assert set(by_id) == {world["ids"][k] for k in ("a", "c", "e")}
    c = by_id[world["ids"]["c"]]
    assert c["end_user"] == world["c2"]
    assert json.loads(c["tags"]) == {"env": "prod", "url": "http://x:8080/"}
    assert c["tags"] == '{"env":"prod","url":"http://x:8080/"}'


def test_a_user_sees_only_its_own_events_of_an_end_user(api, world):
    token = api.token(world["two"]["id"])
    response = api.request(
        "GET", "/v1/usage", key=token["token"], params={"end_user": world["c1"], "tag": "env:prod"}
    )
    assert response.status_code == 200, response.text
    assert [e["id"] for e in response.json()["data"]] == [world["ids"]["e"]]
    other = api.request(
        "GET",
        "/v1/usage",
        key=token["token"],
        params={"end_user": world["c1"], "user_id": world["one"]["id"]},
    )
    assert other.status_code == 403


def test_a_proxied_requests_tags_are_found_by_the_filter(api, sim):
    _, _, token = api.principal()
    client = api.openai(token["token"])
    suffix = uuid.uuid4().hex[:8]
    client.chat.completions.create(
        model="gpt-sim",
        messages=[{"role": "user", "content": "Hi sim:tokens=2"}],
        user=f"sdk-{suffix}",
        metadata={"run": suffix},
    )
    wait_events(api, token["id"], 1)  # settling may trail the answer
    [event] = api.events(tag=f"run:{suffix}")
    assert (event["token_id"], event["end_user"]) == (token["id"], f"sdk-{suffix}")
