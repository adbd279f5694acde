"""Messages a person can act on: a validation message carries the field and what is wrong with
it, never the framework's own words; every amount in a message is in the one money format."""

import re
import uuid
from decimal import Decimal

import pytest

from metering.budgets.windows import parse_interval
from metering.demo import DELIBERATE
from metering.money import PICO, format_usd


def interval_problem(text: str) -> str:
    try:
        parse_interval(text)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(text)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"reset_interval": "fortnightly"}, "reset_interval", interval_problem("fortnightly")),
        (
            {"alert_thresholds": [0]},
            "alert_thresholds",
            "alert_thresholds entries must be whole numbers from 1 to 100",
        ),
    ],
)
def test_a_validation_message_has_no_framework_prefix(api, body, param, says):
    response = api.request("POST", "/v1/teams", json={"name": "t", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (param, f"{param}: {says}")


def test_a_token_expiry_refused_says_why_without_prefix(api):
    user = api.user(api.team()["id"])
    body = {"name": "t", "expires_at": "2030-01-01T00:00:00Z", "expires_in": 60}
    response = api.request("POST", f"/v1/users/{user['id']}/tokens", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == "give expires_at or expires_in, not both"


def test_every_amount_the_demo_explains_is_in_the_money_format():
    amounts = [a for text in DELIBERATE.values() for a in re.findall(r"([0-9.]+) USD", text)]
    assert amounts  # the 402's limit
    for amount in amounts:
        assert amount == format_usd(int(Decimal(amount) * PICO)), amount


def test_a_405_allows_every_method_the_document_gives_its_path(api):
    """FastAPI makes one route per method; the 405's Allow names them all, as the document does
    (OPTIONS on /v1/teams once answered `Allow: POST` though GET is documented too)."""
    document = api.ok("GET", "/openapi.json")
    checked = 0
    for path, operations in document["paths"].items():
        concrete = path.replace("{", "x").replace("}", "")  # any id: the router matches the shape
        documented = {method.upper() for method in operations if method != "parameters"}
        response = api.request("OPTIONS", concrete)
        if "OPTIONS" in documented:
            continue
        assert response.status_code == 405, (path, response.text)
        assert response.json()["error"]["code"] == "method_not_allowed"
        allowed = set(response.headers["allow"].split(", "))
        assert documented <= allowed, (path, allowed, documented)
        checked += 1
    assert checked == len(document["paths"]) > 30


def test_every_response_declares_the_headers_it_carries(api):
    document = api.ok("GET", "/openapi.json")
    headers = document["components"]["headers"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                declared = response["headers"]
                assert "x-request-id" in declared, (method, path, status)
                for ref in declared.values():
                    assert ref["$ref"].removeprefix("#/components/headers/") in headers
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"x-budget-scope", "x-budget-resets-at"} <= set(chat["402"]["headers"])
    assert {"retry-after", "x-ratelimit-remaining-requests"} <= set(chat["429"]["headers"])
    assert "x-max-tokens-clamped" in chat["200"]["headers"]
    assert headers["x-budget-scope"]["schema"]["enum"] == [
        "token",
        "user",
        "team",
        "run",
        "end_user",
    ]
    # What a live answer carries is what its status declares.
    refused = api.request("GET", "/v1/teams", key="not-a-key")
    assert refused.status_code == 401
    assert refused.headers["x-request-id"]


def test_each_create_links_to_the_operations_on_what_it_made(api):
    document = api.ok("GET", "/openapi.json")
    by_id = {
        operation["operationId"]: (path, method)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    linked = set()
    for operations in document["paths"].values():
        for operation in operations.values():
            for link in operation["responses"].get("201", {}).get("links", {}).values():
                target, method = by_id[link["operationId"]]
                assert set(re.findall(r"{(\w+)}", target)) == set(link["parameters"]), target
                linked.add(f"{method.upper()} {target}")
    for wanted in (
        "GET /v1/teams/{team_id}",
        "PATCH /v1/teams/{team_id}",
        "DELETE /v1/teams/{team_id}",
        "GET /v1/users/{user_id}",
        "POST /v1/users/{user_id}/tokens",
        "DELETE /v1/tokens/{token_id}",
        "DELETE /v1/teams/{team_id}/ingest-keys/{key_id}",
        "POST /v1/webhooks/{webhook_id}/test",
        "GET /v1/webhooks/{webhook_id}/deliveries",
        "GET /v1/reconciliations/{reconciliation_id}",
    ):
        assert wanted in linked, wanted
    # A link the client follows works: the team made answers its GET by the id linked.
    team = api.ok("POST", "/v1/teams", 201, json={"name": f"linked-{uuid.uuid4().hex[:8]}"})
    assert api.ok("GET", f"/v1/teams/{team['id']}")["id"] == team["id"]


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("ops{}", True),
        ("\tops{} \n", True),
        ("o\tps{}", False),
        ("o\x7fps{}", False),
        ("ö ps{}", True),
    ],
)
def test_the_document_declares_the_text_rule_the_service_applies(api, name, taken):
    """Each body's strings and each parameter carry metering.text's rule as a pattern: a name
    the pattern refuses the service refuses, one it takes the service takes."""
    document = api.ok("GET", "/openapi.json")
    pattern = document["components"]["schemas"]["TeamCreate"]["properties"]["name"]["pattern"]
    name = name.format(uuid.uuid4().hex[:6])
    assert (re.fullmatch(pattern, name) is not None) is taken
    response = api.request("POST", "/v1/teams", json={"name": name})
    assert (response.status_code == 201) is taken, response.text
    usage = document["paths"]["/v1/usage"]["get"]["parameters"]
    model = next(p for p in usage if p["name"] == "model")["schema"]["anyOf"][0]
    assert re.fullmatch(model["pattern"], "gpt\x00") is None
    assert api.request("GET", "/v1/usage", params={"model": "gpt\x00"}).status_code == 400


@pytest.mark.parametrize(
    ("tag", "taken"),
    [("project:alpha", True), ("k:", True), ("k:a:b", True), (":v", False), ("novalue", False)],
)
def test_the_declared_tag_filter_is_what_the_reports_take(api, tag, taken):
    document = api.ok("GET", "/openapi.json")
    for path in ("/v1/usage", "/v1/spend"):
        parameters = document["paths"][path]["get"]["parameters"]
        declared = next(p for p in parameters if p["name"] == "tag")["schema"]
        assert (re.fullmatch(declared["items"]["pattern"], tag) is not None) is taken
        response = api.request("GET", path, params={"tag": tag})
        assert (response.status_code == 200) is taken, response.text


@pytest.mark.parametrize(
    ("path", "group_by", "taken"),
    [
        ("/v1/spend", "team,model", True),
        ("/v1/spend", "tag:project,end_user", True),
        ("/v1/spend", "", True),
        ("/v1/spend", "team, model", False),
        ("/v1/spend", "Team", False),
        ("/v1/spend", "reason", False),
        ("/v1/refusals/summary", "reason,scope", True),
        ("/v1/refusals/summary", "tag:project", False),
    ],
)
def test_the_declared_group_by_is_what_each_report_takes(api, path, group_by, taken):
    document = api.ok("GET", "/openapi.json")
    parameters = document["paths"][path]["get"]["parameters"]
    declared = next(p for p in parameters if p["name"] == "group_by")["schema"]
    assert (re.fullmatch(declared["pattern"], group_by) is not None) is taken
    response = api.request("GET", path, params={"group_by": group_by})
    assert (response.status_code == 200) is taken, response.text


def test_the_ingested_event_schema_is_its_own_component(api):
    """Each event of POST /v1/events is checked against UsageEventIn; /v1/usage's rows are
    UsageEvent: two schemas, neither overwriting the other."""
    schemas = api.ok("GET", "/openapi.json")["components"]["schemas"]
    assert "idempotency_key" in schemas["UsageEventIn"]["required"]
    assert "idempotency_key" not in schemas["UsageEvent"].get("required", [])
    assert "cost" in schemas["UsageEvent"]["properties"]
