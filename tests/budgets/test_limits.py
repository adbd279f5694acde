"""Limits beyond credit on one server, on both backends: settings and their bounds, rate and
parallel limits (429 with OpenAI's headers), token reservations settled to actual usage, model
allow-lists (403 and /v1/models), token lifetimes; every ending gives its counters back."""

import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from metering.clock import MovableClock
from tests.budgets.conftest import chat, chat_body, marker
from tests.conftest import Api


def same_minute(clock: MovableClock) -> None:
    """Move the server's clock to the start of the next UTC minute, so a run's requests share
    one rate window (a minute of real time from there)."""
    clock.move_to(clock.now().replace(second=0, microsecond=0) + timedelta(minutes=1))


def limits(api: Api, scope: str, subject_id: str) -> dict:
    return api.ok("GET", f"/v1/{scope}s/{subject_id}/limits")


def patch(api: Api, scope: str, subject_id: str, **fields) -> dict:
    return api.ok("PATCH", f"/v1/{scope}s/{subject_id}", json=fields)


def test_limits_are_set_at_creation_shown_and_removed(api):
    team = api.ok(
        "POST",
        "/v1/teams",
        201,
        json={
            "name": "limited",
            "rpm_limit": 600,
            "tpm_limit": 100000,
            "allowed_models": ["gpt-*"],
        },
    )
    assert (team["rpm_limit"], team["tpm_limit"], team["max_parallel_requests"]) == (
        600,
        100000,
        None,
    )
    assert team["allowed_models"] == ["gpt-*"]
    shown = limits(api, "team", team["id"])
    assert shown["rpm_limit"] == 600 and shown["allowed_models"] == ["gpt-*"]
    assert (shown["requests"], shown["tokens"], shown["in_flight"]) == (0, 0, 0)
    changed = patch(api, "team", team["id"], rpm_limit=None, max_parallel_requests=4)
    assert (changed["rpm_limit"], changed["tpm_limit"], changed["max_parallel_requests"]) == (
        None,
        100000,
        4,
    )
    assert changed["allowed_models"] == ["gpt-*"]  # not sent: unchanged


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"rpm_limit": "10"}, "rpm_limit"),
        ({"rpm_limit": 10.5}, "rpm_limit"),
        ({"rpm_limit": True}, "rpm_limit"),
        ({"rpm_limit": -1}, "rpm_limit"),
        ({"tpm_limit": 10**13}, "tpm_limit"),
        ({"tpm_limit": 10**40}, "tpm_limit"),
        ({"max_parallel_requests": 10**7}, "max_parallel_requests"),
        ({"allowed_models": "gpt-sim"}, "allowed_models"),
        ({"allowed_models": ["gpt sim"]}, "allowed_models"),
        ({"allowed_models": [""]}, "allowed_models"),
        ({"allowed_models": ["x" * 201]}, "allowed_models"),
        ({"allowed_models": [f"m{i}" for i in range(101)]}, "allowed_models"),
        ({"allowed_models": ["no-such-model"]}, "allowed_models"),
        ({"expires_in": 0}, "expires_in"),
        ({"expires_in": "60"}, "expires_in"),
        ({"expires_in": 60, "expires_at": "2099-01-01T00:00:00Z"}, None),
    ],
)
def test_bad_limit_values_are_400(api, fields, param):
    _, user, _ = api.principal()
    response = api.request("POST", f"/v1/users/{user['id']}/tokens", json=fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    if param is not None:
        assert error["param"] == param, error


def test_rpm_limit_answers_429_naming_the_limit_with_openai_headers(api, clock):
    _, _, token = api.principal()
    patch(api, "token", token["id"], rpm_limit=2)
    key, tag = token["token"], marker()
    same_minute(clock)
    first = chat(api, key, f"{tag} one sim:tokens=2", max_tokens=5)
    second = chat(api, key, f"{tag} two sim:tokens=2", max_tokens=5)
    refused = chat(api, key, f"{tag} three sim:tokens=2", max_tokens=5)
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in first.headers  # no token limit anywhere
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert f"token {token['id']} is over its rpm_limit: 2 requests per minute" in error["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-limit-scope"] == "token"
    # Refused before anything was reserved or forwarded: no event, no hold.
    assert len(api.events(token_id=token["id"])) == 2
    assert limits(api, "token", token["id"])["requests"] == 2
    metrics = api.request("GET", "/metrics").text
    assert 'metering_limit_rejections_total{kind="requests",scope="token"}' in metrics


def test_a_team_limit_binds_every_token_of_the_team(api, clock):
    team, user, token = api.principal()
    other = api.token(user["id"])
    patch(api, "team", team["id"], rpm_limit=1)
    same_minute(clock)
    assert chat(api, token["token"], "team one sim:tokens=1", max_tokens=2).status_code == 200
    refused = chat(api, other["token"], "team two sim:tokens=1", max_tokens=2)
    assert refused.status_code == 429
    assert f"team {team['id']} is over its rpm_limit" in refused.json()["error"]["message"]


def test_tpm_reserves_up_front_and_settles_to_actual_usage(api, clock):
    _, _, token = api.principal()
    key, tag = token["token"], marker()
    body = chat_body(f"{tag} sim:tokens=3", max_tokens=100)
    reserve = len(body) + 64 + 100  # the prompt's upper bound and the output allowance
    # Room for one reservation, not two: only settling to the actual usage admits the next.
    patch(api, "token", token["id"], tpm_limit=reserve + reserve // 2)
    same_minute(clock)
    statuses = [chat(api, key, f"{tag} sim:tokens=3", max_tokens=100) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 200, 200]
    events = api.events(token_id=token["id"])
    actual = sum(e["prompt_tokens"] + e["completion_tokens"] for e in events)
    assert limits(api, "token", token["id"])["tokens"] == actual
    assert statuses[0].headers["x-ratelimit-limit-tokens"] == str(reserve + reserve // 2)
    assert int(statuses[0].headers["x-ratelimit-remaining-tokens"]) == reserve // 2
    too_big = chat(api, key, f"{tag} sim:tokens=3", max_tokens=2 * reserve)
    assert too_big.status_code == 429
    assert "lower max_tokens or the prompt" in too_big.json()["error"]["message"]
    assert "retry-after" not in too_big.headers  # it can never fit: retrying is no use


def test_tpm_lowers_the_output_allowance_when_the_client_sets_none(api, sim):
    _, _, token = api.principal()
    tag = marker()
    patch(api, "token", token["id"], tpm_limit=1000)
    response = chat(api, token["token"], f"{tag} sim:tokens=3")
    assert response.status_code == 200, response.text
    (record,) = [r for r in sim.log() if tag in str(r["received"])]
    body = chat_body(f"{tag} sim:tokens=3")
    assert record["received"]["max_tokens"] == 1000 - (len(body) + 64)


def test_every_ending_gives_the_parallel_slot_back(api):
    _, _, token = api.principal(token_limit="0.001")
    key, tag = token["token"], marker()
    patch(api, "token", token["id"], max_parallel_requests=1)
    assert chat(api, key, f"{tag} ok sim:tokens=2", max_tokens=5).status_code == 200
    assert chat(api, key, f"{tag} big", max_tokens=4000).status_code == 402  # a budget refuses
    failed = chat(api, key, f"{tag} sim:fault=http500 sim:tokens=2", max_tokens=5)
    assert failed.status_code >= 500
    with httpx.stream(
        "POST",
        f"{api.url}/v1/chat/completions",
        content=chat_body(f"{tag} cut sim:tokens=40 sim:chunks=40 sim:delay_ms=50", stream=True),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    ) as stream:
        assert stream.status_code == 200
        next(stream.iter_bytes())  # the client leaves mid-stream
    deadline = time.monotonic() + 10
    while limits(api, "token", token["id"])["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert limits(api, "token", token["id"])["in_flight"] == 0
    assert chat(api, key, f"{tag} after sim:tokens=2", max_tokens=5).status_code == 200


def counted(api: Api, team: dict, token: dict) -> list[tuple[int, int, int]]:
    """(requests, tokens, in flight) counted against the token's and the team's limits."""
    return [
        (shown["requests"], shown["tokens"], shown["in_flight"])
        for shown in (limits(api, "token", token["id"]), limits(api, "team", team["id"]))
    ]


def rated(api: Api, clock: MovableClock, **budget_limits: str) -> tuple[dict, dict, str]:
    """A principal with rate, token and parallel limits on its token and its team, which has
    served one request in the current rate window (so every counter has something in it); its
    team, its token and the test's marker."""
    team, _, token = api.principal(**budget_limits)
    every = {"rpm_limit": 100, "tpm_limit": 100_000, "max_parallel_requests": 4}
    patch(api, "token", token["id"], **every)
    patch(api, "team", team["id"], **every)
    tag = marker()
    same_minute(clock)
    assert chat(api, token["token"], f"{tag} ok sim:tokens=2", max_tokens=5).status_code == 200
    assert counted(api, team, token)[0][0] == 1
    return team, token, tag


def test_a_budget_refusal_gives_the_whole_rate_claim_back(api, clock):
    """Admitted at its limits, then refused by its budget: no hold carries the claim, so its
    request, its tokens and its parallel slot are given back, on every scope that counted it."""
    team, token, tag = rated(api, clock, token_limit="0.001")
    before = counted(api, team, token)
    refused = chat(api, token["token"], f"{tag} big", max_tokens=4000)
    assert refused.status_code == 402, refused.text
    assert refused.json()["error"]["code"] == "budget_exceeded"
    assert counted(api, team, token) == before


def test_an_unknown_run_refusal_gives_the_whole_rate_claim_back(api, clock):
    team, token, tag = rated(api, clock)
    before = counted(api, team, token)
    refused = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        content=chat_body(f"{tag} run sim:tokens=2", max_tokens=5),
        headers={"content-type": "application/json", "x-metering-run": f"never-{tag}"},
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "x-metering-run-budget"
    assert counted(api, team, token) == before


def test_a_failure_while_holding_gives_the_rate_claim_back(api, clock, monkeypatch):
    """Any failure between admission and a committed hold (here the database's, as reserve
    raises it) gives the claim back; the next request is admitted and counted as usual."""
    from metering.proxy import admission

    team, token, tag = rated(api, clock)
    before = counted(api, team, token)

    async def unreachable(*args, **kwargs):
        raise ConnectionError("the database went away")

    with monkeypatch.context() as patched:
        patched.setattr(admission, "reserve", unreachable)
        failed = chat(api, token["token"], f"{tag} fails sim:tokens=2", max_tokens=5)
    assert failed.status_code == 503, failed.text
    assert failed.json()["error"]["code"] == "ledger_unavailable"
    assert counted(api, team, token) == before
    assert chat(api, token["token"], f"{tag} next sim:tokens=2", max_tokens=5).status_code == 200
    assert [c[0] for c in counted(api, team, token)] == [2, 2]


def test_a_model_outside_an_allow_list_is_403_and_not_listed(api):
    team, user, token = api.principal()
    patch(api, "team", team["id"], allowed_models=["gpt-*", "minimax-*"])
    patch(api, "user", user["id"], allowed_models=["*-sim"])
    key = token["token"]
    refused = chat(api, key, "allow sim:tokens=1", model="minimax-m2.1", max_tokens=2)
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["code"] == "model_not_allowed"
    assert f"user {user['id']}" in error["message"] and "*-sim" in error["message"]
    assert chat(api, key, "allow sim:tokens=1", max_tokens=2).status_code == 200
    models = api.ok("GET", "/v1/models", key=key)
    assert [m["id"] for m in models["data"]] == ["gpt-sim"]
    assert [m["id"] for m in api.ok("GET", "/v1/models")["data"]] == ["gpt-sim", "minimax-m2.1"]
    metrics = api.request("GET", "/metrics").text
    assert 'metering_limit_rejections_total{kind="model",scope="user"}' in metrics


def test_a_token_list_only_narrows_its_users_and_teams(api):
    team, user, token = api.principal()
    patch(api, "team", team["id"], allowed_models=["gpt-*"])
    widened = api.request(
        "PATCH", f"/v1/tokens/{token['id']}", json={"allowed_models": ["minimax-m2.1"]}
    )
    assert widened.status_code == 400
    assert f"not allowed for team {team['id']}" in widened.json()["error"]["message"]
    # A pattern is intersected with the team's list when checked: it cannot widen it.
    patch(api, "token", token["id"], allowed_models=["*"])
    refused = chat(api, token["token"], "narrow sim:tokens=1", model="minimax-m2.1", max_tokens=2)
    assert refused.status_code == 403
    assert f"team {team['id']}" in refused.json()["error"]["message"]


def test_token_lifetimes_expires_in_and_patch(api, clock):
    _, user, _ = api.principal()
    created = api.ok("POST", f"/v1/users/{user['id']}/tokens", 201, json={"expires_in": 3600})
    expires = datetime.fromisoformat(created["expires_at"].replace("Z", "+00:00"))
    assert 3590 <= (expires - datetime.now(UTC)).total_seconds() <= 3600
    assert chat(api, created["token"], "life sim:tokens=1", max_tokens=2).status_code == 200
    shortened = patch(api, "token", created["id"], expires_in=1)
    expires_at = datetime.fromisoformat(shortened["expires_at"].replace("Z", "+00:00"))
    clock.move_to(expires_at)
    refused = chat(api, created["token"], "life sim:tokens=1", max_tokens=2)
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert error["message"] == f"this API token expired at {shortened['expires_at']}"
    extended = patch(api, "token", created["id"], expires_at=None)
    assert extended["expires_at"] is None
    assert chat(api, created["token"], "life sim:tokens=1", max_tokens=2).status_code == 200


def test_an_empty_allow_list_allows_no_model(api):
    _, _, token = api.principal()
    patch(api, "token", token["id"], allowed_models=[])
    refused = chat(api, token["token"], "none sim:tokens=1", max_tokens=2)
    assert refused.status_code == 403
    assert refused.json()["error"]["message"].endswith("its allowed_models are (none)")
    assert api.ok("GET", "/v1/models", key=token["token"])["data"] == []


def test_a_users_own_credential_may_tighten_its_tokens_limits_only(api):
    _, user, token = api.principal()
    patch(api, "token", token["id"], rpm_limit=10, allowed_models=["gpt-*"])
    own = token["token"]

    def by_user(**fields) -> httpx.Response:
        return api.request("PATCH", f"/v1/tokens/{token['id']}", key=own, json=fields)

    assert by_user(rpm_limit=5).status_code == 200
    assert by_user(allowed_models=["gpt-sim"]).status_code == 200
    for loosened in ({"rpm_limit": 6}, {"rpm_limit": None}, {"allowed_models": ["*"]}):
        refused = by_user(**loosened)
        assert refused.status_code == 403, loosened
        assert "only the admin key" in refused.json()["error"]["message"]
    assert by_user(tpm_limit=1000).status_code == 200  # a new limit where there was none
    shown = limits(api, "token", token["id"])
    assert (shown["rpm_limit"], shown["tpm_limit"], shown["allowed_models"]) == (
        5,
        1000,
        ["gpt-sim"],
    )


def test_a_users_own_credential_may_lower_its_tokens_credit_limit_only(api):
    """The credit limit and its window are tightened like the rate limits: a user's own
    credential lowers the limit or sets one, never raises or removes it, never changes the
    reset interval (a shorter window would reset it sooner); the admin key may."""
    _, _, token = api.principal()
    own = token["token"]

    def by_user(**fields) -> httpx.Response:
        return api.request("PATCH", f"/v1/tokens/{token['id']}", key=own, json=fields)

    assert by_user(credit_limit="2").status_code == 200  # a limit where there was none
    assert by_user(credit_limit="1.5").status_code == 200
    for loosened in ({"credit_limit": "1.6"}, {"credit_limit": None}, {"reset_interval": "1h"}):
        refused = by_user(**loosened)
        assert refused.status_code == 403, loosened
        error = refused.json()["error"]
        assert "only the admin key" in error["message"] and error["param"] in loosened
    assert by_user(reset_interval="never").status_code == 200  # unchanged: allowed
    budget = api.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert (budget["credit_limit"], budget["reset_interval"]) == ("1.5", "never")
    admin = api.request("PATCH", f"/v1/tokens/{token['id']}", json={"credit_limit": "9"})
    assert admin.status_code == 200
