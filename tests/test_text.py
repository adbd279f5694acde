"""Every text a client sends is valid text: a lone surrogate (JSON's `\\ud800`) anywhere, or a
control character where it means nothing, is a 400 naming the field, on both databases, never
a 500 and never an echo that cannot be encoded (metering.text)."""

import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metering.text import CONTROL, FREE_CONTROL, NOT_UNICODE, first_problem, problem
from tests.billing.test_ingest import usage_event

LONE = "\ud800"


def send(api, method: str, path: str, body: dict, key: str | None = None):
    """The body as JSON text: json.dumps writes a lone surrogate as its escape, as a client's
    JSON library would send it."""
    return api.request(
        method,
        path,
        key=key,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


def assert_names(response, param: str, says: str = NOT_UNICODE) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_request",
        param,
    )
    assert error["message"] == f"{param}: {says}"


@pytest.fixture(scope="module")
def owner(api):
    """A team, user and token of the module's own."""
    return api.principal()


# --- POST /v1/events -------------------------------------------------------------------------


EVENT_FIELDS = ("idempotency_key", "model", "provider", "token_id", "user_id", "team_id")


@pytest.mark.parametrize("field", [*EVENT_FIELDS, "occurred_at"])
def test_a_lone_surrogate_in_an_event_is_400_naming_it(api, owner, field):
    events = [usage_event() for _ in range(4)]
    events[3][field] = "k" + LONE
    response = send(api, "POST", "/v1/events", {"events": events}, key=owner[2]["token"])
    assert_names(response, f"events[3].{field}")


def test_the_reported_lone_surrogate_key_is_400_not_an_echo(api, owner):
    body = {"events": [usage_event(idempotency_key=LONE)]}
    response = send(api, "POST", "/v1/events", body, key=owner[2]["token"])
    assert_names(response, "events[0].idempotency_key")


def test_an_admins_lone_surrogate_token_id_is_400_not_a_driver_error(api):
    response = send(api, "POST", "/v1/events", {"events": [usage_event(token_id=LONE + "x")]})
    assert_names(response, "events[0].token_id")


def test_a_lone_surrogate_in_a_detail_name_is_400(api):
    event = usage_event(completion_tokens_details={LONE: 1})
    response = send(api, "POST", "/v1/events", {"events": [event]})
    assert_names(response, "events[0].completion_tokens_details", f"a field name {NOT_UNICODE}")


def test_a_control_character_in_an_event_id_is_400(api):
    response = send(api, "POST", "/v1/events", {"events": [usage_event(model="gpt-sim\x01")]})
    assert_names(response, "events[0].model", CONTROL)


# --- POST /v1/adjustments and /v1/rerate ------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["amount", "reason", "team_id", "user_id", "token_id", "corrects_event_id", "at"]
)
def test_a_lone_surrogate_in_an_adjustment_is_400_naming_it(api, owner, field):
    body = {"amount": "1", "reason": "outage", "team_id": owner[0]["id"], field: "a" + LONE}
    assert_names(send(api, "POST", "/v1/adjustments", body), field)


@pytest.mark.parametrize("field", ["provider", "model", "start", "end", "reason"])
def test_a_lone_surrogate_in_a_rerate_is_400_naming_it(api, field):
    body = {"provider": "sim-openai", "model": "gpt-sim", "start": "2026-01-01T00:00:00Z"}
    body = {**body, "reason": "price", field: LONE}
    assert_names(send(api, "POST", "/v1/rerate", body), field)


def test_a_reason_is_free_text_with_lines_but_no_other_control(api, owner):
    body = {"amount": "0.01", "team_id": owner[0]["id"]}
    created = send(api, "POST", "/v1/adjustments", {**body, "reason": "outage\r\n\tcredit"})
    assert created.status_code == 201, created.text
    assert created.json()["reason"] == "outage\r\n\tcredit"
    refused = send(api, "POST", "/v1/adjustments", {**body, "reason": "outage\x07"})
    assert_names(refused, "reason", FREE_CONTROL)


# --- teams, users, tokens ---------------------------------------------------------------------


def team_body(**fields) -> dict:
    return {"name": f"t-{uuid.uuid4().hex[:8]}", **fields}


def user_body(team_id: str) -> dict:
    return {"email": f"u{uuid.uuid4().hex[:10]}@example.com", "name": "U", "team_id": team_id}


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("name", LONE, "name"),
        ("reset_interval", LONE, "reset_interval"),
        ("credit_limit", "1" + LONE, "credit_limit"),
        ("soft_limit", LONE, "soft_limit"),
        ("allowed_models", ["gpt-sim", "gpt" + LONE], "allowed_models[1]"),
    ],
)
def test_a_lone_surrogate_in_a_team_is_400_naming_it(api, owner, field, value, param):
    assert_names(send(api, "POST", "/v1/teams", team_body(**{field: value})), param)
    patched = send(api, "PATCH", f"/v1/teams/{owner[0]['id']}", {field: value})
    assert_names(patched, param)


@pytest.mark.parametrize("field", ["email", "name", "team_id", "password"])
def test_a_lone_surrogate_in_a_user_is_400_naming_it(api, owner, field):
    body = {**user_body(owner[0]["id"]), field: "secret-" + LONE}
    assert_names(send(api, "POST", "/v1/users", body), field)
    patched = send(api, "PATCH", f"/v1/users/{owner[1]['id']}", {field: "secret-" + LONE})
    assert_names(patched, field)


@pytest.mark.parametrize("field", ["name", "reset_interval", "expires_at"])
def test_a_lone_surrogate_in_a_token_is_400_naming_it(api, owner, field):
    created = send(api, "POST", f"/v1/users/{owner[1]['id']}/tokens", {field: LONE})
    assert_names(created, field)
    patched = send(api, "PATCH", f"/v1/tokens/{owner[2]['id']}", {field: LONE})
    assert_names(patched, field)


@pytest.mark.parametrize("name", ["Research\x00", "a\x1bb", "tab\there", "del\x7f"])
def test_a_control_character_in_a_name_is_400(api, name):
    assert_names(send(api, "POST", "/v1/teams", team_body(name=name)), "name", CONTROL)
    # Whitespace around a name is trimmed as before, tabs and newlines included.
    trimmed = f"t-{uuid.uuid4().hex[:8]}"
    created = send(api, "POST", "/v1/teams", {"name": f"\t {trimmed}\n"})
    assert created.status_code == 201, created.text
    assert created.json()["name"] == trimmed


def test_a_lone_surrogate_in_a_field_name_is_400(api):
    response = send(api, "POST", "/v1/teams", {**team_body(), LONE: 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (f"a field name {NOT_UNICODE}", None)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prefix=st.text(max_size=20),
    surrogate=st.integers(0xD800, 0xDFFF).map(chr),
    suffix=st.text(max_size=20),
)
def test_any_name_holding_a_lone_surrogate_is_400(api, prefix, surrogate, suffix):
    assert_names(
        send(api, "POST", "/v1/teams", team_body(name=prefix + surrogate + suffix)), "name"
    )


# --- auth and webhooks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/auth/login", {"email": "a" + LONE, "password": "p"}, "email"),
        ("/v1/auth/login", {"email": "a@b.c", "password": LONE}, "password"),
        ("/v1/auth/refresh", {"refresh_token": LONE}, "refresh_token"),
        ("/v1/auth/logout", {"refresh_token": LONE}, "refresh_token"),
    ],
)
def test_a_lone_surrogate_in_a_credential_is_400_naming_it(api, path, body, param):
    assert_names(send(api, "POST", path, body), param)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("url", "https://hooks.example/" + LONE, "url"),
        ("team_id", LONE, "team_id"),
        ("secret", "s" * 16 + LONE, "secret"),
        ("events", ["budget.exhausted", LONE], "events[1]"),
    ],
)
def test_a_lone_surrogate_in_a_webhook_is_400_naming_it(api, field, value, param):
    body = {"url": "https://hooks.example/in", "events": ["budget.exhausted"], field: value}
    assert_names(send(api, "POST", "/v1/webhooks", body), param)


def test_a_nul_in_a_webhooks_team_is_400_naming_it(api):
    body = {"url": "https://hooks.example/in", "events": ["budget.exhausted"], "team_id": "t\x00x"}
    assert_names(send(api, "POST", "/v1/webhooks", body), "team_id", CONTROL)


def test_a_lone_surrogate_in_an_ingestion_keys_name_is_400_naming_it(api):
    team = api.team()
    response = send(api, "POST", f"/v1/teams/{team['id']}/ingest-keys", {"name": "k" + LONE})
    assert_names(response, "name")


# --- query parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/teams", "after"),
        ("/v1/users", "after"),
        ("/v1/users", "team_id"),
        ("/v1/alerts", "subject_id"),
    ],
)
@pytest.mark.parametrize("value", ["a\x00b", "a\x01b"])
def test_a_control_character_in_any_query_parameter_is_400_naming_it(api, path, param, value):
    assert_names(api.request("GET", path, params={param: value}), param, CONTROL)


# --- the proxy's own body ---------------------------------------------------------------------


def chat(**fields) -> dict:
    return {"model": "gpt-sim", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(model="gpt-sim" + LONE), "model"),
        (chat(user=LONE), "user"),
        (chat(messages=[{"role": "user", "content": "hi " + LONE}]), "messages[0].content"),
        (chat(metadata={"run": LONE}), "metadata.run"),
    ],
)
def test_a_lone_surrogate_in_a_chat_body_is_400_naming_it_before_a_hold(api, owner, body, param):
    response = send(api, "POST", "/v1/chat/completions", body, key=owner[2]["token"])
    assert_names(response, param)
    budget = api.ok("GET", f"/v1/tokens/{owner[2]['id']}/budget")
    assert budget["reserved"] == "0"


# --- the checks themselves --------------------------------------------------------------------


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


ANY_CHARACTER = st.characters(codec=None, categories=None)


@given(st.text(alphabet=ANY_CHARACTER, max_size=40))
def test_text_is_taken_exactly_when_it_is_unicode_without_controls(text):
    controls = any(ord(c) < 0x20 or c == "\x7f" for c in text)
    assert (problem(text) is None) == (encodable(text) and not controls)
    free = any((ord(c) < 0x20 and c not in "\t\n\r") or c == "\x7f" for c in text)
    assert (problem(text, free=True) is None) == (encodable(text) and not free)
    assert (problem(text, controls=False) is None) == encodable(text)


@given(
    st.recursive(
        st.text(alphabet=ANY_CHARACTER, max_size=5) | st.integers() | st.none(),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(alphabet=ANY_CHARACTER, max_size=4), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_a_json_value_is_refused_exactly_when_one_of_its_strings_is(value):
    def strings(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            for child in item:
                yield from strings(child)
        elif isinstance(item, dict):
            for key, child in item.items():
                yield key
                yield from strings(child)

    bad = [s for s in strings(value) if problem(s) is not None]
    assert (first_problem(value, "body") is None) == (not bad)


def test_a_problem_is_named_by_its_path():
    value = {"events": [{"ok": "x"}, {"tags": {"a": ["fine", "no\x01"]}}]}
    found = first_problem(value)
    assert (found.where, found.problem) == ("events[1].tags.a[1]", CONTROL)
