"""POST /v1/events: usage from outside the proxy recorded exactly once, priced at its moment,
charged to the window it falls in; duplicates, conflicts and invalid events change nothing."""

import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from metering.models import BudgetWindow
from metering.money import cost_pico, format_usd
from metering.settings import parse_catalog
from metering.testing import metering_server
from tests.budgets.conftest import pico, query
from tests.conftest import ADMIN_KEY, catalog_for

GPT = (150_000, 75_000, 600_000)  # gpt-sim's prices in the test catalog


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def usage_event(**fields) -> dict:
    return {
        "idempotency_key": key(),
        "model": "gpt-sim",
        "prompt_tokens": 1000,
        "cached_tokens": 200,
        "completion_tokens": 300,
        **fields,
    }


def post(api, events: list[dict], **kwargs) -> list[dict]:
    body = api.ok("POST", "/v1/events", json={"events": events}, **kwargs)
    return body["data"]


def rfc(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def spent(api, scope: str, subject: str) -> Decimal:
    return Decimal(api.ok("GET", f"/v1/{scope}s/{subject}/budget")["spent"])


def test_a_replayed_batch_changes_nothing(api):
    team, user, token = api.principal(token_limit="10")
    events = [usage_event(token_id=token["id"]) for _ in range(3)]
    first = post(api, events)
    assert [r["status"] for r in first] == ["created"] * 3
    assert [r["idempotency_key"] for r in first] == [e["idempotency_key"] for e in events]
    recorded = api.events(token_id=token["id"])
    assert {e["id"] for e in recorded} == {r["event_id"] for r in first}
    cost = cost_pico(1000, 200, 300, *GPT)
    for e in recorded:
        assert e["usage_source"] == "ingested"
        assert e["kind"] == "usage"
        assert (e["user_id"], e["team_id"]) == (user["id"], team["id"])
        assert e["cost"] == format_usd(cost)
    before = {s: spent(api, s, i) for s, i in (("token", token["id"]), ("team", team["id"]))}
    assert before["token"] == Decimal(format_usd(3 * cost))

    again = post(api, events)
    assert [r["status"] for r in again] == ["duplicate"] * 3
    assert [r["event_id"] for r in again] == [r["event_id"] for r in first]
    assert len(api.events(token_id=token["id"])) == 3
    assert {s: spent(api, s, i) for s, i in (("token", token["id"]), ("team", team["id"]))} == (
        before
    )


def test_the_same_key_with_other_content_is_a_conflict(api):
    _, user, _ = api.principal()
    event = usage_event(user_id=user["id"])
    (created,) = post(api, [event])
    (conflict,) = post(api, [{**event, "completion_tokens": 301}])
    assert conflict["status"] == "conflict"
    assert conflict["event_id"] == created["event_id"]
    assert conflict["error"]
    (duplicate,) = post(api, [event])
    assert duplicate == {**created, "status": "duplicate"}
    assert len(api.events(user_id=user["id"])) == 1
    # Twice in one batch: the first is recorded, the second compared with it.
    fresh = usage_event(user_id=user["id"])
    answers = post(api, [fresh, fresh, {**fresh, "prompt_tokens": 5000}])
    assert [a["status"] for a in answers] == ["created", "duplicate", "conflict"]
    assert len({a["event_id"] for a in answers}) == 1
    assert len(api.events(user_id=user["id"])) == 2


def test_invalid_events_are_rejected_one_by_one(api):
    _, user, _ = api.principal()
    now = datetime.now(UTC)
    batch = [
        usage_event(user_id=user["id"]),
        usage_event(user_id=user["id"], model="no-such-model"),
        usage_event(user_id=user["id"], occurred_at=rfc(now - timedelta(days=36))),
        usage_event(user_id=user["id"], prompt_tokens=-1),
        usage_event(user_id=user["id"], cached_tokens=5000),
        usage_event(user_id=user["id"], provider="sim-exascale"),
        usage_event(),  # no user or token
        usage_event(user_id="user_missing"),
        {"model": "gpt-sim"},
        "not an object",
        usage_event(user_id=user["id"], occurred_at="yesterday"),
        usage_event(user_id=user["id"], completion_tokens=True),
        usage_event(user_id=user["id"], surprise=1),
    ]
    answers = post(api, batch)
    assert [a["status"] for a in answers] == ["created"] + ["rejected"] * (len(batch) - 1)
    for answer in answers[1:]:
        assert answer["error"] and answer["event_id"] is None
    assert len(api.events(user_id=user["id"])) == 1


def test_a_batch_holds_at_most_1000_events(api):
    response = api.request("POST", "/v1/events", json={"events": [usage_event()] * 1001})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


def test_a_token_records_its_own_usage_only(api):
    team, user, token = api.principal()
    other_team, other_user, _ = api.principal()
    answers = post(
        api,
        [usage_event(), usage_event(user_id=other_user["id"])],
        key=token["token"],
    )
    assert [a["status"] for a in answers] == ["created", "rejected"]
    (event,) = api.events(token_id=token["id"])
    assert (event["user_id"], event["team_id"]) == (user["id"], team["id"])
    assert api.events(user_id=other_user["id"]) == []


def test_a_back_dated_event_lands_in_its_window_and_day(api):
    team, user, token = api.principal(token_limit="10", interval="daily")
    now = datetime.now(UTC)
    then = now - timedelta(days=3)
    (answer,) = post(api, [usage_event(token_id=token["id"], occurred_at=rfc(then))])
    assert answer["status"] == "created"
    (event,) = api.events(token_id=token["id"])
    assert event["created_at"].startswith(then.strftime("%Y-%m-%dT%H"))
    cost = cost_pico(1000, 200, 300, *GPT)

    # The rollup: the event's own day, whole days read from the daily rollups.
    report = api.ok(
        "GET",
        "/v1/spend",
        params={
            "group_by": "day",
            "token_id": token["id"],
            "start": rfc(now - timedelta(days=10)),
            "end": rfc(now),
        },
    )
    assert [(r["day"], r["requests"], r["cost"]) for r in report["rows"]] == [
        (then.strftime("%Y-%m-%d"), 1, format_usd(cost))
    ]
    # The budget: today's window is untouched; the closed window of that day holds it.
    assert spent(api, "token", token["id"]) == 0
    windows = BudgetWindow.__table__
    rows = query(
        api.settings.database_url,
        select(windows.c.window_start, windows.c.window_end, windows.c.spent).where(
            windows.c.subject_id == token["id"]
        ),
    )
    day = then.replace(hour=0, minute=0, second=0, microsecond=0)
    assert [(r.window_start, r.window_end, r.spent) for r in rows] == [
        (day, day + timedelta(days=1), cost)
    ]
    # A second one that day adds to the same closed total.
    post(api, [usage_event(token_id=token["id"], occurred_at=rfc(then + timedelta(seconds=1)))])
    rows = query(
        api.settings.database_url,
        select(windows.c.spent).where(windows.c.subject_id == token["id"]),
    )
    assert [r.spent for r in rows] == [2 * cost]
    assert pico(api.ok("GET", f"/v1/tokens/{token['id']}/budget")["spent"]) == 0


def test_ingested_usage_is_priced_at_its_moment(api):
    _, user, _ = api.principal()
    (answer,) = post(
        api,
        [
            usage_event(
                user_id=user["id"], provider="sim-exascale", model="minimax-m2.1", cached_tokens=0
            )
        ],
    )
    assert answer["status"] == "created"
    (event,) = api.events(user_id=user["id"])
    assert event["provider"] == "sim-exascale"
    assert event["cost"] == format_usd(cost_pico(1000, 0, 300, 300_000, 300_000, 1_200_000))


def test_concurrent_duplicates_on_two_servers_make_one_event(api, sim):
    if api.backend != "postgresql":
        pytest.skip("replicas share PostgreSQL; one SQLite file is one server's")
    _, user, _ = api.principal()
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "sim-key", "SIM_OPENAI_KEY": "sim-key"}
    )
    second = metering_server(api.settings, catalog)
    try:
        batches = [[usage_event(user_id=user["id"]) for _ in range(50)] for _ in range(4)]
        answers: dict[tuple[str, int], list[dict]] = {}

        def send(url: str, n: int, batch: list[dict]) -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                response = client.post(
                    "/v1/events",
                    json={"events": batch},
                    headers={"authorization": f"Bearer {ADMIN_KEY}"},
                )
                assert response.status_code == 200, response.text
                answers[(url, n)] = response.json()["data"]

        threads = [
            threading.Thread(target=send, args=(url, n, batch))
            for n, batch in enumerate(batches)
            for url in (api.url, second.url)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(answers) == 8
        for n in range(len(batches)):
            one, two = answers[(api.url, n)], answers[(second.url, n)]
            for a, b in zip(one, two, strict=True):
                assert sorted([a["status"], b["status"]]) == ["created", "duplicate"]
                assert a["event_id"] == b["event_id"]
        assert len(api.events(user_id=user["id"])) == 200
    finally:
        second.stop()
