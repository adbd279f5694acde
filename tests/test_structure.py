"""The shape the domain packages keep: endpoints hold no SQL, services know nothing of FastAPI
(who reads the app's state: tests/test_architecture.py); and /openapi.json declares every
response."""

import ast
from pathlib import Path

import pytest

from metering.app import create_app
from metering.settings import Catalog, Settings

ROOT = Path(__file__).resolve().parents[1] / "metering"
# The simulated upstream is an app of its own: its state is its own.
NOT_YET = ("sim",)
ENDPOINTS = sorted(ROOT.glob("*/endpoints.py")) + [
    ROOT / "auth" / "principal.py",
    ROOT / "reports" / "prometheus.py",
]
SERVICES = sorted(ROOT.glob("*/service.py")) + [
    ROOT / "reports" / "usage.py",
    ROOT / "reports" / "spend.py",
    ROOT / "reports" / "reconciliation.py",
    ROOT / "budgets" / "queries.py",
]
# Routes whose success responses are not declared as models yet.
UNDECLARED = {"/v1/chat/completions", "/v1/responses", "/v1/models"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def name(path: Path) -> str:
    return str(path.relative_to(ROOT.parent))


@pytest.mark.parametrize("path", ENDPOINTS, ids=name)
def test_endpoints_and_auth_dependencies_hold_no_sql(path):
    if path.parent.name in NOT_YET:
        pytest.skip("converted later")
    found = {i for i in imports(path) if i.startswith("sqlalchemy")}
    assert found <= {"sqlalchemy.ext.asyncio.AsyncSession"}, found  # a type, for annotations


@pytest.mark.parametrize("path", SERVICES, ids=name)
def test_services_do_not_depend_on_fastapi(path):
    found = {i for i in imports(path) if i.split(".")[0] in ("fastapi", "starlette")}
    assert found == set()


def test_budget_routes_live_in_budgets():
    from metering.budgets.endpoints import router as budgets
    from metering.identity.endpoints import router as identity

    assert sorted(route.path for route in budgets.routes) == [
        "/v1/teams/{team_id}/budget",
        "/v1/teams/{team_id}/end-users",
        "/v1/teams/{team_id}/end-users/{end_user:path}/budget",
        "/v1/teams/{team_id}/end-users/{end_user:path}/budget",
        "/v1/teams/{team_id}/end-users/{end_user:path}/budget",
        "/v1/teams/{team_id}/limits",
        "/v1/tokens/{token_id}/budget",
        "/v1/tokens/{token_id}/limits",
        "/v1/users/{user_id}/budget",
        "/v1/users/{user_id}/limits",
    ]
    assert [route.path for route in identity.routes if "budget" in route.path] == []


def operations():
    schema = create_app(Settings(_env_file=None), Catalog()).openapi()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            yield f"{method.upper()} {path}", operation, schema


def test_every_route_declares_its_success_model():
    missing = []
    for label, operation, _ in operations():
        if label.split()[1] in UNDECLARED:
            continue
        for status, response in operation["responses"].items():
            if status.startswith("2") and status != "204":
                schemas = [c.get("schema", {}) for c in response.get("content", {}).values()]
                if not schemas or {} in schemas:
                    missing.append(f"{label} {status}")
    assert missing == []


def test_every_error_status_has_the_openai_error_model_and_none_is_422():
    seen, schema = 0, {}
    for label, operation, schema in operations():  # noqa: B007 (the schema is read below)
        for status, response in operation["responses"].items():
            assert status != "422", label  # invalid input answers 400
            if status[0] in "45":
                seen += 1
                body = response["content"]["application/json"]["schema"]
                assert body == {"$ref": "#/components/schemas/ErrorResponse"}, label
    assert seen >= 100
    error = schema["components"]["schemas"]["ErrorDetail"]
    assert sorted(error["required"]) == ["code", "message", "param", "type"]


@pytest.mark.parametrize(
    ("label", "statuses"),
    [
        ("GET /v1/teams", {"200", "400", "401", "403", "429", "503"}),
        ("POST /v1/users", {"201", "400", "401", "403", "409", "429", "503"}),
        ("GET /v1/tokens/{token_id}/budget", {"200", "401", "403", "404", "429", "503"}),
        ("GET /v1/me", {"200", "401", "403", "429", "503"}),  # 403: an ingestion key
        ("POST /v1/auth/login", {"200", "400", "401", "429", "503"}),
        ("GET /v1/usage", {"200", "400", "401", "403", "429", "503"}),
        ("GET /v1/spend", {"200", "400", "401", "403", "404", "429", "503"}),
        ("POST /v1/reconciliations", {"201", "400", "401", "403", "413", "415", "429", "503"}),
        ("GET /healthz", {"200"}),
        ("GET /readyz", {"200", "503"}),
    ],
)
def test_routes_declare_the_statuses_they_give(label, statuses):
    found = {op_label: op for op_label, op, _ in operations()}
    assert set(found[label]["responses"]) == statuses


def test_spend_declares_json_and_csv():
    found = {label: op for label, op, _ in operations()}
    content = found["GET /v1/spend"]["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/SpendOut"}
    assert content["text/csv"]["schema"] == {"type": "string"}


def test_usage_declares_json_and_csv():
    found = {label: op for label, op, _ in operations()}
    content = found["GET /v1/usage"]["responses"]["200"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/UsageOut"}
    assert content["text/csv"]["schema"] == {"type": "string"}
