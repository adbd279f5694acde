"""GET /v1/usage: filters, newest first, cursor pagination, CSV, and what a user may see."""

import csv
import io
import json
import re
from dataclasses import dataclass, fields

import httpx
import pytest

from metering.ledger.event import NULLABLE, PUBLIC, SPECS, Event
from metering.reports.schemas import UsageEvent, UsageOut

EVENT_FIELDS = {
    "id",
    "created_at",
    "started_at",
    "token_id",
    "user_id",
    "team_id",
    "model",
    "provider",
    "upstream_model",
    "upstream_id",
    "stream",
    "status",
    "http_status",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
    "usage_source",
    "usage_anomaly",
    "max_tokens_clamped",
    "input_price",
    "cached_price",
    "output_price",
    "cost",
    "uncharged",
    "ttft_ms",
    "latency_ms",
    "error",
    "kind",
    "corrects_event_id",
    "reason",
    "run_id",
    "end_user",
    "tags",
    "endpoint",
}
DETAIL_FIELDS = (
    "text_tokens",
    "reasoning_tokens",
    "audio_tokens",
    "image_tokens",
    "video_tokens",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
)
CSV_HEADER = [
    "id",
    "created_at",
    "started_at",
    "token_id",
    "user_id",
    "team_id",
    "model",
    "provider",
    "upstream_model",
    "upstream_id",
    "stream",
    "status",
    "http_status",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cached_tokens",
    *DETAIL_FIELDS,
    "usage_source",
    "usage_anomaly",
    "max_tokens_clamped",
    "input_price",
    "cached_price",
    "output_price",
    "cost",
    "uncharged",
    "ttft_ms",
    "latency_ms",
    "error",
    "kind",
    "corrects_event_id",
    "reason",
    "run_id",
    "end_user",
    "tags",
    "endpoint",
]
RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


@dataclass
class Call:
    id: str  # x-request-id: the ledger event's id
    token: dict
    user: dict
    team: dict
    model: str


@dataclass
class World:
    team_a: dict
    team_b: dict
    a1: dict  # user A1, with tokens a1 and a1b
    a2: dict
    b1: dict
    tokens: dict  # name -> token
    calls: list[Call]  # in the order they were made

    def ids(self, keep=lambda call: True) -> list[str]:
        """Ids of the calls kept, newest first."""
        return [c.id for c in reversed(self.calls) if keep(c)]


@pytest.fixture(scope="module")
def world(api) -> World:
    team_a, team_b = api.team(), api.team()
    a1, a2, b1 = api.user(team_a["id"]), api.user(team_a["id"]), api.user(team_b["id"])
    tokens = {
        "a1": api.token(a1["id"]),
        "a1b": api.token(a1["id"]),
        "a2": api.token(a2["id"]),
        "b1": api.token(b1["id"]),
    }
    owners = {"a1": (a1, team_a), "a1b": (a1, team_a), "a2": (a2, team_a), "b1": (b1, team_b)}
    plan = [
        ("a1", "gpt-sim"),
        ("a1", "minimax-m2.1"),
        ("a2", "minimax-m2.1"),
        ("a1b", "gpt-sim"),
        ("b1", "gpt-sim"),
        ("a1", "gpt-sim"),
    ]
    calls = []
    for name, model in plan:
        response = api.request(
            "POST",
            "/v1/chat/completions",
            key=tokens[name]["token"],
            json={"model": model, "messages": [{"role": "user", "content": "hi sim:tokens=2"}]},
        )
        assert response.status_code == 200, response.text
        user, team = owners[name]
        calls.append(Call(response.headers["x-request-id"], tokens[name], user, team, model))
    return World(team_a, team_b, a1, a2, b1, tokens, calls)


def usage(api, key: str | None = None, **params) -> dict:
    response = api.request("GET", "/v1/usage", key=key, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def ids_of(page: dict) -> list[str]:
    return [e["id"] for e in page["data"]]


def test_event_has_the_documented_fields(api, world):
    page = usage(api, token_id=world.tokens["a2"]["id"])
    assert page["next_cursor"] is None
    [event] = page["data"]
    assert set(event) == EVENT_FIELDS
    assert set(event["completion_tokens_details"]) == set(DETAIL_FIELDS)
    assert set(event["prompt_tokens_details"]) == {"cached_tokens"}
    assert RFC3339_UTC.fullmatch(event["created_at"])
    assert (event["end_user"], event["tags"]) == (None, {})
    assert re.fullmatch(r"\d+\.\d{6,12}", event["cost"])
    call = world.calls[2]
    assert (event["id"], event["token_id"], event["user_id"], event["team_id"]) == (
        call.id,
        call.token["id"],
        call.user["id"],
        call.team["id"],
    )
    assert (event["model"], event["provider"], event["completion_tokens"]) == (
        "minimax-m2.1",
        "sim-exascale",
        2,
    )


@pytest.mark.parametrize(
    ("filters", "keep"),
    [
        (lambda w: {"token_id": w.tokens["a1"]["id"]}, lambda w, c: c.token is w.tokens["a1"]),
        (lambda w: {"user_id": w.a1["id"]}, lambda w, c: c.user is w.a1),
        (lambda w: {"team_id": w.team_a["id"]}, lambda w, c: c.team is w.team_a),
        (lambda w: {"team_id": w.team_b["id"]}, lambda w, c: c.team is w.team_b),
        (
            lambda w: {"team_id": w.team_a["id"], "model": "gpt-sim"},
            lambda w, c: c.team is w.team_a and c.model == "gpt-sim",
        ),
        (
            lambda w: {"team_id": w.team_a["id"], "provider": "sim-exascale"},
            lambda w, c: c.team is w.team_a and c.model == "minimax-m2.1",
        ),
        (
            lambda w: {"user_id": w.a1["id"], "model": "minimax-m2.1"},
            lambda w, c: c.user is w.a1 and c.model == "minimax-m2.1",
        ),
        (lambda w: {"user_id": w.a1["id"], "team_id": w.team_b["id"]}, lambda w, c: False),
        (lambda w: {"user_id": w.a1["id"], "model": "no-such-model"}, lambda w, c: False),
    ],
    ids=[
        "token",
        "user",
        "team-a",
        "team-b",
        "team-and-model",
        "team-and-provider",
        "user-and-model",
        "user-of-other-team",
        "unknown-model",
    ],
)
def test_filters_select_exactly_their_events_newest_first(api, world, filters, keep):
    page = usage(api, **filters(world))
    assert ids_of(page) == world.ids(lambda c: keep(world, c))
    assert page["next_cursor"] is None


def test_events_are_newest_first(api, world):
    events = usage(api, team_id=world.team_a["id"])["data"]
    stamps = [e["created_at"] for e in events]
    assert stamps == sorted(stamps, reverse=True)
    assert len(set(stamps)) == len(stamps)


def test_start_is_inclusive_and_end_exclusive(api, world):
    events = usage(api, team_id=world.team_a["id"])["data"]
    oldest_first = list(reversed(events))
    start, end = oldest_first[1]["created_at"], oldest_first[3]["created_at"]
    page = usage(api, team_id=world.team_a["id"], start=start, end=end)
    assert ids_of(page) == [oldest_first[2]["id"], oldest_first[1]["id"]]
    assert ids_of(usage(api, team_id=world.team_a["id"], start=start)) == ids_of(
        {"data": events[: len(events) - 1]}
    )
    assert ids_of(usage(api, team_id=world.team_a["id"], end=start)) == [oldest_first[0]["id"]]
    assert ids_of(usage(api, team_id=world.team_a["id"], start=start, end=start)) == []


def test_a_reversed_range_is_400_as_in_spend(api, world):
    events = usage(api, team_id=world.team_a["id"])["data"]
    start, end = events[-1]["created_at"], events[0]["created_at"]
    for path in ("/v1/usage", "/v1/spend"):
        for fmt in ("json", "csv"):
            params = {"start": end, "end": start, "format": fmt}
            response = api.request("GET", path, params=params)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_request", "start")
            assert error["message"] == "start must not be after end"


def test_start_in_another_offset_means_the_same_instant(api, world):
    events = usage(api, team_id=world.team_a["id"])["data"]
    newest = events[0]["created_at"]
    # The same instant written at +02:00.
    from datetime import datetime, timedelta, timezone

    instant = datetime.fromisoformat(newest.replace("Z", "+00:00"))
    shifted = instant.astimezone(timezone(timedelta(hours=2))).isoformat()
    assert ids_of(usage(api, team_id=world.team_a["id"], start=shifted)) == [events[0]["id"]]


def test_cursor_pages_cover_every_event_exactly_once(api, world):
    expected = world.ids(lambda c: c.team is world.team_a)
    seen, cursor, pages = [], None, 0
    while True:
        params = {"team_id": world.team_a["id"], "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = usage(api, **params)
        pages += 1
        assert len(page["data"]) <= 2
        seen += ids_of(page)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == expected
    assert pages == 3  # 5 events: 2 + 2 + 1


def test_cursor_page_that_ends_exactly_has_no_next_cursor(api, world):
    page = usage(api, user_id=world.a1["id"], limit=4)
    assert len(page["data"]) == 4
    assert page["next_cursor"] is None
    page = usage(api, user_id=world.a1["id"], limit=3)
    assert page["next_cursor"] is not None
    rest = usage(api, user_id=world.a1["id"], limit=3, cursor=page["next_cursor"])
    assert ids_of(page) + ids_of(rest) == world.ids(lambda c: c.user is world.a1)
    assert rest["next_cursor"] is None


def read_csv(api, key: str | None = None, **params) -> list[list[str]]:
    response = api.request("GET", "/v1/usage", key=key, params={**params, "format": "csv"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    return list(csv.reader(io.StringIO(response.text)))


def test_csv_has_a_header_and_one_row_per_event_with_the_same_costs(api, world):
    events = usage(api, team_id=world.team_a["id"])["data"]
    rows = read_csv(api, team_id=world.team_a["id"])
    assert rows[0] == CSV_HEADER
    records = [dict(zip(CSV_HEADER, row, strict=True)) for row in rows[1:]]
    assert [r["id"] for r in records] == [e["id"] for e in events]
    for record, event in zip(records, events, strict=True):
        assert record["cost"] == event["cost"]
        assert record["created_at"] == event["created_at"]
        assert int(record["prompt_tokens"]) == event["prompt_tokens"]
        assert int(record["completion_tokens"]) == event["completion_tokens"]
        assert int(record["cached_tokens"]) == event["prompt_tokens_details"]["cached_tokens"]
        assert record["token_id"] == event["token_id"]
        assert record["model"] == event["model"]


def test_csv_with_no_match_is_just_the_header(api, world):
    assert read_csv(api, team_id=world.team_a["id"], model="no-such-model") == [CSV_HEADER]


def test_user_token_sees_only_its_own_users_events(api, world):
    key = world.tokens["a1"]["token"]
    own = world.ids(lambda c: c.user is world.a1)
    assert ids_of(usage(api, key=key)) == own
    assert ids_of(usage(api, key=key, team_id=world.team_a["id"])) == own
    assert ids_of(usage(api, key=key, user_id=world.a1["id"])) == own
    assert usage(api, key=key, token_id=world.tokens["a2"]["id"])["data"] == []
    assert usage(api, key=key, team_id=world.team_b["id"])["data"] == []
    assert [row[0] for row in read_csv(api, key=key)[1:]] == own


def test_another_users_filter_is_403_as_in_spend(api, world):
    key = world.tokens["a1"]["token"]
    for path in ("/v1/usage", "/v1/spend"):
        for fmt in ("json", "csv"):
            params = {"user_id": world.a2["id"], "format": fmt}
            response = api.request("GET", path, key=key, params=params)
            assert response.status_code == 403, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "forbidden"
            assert error["message"] == "this credential may only report its own usage and spend"


def test_usage_needs_a_credential(api):
    response = httpx.get(f"{api.url}/v1/usage", timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-01-01T00:00:00"}, "start"),  # no time zone
        ({"end": "2026-13-01T00:00:00Z"}, "end"),
        ({"cursor": "!!!"}, "cursor"),
        ({"cursor": "AAAA"}, "cursor"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"format": "xml"}, "format"),
    ],
)
def test_invalid_query_is_400_naming_the_parameter(api, params, param):
    response = api.request("GET", "/v1/usage", params=params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)


@pytest.mark.parametrize(
    "params",
    [
        {"start": "0001-01-01T00:00:00+01:00"},  # before year 1 in UTC
        {"end": "9999-12-31T23:59:59-01:00"},  # after year 9999 in UTC
        {"start": "1970-01-01T00:00:00Z", "end": "3999-01-01T00:00:00Z"},
    ],
)
def test_any_rfc3339_range_edge_is_read_within_the_stored_bounds(api, params):
    """The document says `format: date-time`: every valid one is taken; nothing is stored before
    2000 or after 2999, so an edge beyond them reads as the bound."""
    _, _, token = api.principal()
    api.openai(token["token"]).chat.completions.create(
        model="gpt-sim", messages=[{"role": "user", "content": "edge"}]
    )
    bounded = api.ok("GET", "/v1/usage", params={"token_id": token["id"]})
    assert len(bounded["data"]) == 1
    wide = api.ok("GET", "/v1/usage", params={"token_id": token["id"], **params})
    assert wide["data"] == bounded["data"]


def test_nul_in_a_filter_is_never_a_server_error(api):
    response = api.request("GET", "/v1/usage", params={"model": "a\x00b"})
    assert response.status_code in (200, 400), response.text


# --- the declared response model -----------------------------------------------------------


def test_the_response_model_is_built_from_the_event_declaration():
    """UsageEvent holds the event's public columns in their order (the grouped ones nested), each
    nullable exactly where its column is; money and times are text, the rest the event's type."""
    flat, types = [], {}
    for name, field in UsageEvent.model_fields.items():
        nested = getattr(field.annotation, "model_fields", None)
        if nested is None:
            flat.append(name)
            types[name] = field.annotation
            continue
        assert {SPECS[member].group for member in nested} == {name}
        flat.extend(nested)
        types.update((member, f.annotation) for member, f in nested.items())
    assert tuple(flat) == (*PUBLIC, "team_name", "user_email", "token_name")
    declared = {f.name: f.type for f in fields(Event)}
    for name in PUBLIC:
        if SPECS[name].money or SPECS[name].price or name in ("created_at", "started_at"):
            assert types[name] is str, name
        elif SPECS[name].json_text:  # the tags: JSON text, shown as the object
            assert types[name] == dict[str, str], name
        else:
            assert types[name] == declared[name], name
        assert (type(None) in getattr(types[name], "__args__", ())) == (name in NULLABLE), name
    schema = UsageOut.model_json_schema()["$defs"]["UsageEvent"]
    assert schema["required"] == list(UsageEvent.model_fields)[:-3]  # not the labels
    assert schema["additionalProperties"] is False
    assert schema["properties"]["created_at"]["format"] == "date-time"


def test_a_page_is_exactly_what_its_model_declares(api, world):
    """Every key and value of a real page validates against UsageOut and nothing is left out or
    added; the body is the compact JSON it always was."""
    response = api.request("GET", "/v1/usage", params={"team_id": world.team_a["id"], "limit": 3})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert len(body["data"]) == 3 and body["next_cursor"] is not None
    assert UsageOut.model_validate(body).model_dump(mode="json", exclude_unset=True) == body
    compact = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    assert response.content == compact.encode()
