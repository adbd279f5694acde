"""Bad requests are refused with an exact OpenAI-shaped error, before they can cost anything."""

import json
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

OK_MESSAGES = [{"role": "user", "content": "hi sim:tokens=2"}]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def secret(principal):
    return principal[2]["token"]


def post(api, content: bytes | str, key: str | None, **headers) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    headers.setdefault("content-type", "application/json")
    return httpx.post(
        f"{api.url}/v1/chat/completions", content=content, headers=headers, timeout=30
    )


def assert_refused(api, principal, response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == code
    assert error["param"] is None or isinstance(error["param"], str)
    assert response.headers["x-request-id"].startswith("req_")
    assert api.events(token_id=principal[2]["id"]) == []
    return error


# --- bodies that are not a JSON object -------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{"model": "gpt-sim",', id="truncated"),
        pytest.param(b"", id="empty"),
        pytest.param(b"   ", id="blank"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'"gpt-sim"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(
            b'{"model": "gpt-sim", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": NaN}',
            id="nan-literal",
        ),
        pytest.param(
            b'{"model": "gpt-sim", "messages": [{"role": "user", "content": "x"}], '
            b'"temperature": Infinity}',
            id="infinity-literal",
        ),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-100k-arrays"),
        pytest.param(b"[" * 100_000, id="unclosed-100k-arrays"),
        pytest.param(
            b'{"model": "gpt-sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            id="nested-100k-in-object",
        ),
        pytest.param(
            b'{"model": "gpt-sim", "messages": [{"role": "user", "content": "caf\xe9"}]}',
            id="latin-1",
        ),
        pytest.param(
            json.dumps({"model": "gpt-sim", "messages": OK_MESSAGES}).encode("utf-16"),
            id="utf-16",
        ),
        pytest.param(b'{"model": "gpt-sim", "messages": [\xff\xfe]}', id="invalid-utf-8"),
    ],
)
def test_body_that_is_not_a_json_object_is_400(api, principal, secret, content):
    assert_refused(api, principal, post(api, content, secret), 400, "invalid_request")


# --- ill-typed or out-of-range fields --------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        pytest.param({"model": 5}, "model", id="model-int"),
        pytest.param({"model": ""}, "model", id="model-empty"),
        pytest.param({"model": None}, "model", id="model-null"),
        pytest.param({"messages": "hi"}, "messages", id="messages-string"),
        pytest.param({"messages": []}, "messages", id="messages-empty"),
        pytest.param({"messages": None}, "messages", id="messages-null"),
        pytest.param({"messages": ["hi"]}, "messages.0", id="message-string"),
        pytest.param(
            {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", id="role-robot"
        ),
        pytest.param({"messages": [{"content": "x"}]}, "messages.0.role", id="role-missing"),
        pytest.param(
            {"messages": [{"role": ["user"], "content": "x"}]}, "messages.0.role", id="role-list"
        ),
        pytest.param(
            {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages.0.role", id="role-object"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", id="content-int"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages.0.content.0",
            id="content-part-without-type",
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x", "name": 1}]},
            "messages.0.name",
            id="name-int",
        ),
        pytest.param({"stream": "yes"}, "stream", id="stream-string"),
        pytest.param({"stream": 1}, "stream", id="stream-int"),
        pytest.param({"stream_options": True}, "stream_options", id="stream-options-bool"),
        pytest.param(
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options",
            id="include-usage-string",
        ),
        pytest.param({"max_tokens": -1}, "max_tokens", id="max-tokens-negative"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="max-tokens-zero"),
        pytest.param({"max_tokens": 1.5}, "max_tokens", id="max-tokens-float"),
        pytest.param({"max_tokens": True}, "max_tokens", id="max-tokens-true"),
        pytest.param({"max_tokens": "10"}, "max_tokens", id="max-tokens-string"),
        pytest.param({"max_tokens": 4097}, "max_tokens", id="max-tokens-above-model-max"),
        pytest.param(
            {"max_completion_tokens": -5}, "max_completion_tokens", id="max-completion-negative"
        ),
        pytest.param({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", id="both-maxima"),
        pytest.param({"n": 0}, "n", id="n-zero"),
        pytest.param({"n": 17}, "n", id="n-too-many"),
        pytest.param({"temperature": 9}, "temperature", id="temperature-9"),
        pytest.param({"temperature": -0.1}, "temperature", id="temperature-negative"),
        pytest.param({"temperature": "hot"}, "temperature", id="temperature-string"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-1"),
        pytest.param({"presence_penalty": 3}, "presence_penalty", id="presence-penalty-3"),
        pytest.param(
            {"frequency_penalty": -3}, "frequency_penalty", id="frequency-penalty-minus-3"
        ),
    ],
)
def test_ill_typed_or_out_of_range_field_is_400_naming_it(api, principal, secret, change, param):
    body = {"model": "gpt-sim", "messages": OK_MESSAGES, **change}
    error = assert_refused(
        api, principal, post(api, json.dumps(body), secret), 400, "invalid_request"
    )
    assert error["param"] == param


def test_missing_model_and_messages_is_400(api, principal, secret):
    error = assert_refused(api, principal, post(api, b"{}", secret), 400, "invalid_request")
    assert error["param"] == "model"


def test_unknown_model_is_404_model_not_found(api, principal, secret):
    body = json.dumps({"model": "gpt-nope", "messages": OK_MESSAGES})
    error = assert_refused(api, principal, post(api, body, secret), 404, "model_not_found")
    assert error["param"] == "model"
    assert "gpt-nope" in error["message"]


def test_upstream_model_name_is_not_a_model_here(api, principal, secret):
    body = json.dumps({"model": "sim/gpt", "messages": OK_MESSAGES})
    assert_refused(api, principal, post(api, body, secret), 404, "model_not_found")


# --- credentials -----------------------------------------------------------------------------

VALID = json.dumps({"model": "gpt-sim", "messages": OK_MESSAGES})


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="missing"),
        pytest.param({"authorization": "Bearer"}, id="bearer-without-token"),
        pytest.param({"authorization": "Basic dXNlcjpwYXNz"}, id="basic"),
        pytest.param({"authorization": "Bearer mtr_" + "A" * 43}, id="unknown-mtr"),
        pytest.param({"authorization": "Bearer garbage"}, id="garbage"),
        pytest.param({"authorization": "Bearer sk-proj-123"}, id="openai-key"),
        pytest.param({"authorization": "Bearer mtr_\u00e9"}, id="non-ascii"),
    ],
)
def test_missing_or_unknown_credential_is_401(api, principal, headers):
    headers = {k: v.encode() for k, v in headers.items()}
    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        content=VALID,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )
    assert_refused(api, principal, response, 401, "invalid_api_key")


def test_revoked_token_is_401(api):
    team, user, token = api.principal()
    assert api.request("DELETE", f"/v1/tokens/{token['id']}").status_code == 204
    assert_refused(
        api, (team, user, token), post(api, VALID, token["token"]), 401, "invalid_api_key"
    )


def test_admin_key_cannot_call_models(api, principal):
    response = post(api, VALID, api.settings.admin_key)
    assert_refused(api, principal, response, 403, "forbidden")


def test_credential_is_checked_before_the_body(api, principal):
    assert_refused(api, principal, post(api, b"{", "garbage"), 401, "invalid_api_key")


# --- size ------------------------------------------------------------------------------------


def _big_body(size: int) -> bytes:
    filler = "x" * size
    return json.dumps(
        {"model": "gpt-sim", "messages": [{"role": "user", "content": filler}]}
    ).encode()


def test_body_over_the_limit_is_413(api, principal, secret):
    body = _big_body(5 * MIB)
    assert len(body) > api.settings.max_body_bytes
    assert_refused(api, principal, post(api, body, secret), 413, "request_too_large")


def test_chunked_body_over_the_limit_is_413(api, principal, secret):
    body = _big_body(5 * MIB)

    def chunks():
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    response = httpx.post(
        f"{api.url}/v1/chat/completions",
        content=chunks(),
        headers={"authorization": f"Bearer {secret}", "content-type": "application/json"},
        timeout=30,
    )
    assert "content-length" not in response.request.headers
    assert_refused(api, principal, response, 413, "request_too_large")


# --- identity bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "credit_limit",
    [
        pytest.param(1.5, id="float"),
        pytest.param("abc", id="not-a-number"),
        pytest.param("-1", id="negative"),
        pytest.param(-1, id="negative-int"),
        pytest.param("NaN", id="nan"),
        pytest.param("Infinity", id="infinity"),
        pytest.param("", id="empty"),
        pytest.param(True, id="bool"),
        pytest.param([], id="list"),
        pytest.param("0.0000000000001", id="13-decimals"),
        pytest.param("1e400", id="exponent-too-large"),
        pytest.param("1000001", id="above-max"),
        # Not the form /openapi.json declares (money.USD_PATTERN): refused, not read.
        pytest.param(7, id="int"),
        pytest.param(" 2.50 ", id="spaces"),
        pytest.param("1e3", id="exponent"),
        pytest.param("2.5E-1", id="exponent-negative"),
        pytest.param("007", id="leading-zeros"),
        pytest.param("+5", id="sign"),
    ],
)
def test_invalid_credit_limit_is_400(api, credit_limit):
    response = api.request(
        "POST",
        "/v1/teams",
        json={"name": "t", "credit_limit": credit_limit, "reset_interval": "never"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "credit_limit"


@pytest.mark.parametrize(
    ("credit_limit", "stored"),
    [
        ("10", "10"),
        ("0.000000000001", "0.000000000001"),
        ("2.50", "2.5"),
        ("0", "0"),
        ("1000000.000", "1000000"),
    ],
)
def test_credit_limit_as_a_plain_decimal_string_is_accepted_at_its_value(api, credit_limit, stored):
    name = f"t-{uuid.uuid4().hex[:8]}"
    team = api.ok("POST", "/v1/teams", 201, json={"name": name, "credit_limit": credit_limit})
    assert team["credit_limit"] == stored
    assert api.ok("GET", f"/v1/teams/{team['id']}")["credit_limit"] == stored


@pytest.mark.parametrize(
    "interval",
    ["fortnightly", "", "0s", "-1h", "1w", "1.5h", "01h", "HOURLY", " daily", "3651d", 5, None, []],
)
def test_invalid_reset_interval_is_400(api, interval):
    response = api.request(
        "POST", "/v1/teams", json={"name": "t", "credit_limit": "1", "reset_interval": interval}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "reset_interval"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"name": "t", "unknown": 1}, id="unknown-field"),
        pytest.param({"name": ""}, id="empty-name"),
        pytest.param({"name": 5}, id="name-int"),
        pytest.param({}, id="no-name"),
        pytest.param([], id="array"),
    ],
)
def test_invalid_team_body_is_400(api, body):
    response = api.request("POST", "/v1/teams", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"


def test_team_body_that_is_not_json_is_400(api):
    response = api.request(
        "POST", "/v1/teams", content=b"{", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"


# --- fuzzing ---------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "robot"]) | JSON,
        "content": st.text(max_size=30) | JSON,
        "name": st.text(max_size=5) | JSON,
    },
)
NEAR_VALID = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["gpt-sim", "minimax-m2.1", "nope"]) | JSON,
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "stream": st.booleans() | JSON,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON}) | JSON,
        "max_tokens": st.integers(min_value=-2, max_value=20) | JSON,
        "max_completion_tokens": JSON,
        "n": JSON,
        "temperature": JSON,
        "top_p": JSON,
    },
)


@pytest.fixture(scope="module")
def fuzz_secret(api):
    """Fuzzed bodies may be valid and reach the upstream: they get their own token."""
    return api.principal()[2]["token"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=NEAR_VALID | JSON)
def test_random_json_never_makes_a_server_error(api, fuzz_secret, body):
    text = json.dumps(body, allow_nan=True)
    response = post(api, text.encode(), fuzz_secret)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "code", "param"}


# --- text a database cannot store ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/teams", {"name": "a\x00b"}, id="team-name"),
        pytest.param(
            "/v1/users", {"email": "a@b.c", "name": "x\x00", "team_id": "t"}, id="user-name"
        ),
    ],
)
def test_nul_character_in_identity_text_is_400_on_every_backend(api, path, body):
    response = api.request("POST", path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "name")


def test_nul_character_in_a_token_name_is_400(api, principal):
    user_id = principal[1]["id"]
    response = api.request("POST", f"/v1/users/{user_id}/tokens", json={"name": "\x00"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "name"


@pytest.mark.parametrize("path", ["/v1/users/a%00b", "/v1/tokens/a%00b", "/v1/teams/a%00b"])
def test_nul_character_in_a_path_is_never_a_server_error(api, path):
    response = api.request("GET", path)
    assert response.status_code in (400, 404), response.text
    assert set(response.json()["error"]) == {"message", "type", "code", "param"}


# --- a bug is still an OpenAI-shaped answer --------------------------------------------------


def test_unexpected_error_is_an_openai_shaped_500_with_x_request_id(api, sim):
    from fastapi.testclient import TestClient

    from metering.app import create_app
    from metering.settings import parse_catalog
    from tests.conftest import catalog_for

    app = create_app(api.settings, parse_catalog(catalog_for(sim), environ={}), run_jobs=False)

    @app.get("/_boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/_boom")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert set(response.json()["error"]) == {"message", "type", "code", "param"}
    assert response.headers["x-request-id"].startswith("req_")


# --- numbers without bounds ------------------------------------------------------------------

HUGE_INT = "9" * 4000  # as many digits as Python's int() reads by default, near enough


@pytest.mark.parametrize("key", ["max_input_usd_per_mtok", "max_output_usd_per_mtok"])
@pytest.mark.parametrize(
    ("cap", "says"),
    [
        # A short text whose integral value has 500,001 digits: seconds of CPU to convert.
        pytest.param('"1e500000"', "an exponent of at most 4 digits", id="exponent-500000"),
        pytest.param('"1e99999999"', "an exponent of at most 4 digits", id="exponent-99999999"),
        pytest.param('"1e9999"', "must be at most 1000000", id="exponent-9999"),
        pytest.param('"0.' + "0" * 70 + '1"', "longer than 64 characters", id="70-decimals"),
        pytest.param('"\u00b2"', "must be a decimal number", id="superscript-two"),
        pytest.param('"\u0663"', "must be a decimal number", id="arabic-indic-three"),
        pytest.param(HUGE_INT, "must be at most 1000000", id="4000-digit-integer"),
        pytest.param("1e308", "must be at most 1000000", id="float-1e308"),
        pytest.param('"1000000.000001"', "must be at most 1000000", id="just-above-max"),
    ],
)
def test_an_unbounded_price_cap_is_a_fast_400_naming_it(api, principal, secret, key, cap, says):
    text = f'{{"model": "gpt-sim", "messages": {json.dumps(OK_MESSAGES)}, "{key}": {cap}}}'
    error = assert_refused(api, principal, post(api, text, secret), 400, "invalid_request")
    assert error["param"] == key
    assert says in error["message"], error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", HUGE_INT),
        ("max_completion_tokens", HUGE_INT),
        ("n", HUGE_INT),
        ("max_tokens", "-" + HUGE_INT),
        ("temperature", "1e400"),  # JSON's float reads it as infinity
        ("top_p", "-1e400"),
        ("presence_penalty", HUGE_INT),
        ("frequency_penalty", "1" + "0" * 400 + ".5"),
    ],
)
def test_a_huge_number_in_a_chat_field_is_400_naming_it(api, principal, secret, field, value):
    text = f'{{"model": "gpt-sim", "messages": {json.dumps(OK_MESSAGES)}, "{field}": {value}}}'
    error = assert_refused(api, principal, post(api, text, secret), 400, "invalid_request")
    assert error["param"] == field


def test_an_integer_beyond_what_json_reads_is_400(api, principal, secret):
    text = f'{{"model": "gpt-sim", "messages": {json.dumps(OK_MESSAGES)}, "n": {"9" * 5000}}}'
    error = assert_refused(api, principal, post(api, text, secret), 400, "invalid_request")
    assert error["message"] == "request body is not valid JSON"


@pytest.mark.parametrize(
    "credit_limit",
    [
        pytest.param("1e99999999", id="exponent-99999999"),
        pytest.param("1e500000", id="exponent-500000"),
        pytest.param("1e-99999999", id="negative-exponent-99999999"),
        pytest.param("0." + "0" * 70 + "1", id="70-decimals"),
        pytest.param("1" * 65, id="65-digits"),
        pytest.param("\u00b2", id="superscript-two"),
        pytest.param(int(HUGE_INT), id="4000-digit-integer"),
    ],
)
def test_an_unbounded_credit_limit_is_400_naming_it(api, credit_limit):
    for path in ("/v1/teams",):
        response = api.request("POST", path, json={"name": "t", "credit_limit": credit_limit})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "credit_limit")


def test_an_unbounded_credit_limit_in_a_patch_is_400(api, principal):
    team, user, token = principal
    for path in (f"/v1/teams/{team['id']}", f"/v1/users/{user['id']}", f"/v1/tokens/{token['id']}"):
        response = api.request("PATCH", path, json={"credit_limit": "1e99999999"})
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "credit_limit"


@pytest.mark.parametrize(
    ("path", "params", "param"),
    [
        ("/v1/teams", {"limit": HUGE_INT}, "limit"),
        ("/v1/teams", {"limit": "1e3"}, "limit"),
        ("/v1/usage", {"limit": HUGE_INT}, "limit"),
        ("/v1/usage", {"start": "2026-01-01T00:00:00" + "0" * 100 + "Z"}, "start"),
        ("/v1/spend", {"limit": HUGE_INT}, "limit"),
        ("/v1/spend", {"page": HUGE_INT}, "page"),
        ("/v1/spend", {"limit": "100001"}, "limit"),
        ("/v1/spend", {"start": "1e9"}, "start"),
    ],
)
def test_an_unbounded_query_number_is_400_naming_it(api, path, params, param):
    response = api.request("GET", path, params=params)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)


# --- text longer than where it is stored -----------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [
        pytest.param("gpt-sim\x00", id="nul"),
        pytest.param("gpt-\nsim", id="newline"),
        pytest.param("gpt-sim/ep/a\x00b", id="nul-in-endpoint"),
        pytest.param("g" * 257, id="257-characters"),
    ],
)
def test_a_model_name_with_control_characters_or_too_long_is_400(api, principal, secret, model):
    body = json.dumps({"model": model, "messages": OK_MESSAGES})
    error = assert_refused(api, principal, post(api, body, secret), 400, "invalid_request")
    assert error["param"] == "model"


@pytest.fixture(scope="module")
def pinning(api, sim):
    from tests.proxy.test_dialects import dialect_catalog, serving

    with serving(api, dialect_catalog(sim)) as own:
        yield own


def test_a_pinned_endpoint_longer_than_its_column_is_400(pinning, principal, secret):
    # "minimax/minimax-m2.5/ep/" + 180 characters: 204 where holds and the ledger keep 200.
    body = json.dumps({"model": "tc-m25/ep/" + "a" * 180, "messages": OK_MESSAGES})
    error = assert_refused(pinning, principal, post(pinning, body, secret), 400, "invalid_request")
    assert error["param"] == "model"
    assert (
        error["message"] == "the endpoint after /ep/ is 180 characters; 'tc-m25' allows at most 176"
    )


def test_a_pinned_endpoint_that_just_fits_is_served_and_stored_whole(pinning):
    _, _, token = pinning.principal()
    endpoint = "e" * 176
    body = json.dumps({"model": f"tc-m25/ep/{endpoint}", "messages": OK_MESSAGES})
    response = post(pinning, body, token["token"])
    assert response.status_code == 200, response.text
    [event] = pinning.events(token_id=token["id"])
    assert event["upstream_model"] == f"minimax/minimax-m2.5/ep/{endpoint}"
    assert len(event["upstream_model"]) == 200


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/teams", {"name": "t" * 201}, "name"),
        ("/v1/users", {"email": "a@" + "b" * 320, "name": "x", "team_id": "t"}, "email"),
        ("/v1/users", {"email": "a@b.c", "name": "x" * 201, "team_id": "t"}, "name"),
        ("/v1/users", {"email": "a@b.c", "name": "x", "team_id": "t" * 41}, "team_id"),
        ("/v1/users", {"email": "a@b\x00.c", "name": "x", "team_id": "t"}, "email"),
        (
            "/v1/users",
            {"email": "a@b.c", "name": "x", "team_id": "t", "password": "p" * 1025},
            "password",
        ),
    ],
)
def test_identity_text_longer_than_its_column_is_400(api, path, body, param):
    response = api.request("POST", path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param)


def test_a_token_name_longer_than_its_column_is_400(api, principal):
    response = api.request(
        "POST", f"/v1/users/{principal[1]['id']}/tokens", json={"name": "n" * 201}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "name"


@pytest.mark.parametrize(
    "path",
    ["/v1/teams/" + "t" * 5000, "/v1/users/" + "u" * 5000, "/v1/tokens/" + "k" * 5000],
)
def test_an_id_longer_than_any_stored_is_404(api, path):
    response = api.request("GET", path)
    assert response.status_code == 404, response.text
    assert set(response.json()["error"]) == {"message", "type", "code", "param"}
