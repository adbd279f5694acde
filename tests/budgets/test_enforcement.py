"""Enforcement through the proxy: 402s, clamping, scopes, windows, and holds that never linger."""

import json
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from metering.models import BudgetWindow
from metering.money import format_usd
from metering.proxy.estimate import prompt_tokens_upper_bound
from metering.timefmt import parse_rfc3339
from tests.budgets.conftest import (
    budget,
    chat,
    chat_body,
    holds_of,
    marker,
    pico,
    query,
    sim_records,
    usd,
    wait_for,
)

MINIMAX = "minimax-m2.1"  # 0.30 / 1.20 USD per 1M tokens, max_output_tokens 16384
MINIMAX_IN, MINIMAX_OUT = 300_000, 1_200_000  # picodollars per token
GPT_IN, GPT_OUT = 150_000, 600_000


def _bound(body: bytes) -> int:
    return prompt_tokens_upper_bound(len(body), json.loads(body))


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code", "param"}
    return error


# --- 402 --------------------------------------------------------------------------------------


def test_explicit_max_tokens_unaffordable_is_402(api, sim):
    team, user, token = api.principal(token_limit="0.001", interval="daily")
    key = token["token"]
    first = chat(api, key, f"warm {marker()} sim:tokens=10", model=MINIMAX, max_tokens=10)
    assert first.status_code == 200, first.text
    status = budget(api, "token", token["id"])

    tag = marker()
    response = chat(api, key, f"too big {tag}", model=MINIMAX, max_tokens=1000)
    assert response.status_code == 402, response.text
    error = _error(response)
    assert error["code"] == "budget_exceeded"
    assert response.headers["x-budget-scope"] == "token"
    assert response.headers["x-budget-resets-at"] == status["resets_at"]
    message = error["message"]
    for part in (
        "token",
        token["id"],
        "limit 0.001 USD",
        f"spent {status['spent']}",
        "reserved 0",
        f"resets at {status['resets_at']}",
    ):
        assert part in message, (part, message)
    assert sim_records(sim, tag) == []  # never forwarded
    assert len(api.events(token_id=token["id"])) == 1
    assert budget(api, "token", token["id"]) == status  # nothing held, nothing spent

    # A budget that never resets: no x-budget-resets-at, and the message says so.
    team, user, token = api.principal(token_limit="0.001")
    response = chat(api, token["token"], f"too big {tag}", model=MINIMAX, max_tokens=1000)
    assert response.status_code == 402
    assert "x-budget-resets-at" not in response.headers
    assert "never resets" in _error(response)["message"]


def test_hold_boundary_is_exact(api, sim):
    """A limit of exactly the hold is enough; one picodollar less is not."""
    body = chat_body(f"boundary {marker()} sim:tokens=3", model=MINIMAX, max_tokens=50)
    hold = _bound(body) * MINIMAX_IN + 50 * MINIMAX_OUT
    for limit, expected in ((hold - 1, 402), (hold, 200)):
        team, user, token = api.principal(token_limit=format_usd(limit))
        response = api.request(
            "POST",
            "/v1/chat/completions",
            key=token["token"],
            content=body,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == expected, response.text
        assert "x-max-tokens-clamped" not in response.headers


@pytest.mark.parametrize("scope", ["token", "user", "team"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_clamps_max_tokens_to_remaining_credit(api, sim, scope, stream):
    limits = {"token_limit": None, "user_limit": None, "team_limit": None}
    limits[f"{scope}_limit"] = "0.01"  # 16384 output tokens would cost 0.0196608
    team, user, token = api.principal(**limits)
    subject = {"token": token["id"], "user": user["id"], "team": team["id"]}[scope]
    key = token["token"]
    warm = chat(api, key, f"warm {marker()} sim:tokens=9", model=MINIMAX, max_tokens=9)
    assert warm.status_code == 200 and "x-max-tokens-clamped" not in warm.headers
    remaining = pico(budget(api, scope, subject)["remaining"])
    assert remaining < pico("0.01")

    tag = marker()
    fields = {"stream": True} if stream else {}
    body = chat_body(f"clamp {tag} sim:tokens=5", model=MINIMAX, **fields)
    expected = (remaining - _bound(body) * MINIMAX_IN) // MINIMAX_OUT
    assert 1 <= expected < 16384
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=key,
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-max-tokens-clamped"] == str(expected)
    [record] = sim_records(sim, tag)
    assert record["received"]["max_tokens"] == expected
    status = budget(api, scope, subject)
    assert usd(status["reserved"]) == 0
    [event, _] = api.events(token_id=token["id"])
    assert usd(status["spent"]) == usd(event["cost"]) + usd(_["cost"])


def test_not_even_one_token_is_402(api, sim):
    body = chat_body(f"tiny {marker()}", model=MINIMAX)
    # Enough for the prompt's bound and not one output token.
    limit = _bound(body) * MINIMAX_IN + MINIMAX_OUT - 1
    team, user, token = api.principal(team_limit=format_usd(limit))
    tag = marker()
    response = chat(api, token["token"], f"tiny {tag}", model=MINIMAX)
    assert response.status_code == 402, response.text
    assert _error(response)["code"] == "budget_exceeded"
    assert response.headers["x-budget-scope"] == "team"
    assert sim_records(sim, tag) == []
    # One picodollar more and exactly one token fits.
    api.ok("PATCH", f"/v1/teams/{team['id']}", json={"credit_limit": format_usd(limit + 1)})
    response = chat(api, token["token"], f"tiny {tag}", model=MINIMAX)
    assert response.status_code == 200, response.text
    assert response.headers["x-max-tokens-clamped"] == "1"
    [record] = sim_records(sim, tag)
    assert record["received"]["max_tokens"] == 1


@pytest.mark.parametrize("scope", ["user", "team"])
def test_limit_at_user_and_team_scope(api, scope):
    team, user, token = api.principal(**{f"{scope}_limit": "0.001"}, interval="weekly")
    response = chat(api, token["token"], f"scoped {marker()}", model=MINIMAX, max_tokens=1000)
    assert response.status_code == 402, response.text
    assert response.headers["x-budget-scope"] == scope
    subject = user["id"] if scope == "user" else team["id"]
    status = budget(api, scope, subject)
    assert response.headers["x-budget-resets-at"] == status["resets_at"]
    assert f"{scope} budget {subject}" in _error(response)["message"]
    ok = chat(api, token["token"], f"scoped {marker()}", model=MINIMAX, max_tokens=100)
    assert ok.status_code == 200


# --- identity changes take effect at once --------------------------------------------------


def test_deleting_user_or_team_and_lowering_limits(api):
    for kind in ("user", "team", "token"):
        team, user, token = api.principal()
        key = token["token"]
        assert chat(api, key, f"live {marker()}", max_tokens=5).status_code == 200
        path = {
            "user": f"/v1/users/{user['id']}",
            "team": f"/v1/teams/{team['id']}",
            "token": f"/v1/tokens/{token['id']}",
        }[kind]
        api.ok("DELETE", path, 204)
        response = chat(api, key, f"gone {marker()}", max_tokens=5)
        assert response.status_code == 401, (kind, response.text)
        assert _error(response)["code"] == "invalid_api_key"

    team, user, token = api.principal(team_limit="5")
    key = token["token"]
    assert chat(api, key, f"live {marker()}", max_tokens=5).status_code == 200
    api.ok("PATCH", f"/v1/teams/{team['id']}", json={"credit_limit": "0"})
    response = chat(api, key, f"limited {marker()}", max_tokens=5)
    assert response.status_code == 402
    assert response.headers["x-budget-scope"] == "team"
    response = chat(api, key, f"limited {marker()}")  # no max_tokens: nothing to clamp to
    assert response.status_code == 402


# --- windows roll without a job ------------------------------------------------------------


def test_fixed_window_rolls_over(api, clock):
    # One request (hold about 0.000065, cost about 0.000041) fits in 0.0001; a second does not.
    team, user, token = api.principal(token_limit="0.0001", interval="60s")
    key = token["token"]
    first_window = budget(api, "token", token["id"])
    content = f"window {marker()} sim:tokens=64"
    first = chat(api, key, content, max_tokens=64)
    assert first.status_code == 200, first.text
    refused = chat(api, key, content, max_tokens=64)
    assert refused.status_code == 402, refused.text
    assert refused.headers["x-budget-resets-at"] == first_window["resets_at"]
    status = budget(api, "token", token["id"])
    assert status["window_start"] == first_window["window_start"], "test too slow for a 60s window"
    [event] = api.events(token_id=token["id"])
    assert usd(status["spent"]) == usd(event["cost"])

    resets_at = parse_rfc3339(first_window["resets_at"])
    clock.move_to(resets_at)
    # No job has run (the sweeper closes windows every 60 s): the request itself rolls it.
    second = chat(api, key, content, max_tokens=64)
    assert second.status_code == 200, second.text

    events = api.events(token_id=token["id"])
    assert [e["id"] for e in events] == [second.headers["x-request-id"], event["id"]]
    status = budget(api, "token", token["id"])
    assert parse_rfc3339(status["window_start"]) >= resets_at
    assert usd(status["spent"]) == usd(events[0]["cost"])
    assert usd(status["reserved"]) == 0

    windows = BudgetWindow.__table__
    rows = query(
        api.settings.database_url,
        select(
            windows.c.window_start, windows.c.window_end, windows.c.spent, windows.c.credit_limit
        ).where(windows.c.subject_id == token["id"]),
    )
    assert len(rows) == 1
    start, end, spent, limit = rows[0]
    assert start == parse_rfc3339(first_window["window_start"])
    assert end == resets_at
    assert spent == pico(event["cost"])
    assert limit == pico("0.0001")


# --- every way a request can end releases or settles its hold ------------------------------


def _read_first_event_then_leave(api, key: str, body: bytes) -> httpx.Response:
    with api.http.stream(
        "POST",
        "/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    ) as response:
        for chunk in response.iter_raw():
            if b"data:" in chunk:
                break
        return response  # leaving the block closes the connection mid-stream


SCENARIOS = {
    # name: (stream, directives, client reads all?, expected status, event status)
    "stream": (True, "sim:tokens=20 sim:chunks=4", True, 200, "ok"),
    "client_disconnect": (True, "sim:tokens=40 sim:chunks=20 sim:delay_ms=100", False, 200, None),
    "http500": (False, "sim:fault=http500", True, 502, "upstream_error"),
    "stream_http500": (True, "sim:fault=http500", True, 502, "upstream_error"),
    "disconnect": (False, "sim:fault=disconnect", True, 502, None),
    "stream_disconnect": (True, "sim:fault=disconnect sim:chunks=6", True, 200, None),
    "timeout": (True, "sim:fault=timeout", True, 504, "timeout"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_ending_settles_or_releases(api, sim, scenario):
    stream, directives, reads_all, expected, event_status = SCENARIOS[scenario]
    team, user, token = api.principal(token_limit="1", user_limit="1", team_limit="1")
    key, tag = token["token"], marker()
    fields = {"stream": True} if stream else {}
    body = chat_body(f"{scenario} {tag} {directives}", **fields)
    if reads_all:
        response = api.request(
            "POST",
            "/v1/chat/completions",
            key=key,
            content=body,
            headers={"content-type": "application/json"},
        )
    else:
        response = _read_first_event_then_leave(api, key, body)
    assert response.status_code == expected, response.text if reads_all else ""
    if scenario == "stream_disconnect":
        assert b'"upstream_error"' in response.content  # the client is told the stream broke

    [record] = sim_records(sim, tag)  # it did reach the upstream
    events = wait_for(lambda: api.events(token_id=token["id"]), message="the ledger event")
    assert len(events) == 1
    [event] = events
    assert event["id"] == response.headers["x-request-id"]
    if event_status is not None:
        assert event["status"] == event_status
    if scenario == "client_disconnect":
        assert event["status"] == "client_disconnected"
    wait_for(lambda: not holds_of(api.settings.database_url, token["id"]), message="holds gone")
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(api, scope, subject)
        assert usd(status["reserved"]) == 0, (scope, status)
        assert usd(status["spent"]) == usd(event["cost"]), (scope, status)
        assert usd(status["remaining"]) == Decimal(1) - usd(event["cost"])
    if event["status"] in ("upstream_error", "timeout"):
        assert usd(event["cost"]) == 0  # the upstream refused it: nothing billed


def test_body_that_cannot_be_forwarded_releases_its_hold(api, sim):
    """Valid JSON that is not valid Unicode (a lone surrogate escape) is refused, and the hold
    taken before the upstream body was built is given back, not left to expire as a charge."""
    team, user, token = api.principal(token_limit="1")
    tag = marker()
    body = (
        b'{"model":"gpt-sim","max_tokens":5,"messages":[{"role":"user","content":"'
        + tag.encode()
        + b' \\ud800"}]}'
    )
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert _error(response)["code"] == "invalid_request"
    assert sim_records(sim, tag) == []
    assert holds_of(api.settings.database_url, token["id"]) == []
    status = budget(api, "token", token["id"])
    assert (usd(status["spent"]), usd(status["reserved"])) == (0, 0)
    assert api.events(token_id=token["id"]) == []


def test_clamp_counts_every_choice(api, sim):
    """With n choices the output allowance is paid n times over."""
    team, user, token = api.principal(token_limit="0.01")
    tag = marker()
    body = chat_body(f"choices {tag} sim:tokens=3", model=MINIMAX, n=3)
    expected = (pico("0.01") - _bound(body) * MINIMAX_IN) // (3 * MINIMAX_OUT)
    response = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-max-tokens-clamped"] == str(expected)
    [record] = sim_records(sim, tag)
    assert record["received"]["max_tokens"] == expected
