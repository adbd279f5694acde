"""The ledger shown whole: every column in /v1/usage (JSON and CSV), names beside ids on
request (labels=true), CSV booleans as true/false, `limit` honoured by the CSV, one money
format, and team names that are unique."""

import csv
import io
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest

from metering.ledger.event import NAMES
from metering.money import format_usd


def rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.fixture(scope="module")
def lead(api):
    """One team, one user and a token with a small limit, and three requests: the first two
    plain, the last one with max_tokens lowered to fit the credit left."""
    team, user, token = api.principal(token_limit="0.001")
    client = api.openai(token["token"])
    ids = []
    for model in ("gpt-sim", "minimax-m2.1"):
        raw = client.chat.completions.with_raw_response.create(
            model=model, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        ids.append(raw.headers["x-request-id"])
    # No max_tokens: the model's 4096 at 0.60 USD per 1M tokens is more than 0.001 USD.
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-sim", messages=[{"role": "user", "content": "sim:tokens=3"}]
    )
    clamped = int(raw.headers["x-max-tokens-clamped"])
    ids.append(raw.headers["x-request-id"])
    return team, user, token, ids, clamped


def test_usage_json_carries_every_ledger_column_and_prices(api, lead):
    team, user, token, ids, clamped = lead
    events = {e["id"]: e for e in api.events(token_id=token["id"])}
    assert set(events) == set(ids)
    first = events[ids[0]]
    flat = {k for k in first if not k.endswith("_details")}
    flat |= set(first["prompt_tokens_details"]) | set(first["completion_tokens_details"])
    assert flat == set(NAMES)
    assert (first["input_price"], first["cached_price"], first["output_price"]) == (
        "0.15",
        "0.075",
        "0.6",
    )
    assert first["started_at"] <= first["created_at"]
    assert first["error"] is None and first["max_tokens_clamped"] is None
    assert events[ids[2]]["max_tokens_clamped"] == clamped
    assert "team_name" not in first


def test_labels_put_names_beside_ids_in_usage_and_spend(api, lead):
    team, user, token, ids, _ = lead
    page = api.ok("GET", "/v1/usage", params={"token_id": token["id"], "labels": "true"})
    for event in page["data"]:
        assert (event["team_name"], event["user_email"], event["token_name"]) == (
            team["name"],
            user["email"],
            token["name"],
        )
    spend = api.ok(
        "GET",
        "/v1/spend",
        params={"team_id": team["id"], "group_by": "team,user,token", "labels": "true"},
    )
    [row] = spend["rows"]
    assert (row["team_name"], row["user_email"], row["token_name"]) == (
        team["name"],
        user["email"],
        token["name"],
    )
    by_model = api.ok(
        "GET", "/v1/spend", params={"team_id": team["id"], "group_by": "model", "labels": "true"}
    )
    assert all("team_name" not in r for r in by_model["rows"])
    text = api.request(
        "GET",
        "/v1/spend",
        params={"team_id": team["id"], "group_by": "user", "labels": "true", "format": "csv"},
    ).text
    [line] = rows(text)
    assert (line["user_id"], line["user_email"]) == (user["id"], user["email"])


def test_usage_csv_writes_booleans_as_json_does_and_every_column(api, lead):
    _, user, token, ids, clamped = lead
    response = api.request(
        "GET", "/v1/usage", params={"token_id": token["id"], "format": "csv", "labels": "true"}
    )
    assert response.status_code == 200
    lines = {r["id"]: r for r in rows(response.text)}
    assert set(lines) == set(ids)
    assert {r["stream"] for r in lines.values()} == {"false"}
    assert lines[ids[2]]["max_tokens_clamped"] == str(clamped)
    assert lines[ids[0]]["output_price"] == "0.6"
    assert lines[ids[0]]["user_email"] == user["email"]
    assert list(lines[ids[0]])[: len(NAMES)] == [n for n in NAMES]


def test_usage_csv_honours_limit_and_pages_with_a_cursor(api, lead):
    _, _, token, ids, _ = lead
    params = {"token_id": token["id"], "format": "csv", "limit": 2}
    first = api.request("GET", "/v1/usage", params=params)
    assert [r["id"] for r in rows(first.text)] == ids[::-1][:2]
    cursor = first.headers["x-next-cursor"]
    second = api.request("GET", "/v1/usage", params={**params, "cursor": cursor})
    assert [r["id"] for r in rows(second.text)] == ids[:1]
    assert "x-next-cursor" not in second.headers


def test_money_has_one_format_everywhere(api, lead):
    """Plain exact decimals, no exponent, no trailing zeros: the same text in usage, spend and
    budgets."""
    team, _, token, _, _ = lead
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert budget["credit_limit"] == "0.001"
    events = api.events(token_id=token["id"])
    total = sum(Decimal(e["cost"]) for e in events)
    spend = api.ok("GET", "/v1/spend", params={"token_id": token["id"]})
    assert spend["total"]["cost"] == format_usd(int(total * 10**12))
    for text in [budget["spent"], spend["total"]["cost"], *(e["cost"] for e in events)]:
        assert "e" not in text.lower() and not (text.endswith("0") and "." in text)
        assert not text.endswith(".")
    assert (
        format_usd(0) == "0"
        and format_usd(10**12) == "1"
        and format_usd(976200000) == ("0.0009762")
    )


def test_team_names_are_unique_with_the_existing_id_in_the_409(api):
    name = f"Platform-{uuid.uuid4().hex[:6]}"
    first = api.ok("POST", "/v1/teams", 201, json={"name": name})
    again = api.request("POST", "/v1/teams", json={"name": name.lower()})
    assert again.status_code == 409
    error = again.json()["error"]
    assert (error["code"], error["param"]) == ("team_name_taken", "name")
    assert first["id"] in error["message"]
    other = api.team()
    renamed = api.request("PATCH", f"/v1/teams/{other['id']}", json={"name": name})
    assert renamed.status_code == 409 and first["id"] in renamed.json()["error"]["message"]
    # Its own name again is no conflict; a deleted team's name is free.
    api.ok("PATCH", f"/v1/teams/{first['id']}", json={"name": name})
    api.ok("DELETE", f"/v1/teams/{first['id']}", 204)
    api.ok("POST", "/v1/teams", 201, json={"name": name})


def test_racing_creations_and_renames_to_one_team_name_give_one_team_and_409s(api):
    """The service's check and the unique index together: whatever the interleaving, one team
    holds the name and every other attempt is the same 409, never a 500."""
    name = f"Race-{uuid.uuid4().hex[:6]}"
    others = [api.team() for _ in range(4)]
    admin = {"authorization": f"Bearer {api.settings.admin_key}"}

    def attempt(i: int) -> int:
        with httpx.Client(base_url=api.url, timeout=60, headers=admin) as client:
            spelled = name.upper() if i % 2 else name
            if i < len(others):
                return client.patch(f"/v1/teams/{others[i]['id']}", json={"name": spelled})
            return client.post("/v1/teams", json={"name": spelled})

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(attempt, range(16)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(409) == 15 and set(statuses) <= {200, 201, 409}, statuses
    for answer in answers:
        if answer.status_code == 409:
            assert answer.json()["error"]["code"] == "team_name_taken"
    (winner,) = [a.json()["id"] for a in answers if a.status_code != 409]
    again = api.request("POST", "/v1/teams", json={"name": name.lower()})
    assert again.status_code == 409 and winner in again.json()["error"]["message"]
