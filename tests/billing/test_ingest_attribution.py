"""POST /v1/events takes an end user and tags on each event, with a proxied request's bounds:
recorded on the event (GET /v1/usage), part of what an idempotency key stands for, and each
one out of bounds rejects its event alone (reason invalid_event, the error naming the field)."""

import uuid
from decimal import Decimal

import pytest

from metering.money import cost_pico, format_usd

GPT = (150_000, 75_000, 600_000)  # gpt-sim's prices in the test catalog


def usage_event(**fields) -> dict:
    return {
        "idempotency_key": f"k-{uuid.uuid4().hex}",
        "model": "gpt-sim",
        "prompt_tokens": 100,
        "completion_tokens": 20,
        **fields,
    }


def post(api, events: list[dict], key: str | None = None) -> list[dict]:
    return api.ok("POST", "/v1/events", json={"events": events}, key=key)["data"]


def test_an_event_keeps_its_end_user_and_tags(api):
    _, _, token = api.principal()
    tagged = usage_event(
        token_id=token["id"], end_user="cust-9", tags={"feature": "batch", "env": "prod"}
    )
    bare = usage_event(token_id=token["id"])
    results = post(api, [tagged, bare])
    assert [r["status"] for r in results] == ["created", "created"]
    events = {e["id"]: e for e in api.events(token_id=token["id"])}
    first, second = (events[r["event_id"]] for r in results)
    assert (first["end_user"], first["tags"]) == ("cust-9", {"env": "prod", "feature": "batch"})
    assert (second["end_user"], second["tags"]) == (None, {})
    assert first["cost"] == format_usd(cost_pico(100, 0, 20, *GPT))
    [found] = api.events(token_id=token["id"], end_user="cust-9", tag="env:prod")
    assert found["id"] == first["id"]


def test_a_users_own_credential_reports_its_end_users_too(api):
    _, _, token = api.principal()
    [result] = post(api, [usage_event(end_user="cust-own", tags={"a": "b"})], key=token["token"])
    assert result["status"] == "created", result
    [event] = api.events(token_id=token["id"])
    assert (event["end_user"], event["tags"]) == ("cust-own", {"a": "b"})


def test_the_same_key_with_other_tags_or_end_user_is_a_conflict(api):
    _, user, _ = api.principal()
    event = usage_event(user_id=user["id"], end_user="a", tags={"k": "v"})
    [created] = post(api, [event])
    assert created["status"] == "created"
    assert post(api, [event])[0]["status"] == "duplicate"
    # Tags are compared as an object, whatever the order they were sent in.
    same = {**event, "tags": {"k": "v"}}
    assert post(api, [same])[0]["status"] == "duplicate"
    for changed in ({"end_user": "b"}, {"tags": {"k": "w"}}, {"end_user": None, "tags": None}):
        [answer] = post(api, [{**event, **changed}])
        assert answer["status"] == "conflict", changed
    assert len(api.events(user_id=user["id"])) == 1


def test_an_event_without_them_keeps_the_digest_it_always_had(api):
    # A key recorded before events took end users replays as a duplicate: an event that sends
    # neither has the same digest as before (and so does one sending them empty).
    _, user, _ = api.principal()
    event = usage_event(user_id=user["id"])
    post(api, [event])
    assert post(api, [{**event, "tags": {}}])[0]["status"] == "duplicate"
    assert post(api, [{**event, "end_user": None}])[0]["status"] == "duplicate"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"end_user": "x" * 257}, "end_user", id="end-user-too-long"),
        pytest.param({"end_user": ""}, "end_user", id="end-user-empty"),
        pytest.param({"end_user": "nel\u0085"}, "end_user", id="end-user-not-printable"),
        pytest.param({"end_user": "zw\u200b"}, "end_user", id="end-user-format-character"),
        pytest.param({"end_user": 7}, "end_user", id="end-user-not-a-string"),
        pytest.param({"tags": {f"k{i}": "v" for i in range(17)}}, "tags", id="17-pairs"),
        pytest.param({"tags": {"k" * 65: "v"}}, "tags", id="65-char-key"),
        pytest.param({"tags": {"k": "v" * 513}}, "tags", id="513-char-value"),
        pytest.param({"tags": {"k": 1}}, "tags", id="non-string-value"),
        pytest.param({"tags": "env:prod"}, "tags", id="not-an-object"),
    ],
)
def test_each_bound_rejects_its_event_alone(api, fields, named):
    _, _, token = api.principal()
    good = usage_event(token_id=token["id"])
    bad = usage_event(token_id=token["id"], **fields)
    rejected, created = post(api, [bad, good])
    assert created["status"] == "created"
    assert (rejected["status"], rejected["reason"], rejected["event_id"]) == (
        "rejected",
        "invalid_event",
        None,
    )
    assert rejected["error"].startswith(named)
    [event] = api.events(token_id=token["id"])
    assert event["id"] == created["event_id"]
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["spent"]) == Decimal(event["cost"])


def test_a_control_character_refuses_the_whole_batch_as_any_text_field_does(api):
    # Every string of the batch is checked as text first (metering.text): a C0 control is
    # no text any field takes, and the request is a 400 naming where it is.
    _, _, token = api.principal()
    events = [usage_event(token_id=token["id"]), usage_event(token_id=token["id"], end_user="a\tb")]
    response = api.request("POST", "/v1/events", json={"events": events})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "events[1].end_user"
    assert api.events(token_id=token["id"]) == []


def test_a_correction_of_an_event_keeps_its_end_user_and_tags(api):
    # So that spend by end user and by tag stays the ledger's after a credit or a rerate.
    _, _, token = api.principal()
    customer = f"cust-{uuid.uuid4().hex[:8]}"
    [created] = post(
        api, [usage_event(token_id=token["id"], end_user=customer, tags={"env": "prod"})]
    )
    adjustment = api.ok(
        "POST",
        "/v1/adjustments",
        201,
        json={"amount": "-0.00001", "reason": "goodwill", "corrects_event_id": created["event_id"]},
    )
    found = {e["id"]: e for e in api.events(end_user=customer, tag="env:prod")}
    assert set(found) == {created["event_id"], adjustment["id"]}
    corrected = found[adjustment["id"]]
    assert (corrected["kind"], corrected["cost"]) == ("adjustment", "-0.00001")
    assert (corrected["end_user"], corrected["tags"]) == (customer, {"env": "prod"})
