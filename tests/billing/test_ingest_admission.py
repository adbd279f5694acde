"""Who reports usage decides what is checked: a user's own credential's events are admitted like
its requests (allow-lists, rpm and tpm, credit at every scope, its run), rejected with a reason
and recorded as refusals when they do not fit, never charged; the admin key and a team's
ingestion key report usage charged in full, an ingestion key for its own team only; no event
takes a counter past its ceiling; every count is checked against the others."""

from decimal import Decimal

import pytest
from sqlalchemy import create_engine, pool, text

from metering.db import sync_url
from metering.money import cost_pico, format_usd
from tests.billing.test_ingest import GPT, post, spent, usage_event
from tests.budgets.conftest import wait_for

ONE = cost_pico(1000, 200, 300, *GPT)  # one usage_event() at gpt-sim's prices


def statuses(answers: list[dict]) -> list[tuple]:
    return [(a["status"], a.get("reason"), a.get("scope")) for a in answers]


def refusals(api, token_id: str) -> list[dict]:
    return api.ok("GET", "/v1/refusals", params={"token_id": token_id, "limit": 1000})["data"]


def ingest_key(api, team_id: str) -> dict:
    return api.ok("POST", f"/v1/teams/{team_id}/ingest-keys", 201, json={"name": "collector"})


def test_a_users_token_cannot_report_past_its_users_credit(api):
    # Room for two events at the user's scope, none past it.
    team, user, token = api.principal(user_limit=format_usd(2 * ONE), team_limit="100")
    answers = post(api, [usage_event() for _ in range(5)], key=token["token"])
    assert (
        statuses(answers)
        == [("created", None, None)] * 2 + [("rejected", "budget_exceeded", "user")] * 3
    )
    assert "user budget" in answers[2]["error"] and answers[2]["event_id"] is None
    assert spent(api, "user", user["id"]) == Decimal(format_usd(2 * ONE))
    assert spent(api, "team", team["id"]) == Decimal(format_usd(2 * ONE))
    assert len(api.events(token_id=token["id"])) == 2
    found = wait_for(lambda: len(refusals(api, token["id"])) == 3 and refusals(api, token["id"]))
    assert {(r["reason"], r["scope"], r["http_status"]) for r in found} == {("budget", "user", 402)}


def test_the_admin_and_an_ingestion_key_report_past_every_limit(api):
    team, user, token = api.principal(user_limit=format_usd(ONE), team_limit=format_usd(ONE))
    by_admin = post(api, [usage_event(token_id=token["id"]) for _ in range(2)])
    key = ingest_key(api, team["id"])
    by_key = post(api, [usage_event(token_id=token["id"]) for _ in range(2)], key=key["key"])
    assert [a["status"] for a in by_admin + by_key] == ["created"] * 4
    assert spent(api, "team", team["id"]) == Decimal(format_usd(4 * ONE))
    # Past its limit now: the user's own token reports nothing more.
    (late,) = post(api, [usage_event()], key=token["token"])
    assert (late["status"], late["reason"]) == ("rejected", "budget_exceeded")


def test_a_token_reports_within_its_own_token_and_team_budgets(api):
    team, _, token = api.principal(token_limit=format_usd(ONE))
    answers = post(api, [usage_event(), usage_event()], key=token["token"])
    assert statuses(answers) == [("created", None, None), ("rejected", "budget_exceeded", "token")]
    team2, _, token2 = api.principal(team_limit=format_usd(ONE))
    answers = post(api, [usage_event(), usage_event()], key=token2["token"])
    assert statuses(answers) == [("created", None, None), ("rejected", "budget_exceeded", "team")]
    assert spent(api, "team", team2["id"]) == Decimal(format_usd(ONE))


def test_a_token_reports_only_models_its_allow_list_names(api):
    _, _, token = api.principal()
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": ["minimax-m2.1"]})
    answers = post(api, [usage_event(), usage_event(model="minimax-m2.1")], key=token["token"])
    assert statuses(answers) == [
        ("rejected", "model_not_allowed", "token"),
        ("created", None, None),
    ]
    (event,) = api.events(token_id=token["id"])
    assert event["model"] == "minimax-m2.1"
    found = wait_for(lambda: refusals(api, token["id"]))
    assert [(r["reason"], r["scope"], r["model"]) for r in found] == [("model", "token", "gpt-sim")]


def test_a_token_reports_within_its_tpm(api):
    _, _, token = api.principal()
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"tpm_limit": 10})
    small = usage_event(prompt_tokens=4, cached_tokens=0, completion_tokens=5)
    answers = post(api, [usage_event(), small], key=token["token"])  # 1,300 tokens, then 9
    assert statuses(answers)[0] == ("rejected", "rate_limit_exceeded", "token")
    assert "tpm_limit" in answers[0]["error"]
    assert answers[1]["status"] == "created"
    found = wait_for(lambda: refusals(api, token["id"]))
    assert [(r["reason"], r["http_status"]) for r in found] == [("tpm", 429)]


def test_each_event_counts_as_one_request_against_rpm(api):
    _, _, token = api.principal()
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"rpm_limit": 1})
    answers = post(api, [usage_event() for _ in range(5)], key=token["token"])
    created = [a for a in answers if a["status"] == "created"]
    # One a minute: two only if the batch straddled a minute's end.
    assert 1 <= len(created) <= 2
    refused = [a for a in answers if a["status"] != "created"]
    assert {(a["status"], a["reason"], a["scope"]) for a in refused} == {
        ("rejected", "rate_limit_exceeded", "token")
    }
    assert len(api.events(token_id=token["id"])) == len(created)


def test_a_rejected_event_gives_back_its_rate_counts(api):
    _, user, token = api.principal(token_limit="0")  # credit for nothing
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"rpm_limit": 1000, "tpm_limit": 10**6})
    answers = post(api, [usage_event() for _ in range(3)], key=token["token"])
    assert {a["reason"] for a in answers} == {"budget_exceeded"}
    shown = api.ok("GET", f"/v1/tokens/{token['id']}/limits")
    assert (shown["requests"], shown["tokens"]) == (0, 0)


def test_a_duplicate_takes_no_request_from_rpm(api):
    _, _, token = api.principal()
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"rpm_limit": 1000})
    event = usage_event()
    assert post(api, [event], key=token["token"])[0]["status"] == "created"
    assert post(api, [event], key=token["token"])[0]["status"] == "duplicate"
    assert api.ok("GET", f"/v1/tokens/{token['id']}/limits")["requests"] == 1


def test_a_rejected_events_key_stays_free(api):
    team, _, token = api.principal(token_limit=format_usd(ONE))
    first, second = usage_event(), usage_event()
    assert [a["status"] for a in post(api, [first, second], key=token["token"])] == [
        "created",
        "rejected",
    ]
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": format_usd(2 * ONE)})
    (again,) = post(api, [second], key=token["token"])
    assert again["status"] == "created"


def test_a_run_bounds_what_its_reports_may_cost(api):
    _, _, token = api.principal()
    headers = {"x-metering-run": "ingest-run", "x-metering-run-budget": format_usd(ONE)}
    answers = post(api, [usage_event(), usage_event()], key=token["token"], headers=headers)
    assert statuses(answers) == [("created", None, None), ("rejected", "budget_exceeded", "run")]
    refused = api.request(
        "POST",
        "/v1/events",
        json={"events": [usage_event(token_id=token["id"])]},
        headers={"x-metering-run": "ingest-run"},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "x-metering-run"


def test_an_ingestion_key_reports_for_its_own_team_only(api):
    team, user, token = api.principal()
    _, other_user, other_token = api.principal()
    key = ingest_key(api, team["id"])
    assert key["key"].startswith("mik_") and key["prefix"] == key["key"][:12]
    answers = post(
        api,
        [
            usage_event(token_id=token["id"]),
            usage_event(user_id=user["id"]),
            usage_event(token_id=other_token["id"]),
            usage_event(user_id=other_user["id"]),
        ],
        key=key["key"],
    )
    assert [(a["status"], a.get("reason")) for a in answers] == [
        ("created", None),
        ("created", None),
        ("rejected", "invalid_event"),
        ("rejected", "invalid_event"),
    ]
    assert api.events(user_id=other_user["id"]) == []


def test_an_ingestion_key_calls_nothing_else_and_is_revocable(api):
    team, _, token = api.principal()
    key = ingest_key(api, team["id"])
    listed = api.ok("GET", f"/v1/teams/{team['id']}/ingest-keys")["data"]
    assert [k["id"] for k in listed] == [key["id"]]
    assert all("key" not in k for k in listed)
    for method, path in (
        ("GET", "/v1/usage"),
        ("GET", f"/v1/teams/{team['id']}/budget"),
        ("POST", "/v1/chat/completions"),
    ):
        response = api.request(method, path, key=key["key"], json={})
        assert response.status_code == 403, (path, response.text)
    api.ok("DELETE", f"/v1/teams/{team['id']}/ingest-keys/{key['id']}", 204)
    response = api.request(
        "POST",
        "/v1/events",
        key=key["key"],
        json={"events": [usage_event(token_id=token["id"])]},
    )
    assert response.status_code == 401
    assert api.ok("GET", f"/v1/teams/{team['id']}/ingest-keys")["data"] == []


@pytest.mark.parametrize(
    ("details", "rule"),
    [
        ({"reasoning_tokens": 301}, "details_above_completion"),
        ({"audio_tokens": 400}, "details_above_completion"),
        ({}, "cached_above_prompt"),
    ],
)
def test_reported_counts_are_checked_against_each_other(api, details, rule):
    _, user, _ = api.principal()
    event = usage_event(user_id=user["id"], completion_tokens_details=details)
    if not details:
        event["cached_tokens"] = 1001
    (answer,) = post(api, [event])
    assert (answer["status"], answer["reason"]) == ("rejected", "invalid_event")
    assert answer["error"].startswith(rule)
    assert api.events(user_id=user["id"]) == []


def test_no_event_takes_a_counter_past_its_ceiling(own_server):
    # 1,000,000 USD per million output tokens: 10^9 tokens are 10^9 USD, past any counter.
    own = own_server(gpt={"output_usd_per_mtok": "1000000"})
    api = own.api
    team, user, token = api.principal()
    big = usage_event(
        token_id=token["id"], prompt_tokens=0, cached_tokens=0, completion_tokens=10**9
    )
    four_million = usage_event(  # 4,000,000 USD
        token_id=token["id"], prompt_tokens=0, cached_tokens=0, completion_tokens=4_000_000
    )
    again = dict(four_million, idempotency_key=four_million["idempotency_key"] + "-2")
    answers = post(api, [big, four_million, again])
    assert [(a["status"], a.get("reason")) for a in answers] == [
        ("rejected", "counter_ceiling"),
        ("created", None),
        ("created", None),
    ]
    # 8,000,000 USD charged: one more 4,000,000 would pass 9,000,000.
    (last,) = post(
        api, [dict(four_million, idempotency_key=four_million["idempotency_key"] + "-3")]
    )
    assert (last["status"], last["reason"]) == ("rejected", "counter_ceiling")
    assert spent(api, "team", team["id"]) == Decimal("8000000")
    report = api.ok("GET", "/v1/spend", params={"group_by": "team", "team_id": team["id"]})
    assert Decimal(report["total"]["cost"]) == Decimal("8000000")


def _failing_trigger(database_url: str, backend: str) -> None:
    """The database refuses to record a key starting `fail-` (as a failing disk or a lost
    connection would refuse a write): a real failure of the batch's transaction."""
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    if backend == "postgresql":
        statements = [
            "CREATE OR REPLACE FUNCTION fail_key() RETURNS trigger AS $$ BEGIN "
            "IF NEW.idempotency_key LIKE 'fail-%' THEN RAISE EXCEPTION 'disk full'; END IF; "
            "RETURN NEW; END $$ LANGUAGE plpgsql",
            "CREATE TRIGGER fail_key BEFORE INSERT ON ingested_keys FOR EACH ROW "
            "EXECUTE FUNCTION fail_key()",
        ]
    else:
        statements = [
            "CREATE TRIGGER fail_key BEFORE INSERT ON ingested_keys "
            "WHEN NEW.idempotency_key LIKE 'fail-%' BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        ]
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def test_an_event_the_database_fails_to_write_answers_retry(own_server):
    own = own_server()
    api = own.api
    _failing_trigger(api.settings.database_url, api.backend)
    _, user, _ = api.principal()
    failing = usage_event(user_id=user["id"], idempotency_key="fail-1")
    answers = post(api, [usage_event(user_id=user["id"]), failing])
    assert [a["status"] for a in answers] == ["created", "retry"]
    assert answers[1]["event_id"] is None and "send it again" in answers[1]["error"]
    assert len(api.events(user_id=user["id"])) == 1
