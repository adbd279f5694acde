"""Refusals clients act on: each kind of refusal answers the status, code and headers of its row
in docs/api/errors.md's table ("Retrying"), read from the page itself, on the chat route's raw
path and on the general stack (a gzip body takes it); a refusal that waiting cannot change is
not retried by the openai SDK (one refusal row); /openapi.json declares the headers."""

import gzip
import json
import re
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest

from metering.errors import retry_after, retry_headers
from tests.conftest import Api

ERRORS_PAGE = Path(__file__).parents[2] / "docs" / "api" / "errors.md"


def table() -> dict[str, tuple[set[int] | None, set[str] | None, dict[str, str | None]]]:
    """The page's retry table: by refusal, (statuses, codes, headers: name -> value or None);
    None for a status or code the provider chooses."""
    text = ERRORS_PAGE.read_text()
    section = text.split("## Retrying: what each refusal tells a client", 1)[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("refusal", "---"):
            continue
        refusal, status, code, headers, _ = cells
        statuses = {int(s) for s in re.findall(r"\b\d{3}\b", status)} or None
        codes = set(re.findall(r"`([a-z_]+)`", code)) or None
        named: dict[str, str | None] = {}
        for header in re.findall(r"`([^`]+)`", headers):
            name, _, value = header.partition(": ")
            named[name] = value or None
        rows[refusal] = (statuses, codes, named)
    return rows


TABLE = table()
WAIT_ENDS = "a rate limit whose window ends (`rpm_limit`, `tpm_limit`)"
PARALLEL = "a parallel limit (`max_parallel_requests`) with requests in flight"
NEVER_FITS = "a limit of 0, or a request larger than its `tpm_limit`"
NOT_ALLOWED = "a model outside an allow-list"
BAD_CREDENTIAL = "no credential, or an unknown, revoked or expired one"
RESETS = "a budget whose window resets"
NEVER_RESETS = "a budget that never resets, a run's budget or a request's `x-metering-max-cost`"
INVALID = "a request that cannot be taken as it is"
NO_MODEL = "no such model or object"
ENCODING = "a body too large, or in an encoding not taken"
UPSTREAM_REFUSED = "an upstream's own refusal (a context too long, a parameter it refuses)"
UPSTREAM_429 = "every provider answered 429"
UPSTREAM_FAILED = "the upstream failed or did not answer"
RETRY_HEADERS = ("retry-after", "retry-after-ms", "x-should-retry")


def assert_row(response, refusal: str) -> None:
    """The answer is the row's: its status and code, each header it names (with its value
    where the row gives one, a prefix for `x-ratelimit-*`), and none of the retry headers it
    leaves out."""
    statuses, codes, headers = TABLE[refusal]
    if statuses is not None:
        assert response.status_code in statuses, response.text
    else:
        assert 400 <= response.status_code < 500, response.text
    if codes is not None:
        assert response.json()["error"]["code"] in codes
    for name, value in headers.items():
        if name.endswith("*"):
            assert any(h.startswith(name[:-1]) for h in response.headers), name
        elif name in RETRY_HEADERS or name.startswith("x-"):
            assert name in response.headers, (name, dict(response.headers))
            if value is not None:
                assert response.headers[name] == value
    for name in RETRY_HEADERS:
        if name not in headers:
            assert name not in response.headers, (name, dict(response.headers))
    if "retry-after-ms" in response.headers:
        seconds, ms = int(response.headers["retry-after"]), int(response.headers["retry-after-ms"])
        assert 1 <= ms <= seconds * 1000 and ms > (seconds - 1) * 1000


def send(api: Api, key: str, body: dict, path: str, **headers: str):
    """POST /v1/chat/completions on the raw path, or (gzip) through the general stack."""
    raw = json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    if path == "general":
        raw, headers["content-encoding"] = gzip.compress(raw), "gzip"
    return api.request("POST", "/v1/chat/completions", key=key, content=raw, headers=headers)


def body(text: str = "Hi sim:tokens=2", model: str = "gpt-sim", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **fields}


def limited(api: Api, **limits) -> dict:
    _, _, token = api.principal()
    api.ok("PATCH", f"/v1/tokens/{token['id']}", json=limits)
    return token


def same_minute(clock) -> None:
    clock.move_to(clock.now().replace(second=0, microsecond=0) + timedelta(minutes=1))


PATHS = pytest.mark.parametrize("path", ["direct", "general"])


@PATHS
def test_a_rate_limit_whose_window_ends(api, clock, path):
    token = limited(api, rpm_limit=1)
    same_minute(clock)
    assert send(api, token["token"], body(), path).status_code == 200
    clock.move_to(clock.now() + timedelta(seconds=20, milliseconds=300))
    refused = send(api, token["token"], body(), path)
    assert_row(refused, WAIT_ENDS)
    # The minute's end, to the millisecond (less what the clock ran since it was moved).
    waits = int(refused.headers["retry-after-ms"])
    assert 30_000 < waits <= 39_700
    assert refused.headers["retry-after"] == str(-(-waits // 1000))


@pytest.mark.parametrize(
    "limits",
    [{"rpm_limit": 0}, {"max_parallel_requests": 0}, {"tpm_limit": 0}, {"tpm_limit": 50}],
    ids=["rpm-0", "parallel-0", "tpm-0", "tpm-too-small"],
)
@PATHS
def test_a_limit_no_wait_clears(api, path, limits):
    token = limited(api, **limits)
    refused = send(api, token["token"], body(max_tokens=1000), path)
    assert_row(refused, NEVER_FITS)


@PATHS
def test_a_parallel_limit_with_a_request_in_flight(api, path):
    token = limited(api, max_parallel_requests=1)
    slow = body("Slow sim:tokens=20 sim:chunks=20 sim:delay_ms=100", stream=True)
    with api.http.stream(
        "POST",
        "/v1/chat/completions",
        json=slow,
        headers={"authorization": f"Bearer {token['token']}"},
    ) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_bytes()  # kept: a generator collected closes the stream
        next(chunks)  # in flight until it is left
        assert_row(send(api, token["token"], body(), path), PARALLEL)


@PATHS
def test_a_model_outside_the_allow_list(api, path):
    token = limited(api, allowed_models=["minimax-m2.1"])
    assert_row(send(api, token["token"], body(), path), NOT_ALLOWED)


@pytest.mark.parametrize("kind", ["unknown", "revoked", "expired", "missing"])
@PATHS
def test_a_credential_that_is_not_valid(api, clock, path, kind):
    _, user, token = api.principal()
    key = token["token"]
    if kind == "unknown":
        key = f"mtr_{uuid.uuid4().hex}"
    elif kind == "revoked":
        api.ok("DELETE", f"/v1/tokens/{token['id']}", 204)
    elif kind == "expired":
        shortened = api.ok("PATCH", f"/v1/tokens/{token['id']}", json={"expires_in": 1})
        clock.move_to(datetime.fromisoformat(shortened["expires_at"].replace("Z", "+00:00")))
    if kind == "missing":
        raw = json.dumps(body()).encode()
        refused = api.http.post(
            "/v1/chat/completions",
            content=gzip.compress(raw) if path == "general" else raw,
            headers={
                "authorization": "",
                **({"content-encoding": "gzip"} if path == "general" else {}),
            },
        )
    else:
        refused = send(api, key, body(), path)
    assert_row(refused, BAD_CREDENTIAL)


@pytest.mark.parametrize("interval", ["daily", "never"])
@PATHS
def test_a_spent_budget(api, path, interval):
    _, _, token = api.principal(token_limit="0.000001", interval=interval)
    refused = send(api, token["token"], body(max_tokens=4000), path)
    assert_row(refused, RESETS if interval == "daily" else NEVER_RESETS)
    assert ("x-budget-resets-at" in refused.headers) is (interval == "daily")


@PATHS
def test_a_request_ceiling(api, path):
    _, _, token = api.principal()
    refused = send(
        api, token["token"], body(max_tokens=4000), path, **{"x-metering-max-cost": "0.000001"}
    )
    assert_row(refused, NEVER_RESETS)
    assert refused.headers["x-budget-scope"] == "request"


@pytest.mark.parametrize(
    ("sent", "refusal"),
    [
        (body(temperature=5), INVALID),
        (body(model="no-such-model"), NO_MODEL),
        (body("x sim:fault=http400"), UPSTREAM_REFUSED),
        (body("x sim:fault=http429"), UPSTREAM_429),
        (body("x sim:fault=http500"), UPSTREAM_FAILED),
    ],
    ids=["invalid", "no-model", "upstream-400", "upstream-429", "upstream-500"],
)
@PATHS
def test_a_refusal_of_the_request_itself(api, path, sent, refusal):
    _, _, token = api.principal()
    refused = send(api, token["token"], sent, path)
    assert_row(refused, refusal)
    if refusal == UPSTREAM_429:  # the simulated provider's retry-after: 1
        assert (refused.headers["retry-after"], refused.headers["retry-after-ms"]) == ("1", "1000")


def test_an_encoding_not_taken(api):
    _, _, token = api.principal()
    refused = api.request(
        "POST",
        "/v1/chat/completions",
        key=token["token"],
        content=b"\x00",
        headers={"content-type": "application/json", "content-encoding": "br"},
    )
    assert_row(refused, ENCODING)


def test_an_admin_routes_refusal_says_it_too(api):
    refused = api.request("POST", "/v1/teams", json={"name": "x", "credit_limit": 0.5})
    assert_row(refused, INVALID)
    assert_row(api.request("GET", f"/v1/teams/team_{uuid.uuid4().hex[:8]}"), NO_MODEL)


def refusals(api: Api, token_id: str, count: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while True:
        rows = api.ok("GET", "/v1/refusals", params={"token_id": token_id})["data"]
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


@pytest.mark.parametrize(
    "limits", [{"rpm_limit": 0}, {"allowed_models": ["minimax-m2.1"]}], ids=["rpm-0", "model"]
)
def test_the_openai_sdk_does_not_retry_a_refusal_no_wait_clears(api, limits):
    token = limited(api, **limits)
    answered: list[int] = []
    sdk_http = httpx.Client(event_hooks={"response": [lambda r: answered.append(r.status_code)]})
    client = openai.OpenAI(
        base_url=f"{api.url}/v1", api_key=token["token"], max_retries=3, http_client=sdk_http
    )
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="gpt-sim", messages=body()["messages"])
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert len(answered) == 1  # one attempt
    assert len(refusals(api, token["id"], 1)) == 1  # one refusal row


def test_the_openapi_document_declares_the_retry_headers(api):
    document = api.ok("GET", "/openapi.json")
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    declared = {status: set(response.get("headers", {})) for status, response in chat.items()}
    assert {"retry-after", "retry-after-ms", "x-should-retry"} <= declared["429"]
    assert "x-should-retry" in declared["402"] and "x-budget-resets-at" in declared["402"]
    assert "x-should-retry" in declared["400"] and "x-should-retry" in declared["403"]
    assert "x-should-retry" not in declared.get("502", set())
    headers = document["components"]["headers"]
    assert headers["x-should-retry"]["schema"]["enum"] == ["false"]
    assert headers["retry-after-ms"]["schema"]["pattern"] == "^[0-9]+$"


# --- the headers, computed -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (39.7, ("40", "39700")),
        (0.0001, ("1", "1")),
        (0, ("1", "1")),
        (1, ("1", "1000")),
        (59.9994, ("60", "60000")),
        (41.2, ("42", "41200")),
    ],
)
def test_retry_after_rounds_both_up(seconds, expected):
    assert tuple(retry_after(seconds).values()) == expected


@pytest.mark.parametrize(
    ("status", "headers", "should_retry", "expected"),
    [
        (400, None, None, {"x-should-retry": "false"}),
        (
            402,
            {"x-budget-scope": "team"},
            None,
            {"x-budget-scope": "team", "x-should-retry": "false"},
        ),
        (404, None, None, {"x-should-retry": "false"}),
        (408, None, None, {}),
        (429, {"retry-after": "3"}, None, {"retry-after": "3", "retry-after-ms": "3000"}),
        (
            429,
            {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"},
            None,
            {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"},
        ),
        (
            429,
            {"x-limit-scope": "token"},
            False,
            {"x-limit-scope": "token", "x-should-retry": "false"},
        ),
        (429, {}, None, {}),
        (502, {}, None, {}),
        (503, {"retry-after": "1"}, None, {"retry-after": "1", "retry-after-ms": "1000"}),
    ],
)
def test_retry_headers_by_status(status, headers, should_retry, expected):
    assert retry_headers(status, headers, should_retry) == expected
