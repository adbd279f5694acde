"""Refused requests are recorded in their own table (never the ledger, never a budget) and
read at GET /v1/refusals (admin: all; a user: its own) and /v1/refusals/summary (counts grouped
as /v1/spend groups)."""

import csv
import io
from decimal import Decimal

import openai
import pytest

from tests.budgets.test_limits import same_minute


def refused(client, **body) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            messages=[{"role": "user", "content": "sim:tokens=2"}], **body
        )
    return caught.value


@pytest.fixture(scope="module")
def scene(api):
    """A token refused once for each reason: budget (402), model (403), rpm (429), parallel
    (429); and a user of another team refused once (budget). The server's clock stays where the
    scene moved it until the module's tests have read what it recorded."""
    yield _scene(api)
    api.clock.reset()


def _scene(api):
    team, user, token = api.principal(token_limit="0.0001")
    client = api.openai(token["token"])
    ids = {}
    budget = refused(client, model="gpt-sim", max_tokens=4000)
    assert budget.status_code == 402
    ids["budget"] = budget.response.headers["x-request-id"]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": ["gpt-*"]})
    model = refused(client, model="minimax-m2.1", max_tokens=5)
    assert model.status_code == 403
    ids["model"] = model.response.headers["x-request-id"]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"max_parallel_requests": 1})
    with client.chat.completions.with_streaming_response.create(
        model="gpt-sim",
        max_tokens=5,
        stream=True,
        messages=[{"role": "user", "content": "sim:tokens=5 sim:chunks=5 sim:delay_ms=300"}],
    ) as running:
        parallel = refused(client, model="gpt-sim", max_tokens=5)
        for _ in running.iter_lines():
            pass
    assert parallel.status_code == 429
    ids["parallel"] = parallel.response.headers["x-request-id"]
    api.ok(
        "PATCH",
        f"/v1/tokens/{token['id']}",
        json={"max_parallel_requests": None, "rpm_limit": 1},
    )
    same_minute(api.clock)
    client.chat.completions.create(
        model="gpt-sim", max_tokens=5, messages=[{"role": "user", "content": "sim:tokens=2"}]
    )
    rpm = refused(client, model="gpt-sim", max_tokens=5)
    assert rpm.status_code == 429
    ids["rpm"] = rpm.response.headers["x-request-id"]
    other_team, other_user, other_token = api.principal(user_limit="0.0001")
    other = refused(api.openai(other_token["token"]), model="gpt-sim", max_tokens=4000)
    assert other.status_code == 402
    return team, user, token, ids, other_user, other.response.headers["x-request-id"]


def test_each_refusal_is_one_row_with_its_reason_scope_and_answer(api, scene):
    team, user, token, ids, _, _ = scene
    page = api.ok("GET", "/v1/refusals", params={"token_id": token["id"], "labels": "true"})
    rows = {r["id"]: r for r in page["data"]}
    assert set(rows) == set(ids.values())
    assert [r["id"] for r in page["data"]] == [
        ids[k] for k in ("rpm", "parallel", "model", "budget")
    ]
    for reason, refusal_id in ids.items():
        row = rows[refusal_id]
        assert row["reason"] == reason
        assert (row["scope"], row["subject_id"]) == ("token", token["id"])
        assert (row["user_id"], row["team_id"]) == (user["id"], team["id"])
        assert (row["team_name"], row["user_email"]) == (team["name"], user["email"])
    assert (rows[ids["budget"]]["http_status"], rows[ids["budget"]]["code"]) == (
        402,
        "budget_exceeded",
    )
    assert rows[ids["model"]]["http_status"] == 403
    assert rows[ids["model"]]["model"] == "minimax-m2.1"
    assert rows[ids["parallel"]]["code"] == "rate_limit_exceeded"
    assert "rpm_limit" in rows[ids["rpm"]]["message"]


def test_refusals_never_reach_the_ledger_or_a_budget(api, scene):
    _, _, token, ids, _, _ = scene
    events = api.events(token_id=token["id"])
    assert not set(ids.values()) & {e["id"] for e in events}
    assert len(events) == 2  # the stream and the request before the rpm refusal
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert budget["reserved"] == "0"
    assert Decimal(budget["spent"]) == sum(Decimal(e["cost"]) for e in events)


def test_filters_paging_and_csv(api, scene):
    _, _, token, ids, _, _ = scene
    by_reason = api.ok("GET", "/v1/refusals", params={"token_id": token["id"], "reason": "model"})
    assert [r["id"] for r in by_reason["data"]] == [ids["model"]]
    first = api.ok("GET", "/v1/refusals", params={"token_id": token["id"], "limit": 3})
    assert len(first["data"]) == 3 and first["next_cursor"]
    rest = api.ok(
        "GET",
        "/v1/refusals",
        params={"token_id": token["id"], "limit": 3, "cursor": first["next_cursor"]},
    )
    assert [r["id"] for r in rest["data"]] == [ids["budget"]] and rest["next_cursor"] is None
    text = api.request(
        "GET", "/v1/refusals", params={"token_id": token["id"], "format": "csv"}
    ).text
    lines = list(csv.DictReader(io.StringIO(text)))
    # Without a limit the CSV holds every row, newest first.
    assert [line["id"] for line in lines] == [
        ids[k] for k in ("rpm", "parallel", "model", "budget")
    ]
    assert [line["reason"] for line in lines] == ["rpm", "parallel", "model", "budget"]
    # With one, a page and the cursor to the next.
    params = {"token_id": token["id"], "format": "csv", "limit": 3}
    first_csv = api.request("GET", "/v1/refusals", params=params)
    assert [r["id"] for r in csv.DictReader(io.StringIO(first_csv.text))] == [
        ids[k] for k in ("rpm", "parallel", "model")
    ]
    cursor = first_csv.headers["x-next-cursor"]
    rest_csv = api.request("GET", "/v1/refusals", params={**params, "cursor": cursor})
    assert [r["id"] for r in csv.DictReader(io.StringIO(rest_csv.text))] == [ids["budget"]]
    assert "x-next-cursor" not in rest_csv.headers
    bad = api.request("GET", "/v1/refusals", params={"reason": "other"})
    assert bad.status_code == 400


def test_counts_by_reason_grouped_as_spend_groups(api, scene):
    team, _, token, _, other_user, _ = scene
    report = api.ok(
        "GET", "/v1/refusals/summary", params={"token_id": token["id"], "group_by": "reason"}
    )
    assert [(r["reason"], r["refusals"]) for r in report["rows"]] == [
        ("budget", 1),
        ("model", 1),
        ("parallel", 1),
        ("rpm", 1),
    ]
    assert report["total"] == {"refusals": 4} and report["row_count"] == 4
    by_team = api.ok(
        "GET",
        "/v1/refusals/summary",
        params={"team_id": team["id"], "group_by": "team,day", "labels": "true"},
    )
    [row] = by_team["rows"]
    assert (row["team_name"], row["refusals"]) == (team["name"], 4)
    assert len(row["day"]) == 10
    scoped = api.ok(
        "GET", "/v1/refusals/summary", params={"user_id": other_user["id"], "group_by": "scope"}
    )
    assert [(r["scope"], r["refusals"]) for r in scoped["rows"]] == [("user", 1)]


def test_a_user_sees_its_own_refusals_only(api, scene):
    _, user, token, ids, other_user, other_id = scene
    mine = api.ok("GET", "/v1/refusals", key=token["token"])
    assert {r["id"] for r in mine["data"]} == set(ids.values())
    assert all(r["user_id"] == user["id"] for r in mine["data"])
    forbidden = api.request(
        "GET", "/v1/refusals", key=token["token"], params={"user_id": other_user["id"]}
    )
    assert forbidden.status_code == 403
    counted = api.ok("GET", "/v1/refusals/summary", key=token["token"])
    assert counted["total"] == {"refusals": 4}
    everything = api.ok("GET", "/v1/refusals", params={"limit": 1000})
    assert other_id in {r["id"] for r in everything["data"]}


def test_the_routes_are_in_the_openapi_document(api):
    schema = api.ok("GET", "/openapi.json")
    refusals = schema["paths"]["/v1/refusals"]["get"]
    ok = refusals["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/RefusalsOut")
    assert "text/csv" in ok
    summary = schema["paths"]["/v1/refusals/summary"]["get"]["responses"]["200"]["content"]
    assert summary["application/json"]["schema"]["$ref"].endswith("/RefusalSummaryOut")
    for path in ("/v1/usage", "/v1/spend", "/v1/refusals"):
        names = {p["name"] for p in schema["paths"][path]["get"]["parameters"]}
        assert "labels" in names, path
    event = schema["components"]["schemas"]["UsageEvent"]["properties"]
    assert {"started_at", "error", "input_price", "max_tokens_clamped", "team_name"} <= set(event)
