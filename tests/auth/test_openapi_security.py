"""/openapi.json declares the credentials: one HTTP bearer scheme, and on every operation the
requirement its route's rule calls for (tests/auth/test_rules.py finds the rule the same way the
app enforces it): none on an open route, the bearer scheme and the credentials it takes on every
other."""

import pytest

from metering.auth.openapi import ACCEPTS, RULE_SCHEMES, SCHEMES
from tests.auth.test_rules import APP, describe, route_rule, routes

SCHEMA = APP.openapi()


def operations() -> dict[str, tuple[str, dict]]:
    """'METHOD /path' -> (its route's rule, its operation in the document)."""
    found = {}
    for route in routes(APP):
        in_schema = SCHEMA["paths"].get(getattr(route, "path_format", None), {})
        for method in getattr(route, "methods", None) or ():
            if method.lower() in in_schema:
                found[f"{method} {route.path_format}"] = (
                    route_rule(APP, route),
                    in_schema[method.lower()],
                )
    return found


OPERATIONS = operations()


def test_every_operation_of_the_document_is_found_with_its_rule():
    documented = {
        f"{method.upper()} {path}"
        for path, methods in SCHEMA["paths"].items()
        for method in methods
    }
    assert set(OPERATIONS) == documented
    assert all(rule is not None for rule, _ in OPERATIONS.values()), [
        describe(r) for r in routes(APP)
    ]


def test_a_bearer_scheme_per_credential_is_declared():
    schemes = SCHEMA["components"]["securitySchemes"]
    assert set(schemes) == {"adminKey", "apiToken", "accessToken", "ingestKey"} == set(SCHEMES)
    for scheme in schemes.values():
        assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert "security" not in SCHEMA  # no default: each operation says its own


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_each_operation_requires_what_its_rule_accepts(label):
    rule, operation = OPERATIONS[label]
    if rule == "open":
        assert "security" not in operation
    else:
        assert operation["security"] == [{name: []} for name in RULE_SCHEMES[rule]]
        assert operation["description"].endswith(
            f"Credential (`Authorization: Bearer`): {ACCEPTS[rule]}."
        )


def test_open_and_guarded_routes_as_the_contract_has_them():
    rules = {label: rule for label, (rule, _) in OPERATIONS.items()}
    for label in ("GET /healthz", "GET /readyz", "POST /v1/auth/login", "POST /v1/auth/refresh"):
        assert rules[label] == "open"
    assert rules["GET /v1/teams"] == "admin"
    assert rules["POST /v1/chat/completions"] == "user"
    assert rules["POST /v1/events"] == "ingest"
    assert rules["GET /v1/usage"] == "self"
    assert set(rules.values()) == {"open", "admin", "self", "user", "ingest"}
    schemes = {label: operation.get("security") for label, (_, operation) in OPERATIONS.items()}
    assert schemes["GET /v1/teams"] == [{"adminKey": []}]
    assert schemes["POST /v1/chat/completions"] == [{"apiToken": []}, {"accessToken": []}]
    assert {"ingestKey": []} in schemes["POST /v1/events"]
    assert all(
        {"ingestKey": []} not in (s or []) for label, s in schemes.items() if "events" not in label
    )


def test_the_document_is_the_same_when_built_again():
    """app.openapi() is called by every /openapi.json request: no credential line added twice."""
    again = APP.openapi()
    assert again["paths"]["/v1/teams"]["get"]["description"].count("Credential (") == 1
