"""Authorization as data: every route declares one rule, and every kind of credential gets what
its rule says on every route (401 for a bad credential, 403 for a valid one not allowed)."""

import re
import uuid
from collections.abc import Callable, Iterator

import fastapi.routing
import pytest
from fastapi import Depends, FastAPI
from fastapi.dependencies.models import Dependant
from starlette.routing import Mount, Route

from metering.app import create_app
from metering.auth.principal import admin_only, open_access
from metering.auth.rules import RULES, declare
from metering.settings import Catalog, Settings
from tests.auth.conftest import Client, expired_twin, new_account
from tests.conftest import ADMIN_KEY


def routes(app: FastAPI) -> list:
    """Every route the app serves, with included routers flattened (FastAPI >= 0.16x keeps an
    included router as one entry of app.routes; older versions copy its routes in)."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(flatten(app.routes)) if flatten else list(app.routes)


def _calls(dependant: Dependant | None) -> Iterator[Callable]:
    for dependency in dependant.dependencies if dependant is not None else ():
        if dependency.call is not None:
            yield dependency.call
        yield from _calls(dependency)


def route_rules(app: FastAPI, route) -> set[str]:
    """Every rule the route declares (a well-formed route declares exactly one)."""
    declared = getattr(getattr(route, "original_route", route), "auth_rule", None)
    if declared:
        return {declared}
    found = {
        r
        for call in _calls(getattr(route, "dependant", None))
        if (r := getattr(call, "auth_rule", None))
    }
    if found:
        return found
    docs = {app.docs_url, app.redoc_url, app.openapi_url, app.swagger_ui_oauth2_redirect_url}
    if getattr(route, "path", None) in docs - {None}:
        return {"open"}
    return set()


def route_rule(app: FastAPI, route) -> str | None:
    rules = route_rules(app, route)
    return rules.pop() if len(rules) == 1 else None


def describe(route) -> str:
    methods = ",".join(sorted(getattr(route, "methods", None) or [])) or "*"
    return f"{methods} {getattr(route, 'path', route)}"


def unruled_routes(app: FastAPI) -> list[str]:
    """Routes that declare no rule, or more than one."""
    return [describe(route) for route in routes(app) if route_rule(app, route) is None]


APP = create_app(Settings(_env_file=None), Catalog())
ROUTES = {describe(route): route for route in routes(APP)}

# The order matters: credentials that may change things (a DELETE) come last, the admin key last.
CREDENTIALS = (
    "none",
    "garbage",
    "forged_access",
    "revoked_api",
    "logged_out_access",
    "expired_access",
    "other_api",
    "ingest_key",
    "owner_api",
    "owner_access",
    "admin",
)
BAD = {"none", "garbage", "forged_access", "revoked_api", "logged_out_access", "expired_access"}
SUBJECTS = {"user_id", "token_id", "team_id"}


def allowed(rule: str, path: str) -> set[str]:
    """Which credentials a rule lets through on a path (all others: 401 if bad, else 403)."""
    names_subject = bool(SUBJECTS & set(re.findall(r"{(\w+)", path)))
    return {
        "open": set(CREDENTIALS),
        "admin": {"admin"},
        "self": {"admin", "owner_api", "owner_access"}
        | (set() if names_subject else {"other_api"}),
        "user": {"owner_api", "owner_access", "other_api"},
        "ingest": {"admin", "owner_api", "owner_access", "other_api", "ingest_key"},
    }[rule]


def test_every_route_declares_exactly_one_rule():
    assert unruled_routes(APP) == []
    assert {route_rule(APP, route) for route in routes(APP)} <= set(RULES)


def test_a_route_without_a_rule_is_found():
    app = FastAPI()

    @app.get("/declared", dependencies=[Depends(admin_only)])
    async def declared():
        return {}

    @app.get("/forgotten")
    async def forgotten():
        return {}

    @app.get("/both", dependencies=[Depends(admin_only), Depends(open_access)])
    async def both():
        return {}

    app.router.routes.append(Mount("/static", routes=[]))
    app.router.routes.append(declare(Route("/page", lambda r: None), "open"))
    assert sorted(unruled_routes(app)) == ["* /static", "GET /both", "GET /forgotten"]


def test_an_unknown_rule_cannot_be_declared():
    with pytest.raises(ValueError, match="unknown rule 'everyone'"):
        declare(Route("/x", lambda r: None), "everyone")


@pytest.fixture(scope="module")
def strangers(api):
    """Credentials that belong to nobody on the route: another user's, revoked, logged out."""
    client = Client(api.url)
    other = new_account(api)
    revoked = api.token(other.id)
    api.ok("DELETE", f"/v1/tokens/{revoked['id']}", 204)
    pair = client.tokens(other.email, other.password)
    assert client.logout(pair["refresh_token"]).status_code == 204
    forged = pair["access_token"].rpartition(".")[0] + ".c2lnbmF0dXJl"
    ingest_key = api.ok(
        "POST", f"/v1/teams/{other.team['id']}/ingest-keys", 201, json={"name": "collector"}
    )
    return {
        "ingest_key": ingest_key["key"],
        "none": None,
        "garbage": f"garbage-{uuid.uuid4().hex}",
        "forged_access": forged,
        "revoked_api": revoked["token"],
        "logged_out_access": pair["access_token"],
        "other_api": other.api_token["token"],
        "admin": ADMIN_KEY,
    }


def owner_credentials(api) -> tuple[dict, dict]:
    """A fresh owner: its credentials, and the ids its paths name (token_id is a second token,
    so revoking it leaves the owner's credential working)."""
    client = Client(api.url)
    owner = new_account(api)
    second = api.token(owner.id)
    pair = client.tokens(owner.email, owner.password)
    credentials = {
        "owner_api": owner.api_token["token"],
        "owner_access": pair["access_token"],
        "expired_access": expired_twin(api.settings.database_url, pair["access_token"]),
    }
    ids = {"user_id": owner.id, "token_id": second["id"], "team_id": owner.team["id"]}
    return credentials, ids


@pytest.fixture(scope="module")
def shared_owner(api):
    return owner_credentials(api)


@pytest.mark.parametrize("route_name", sorted(ROUTES))
def test_each_credential_gets_what_the_route_rule_says(api, strangers, shared_owner, route_name):
    route = ROUTES[route_name]
    rule = route_rule(APP, route)
    # A DELETE may remove the owner's objects: it gets an owner of its own.
    mine, ids = owner_credentials(api) if "DELETE" in route.methods else shared_owner
    credentials = {**strangers, **mine}
    path = re.sub(r"{(\w+)(:\w+)?}", lambda m: ids.get(m.group(1), "unknown"), route.path)
    client = Client(api.url)
    for method in sorted(route.methods - {"HEAD"}):
        for name in CREDENTIALS:
            body = {"json": {}} if method in ("POST", "PATCH", "PUT") else {}
            response = client.call(method, path, credentials[name], **body)
            where = f"{method} {path} with {name} ({rule})"
            if name in allowed(rule, route.path):
                assert response.status_code not in (401, 403), f"{where}: {response.text}"
            elif name in BAD:
                assert response.status_code == 401, f"{where}: {response.text}"
                assert response.json()["error"]["code"] == "invalid_api_key"
            else:
                assert response.status_code == 403, f"{where}: {response.text}"
                assert response.json()["error"]["code"] == "forbidden"
