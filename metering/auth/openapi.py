"""The credentials in /openapi.json: an HTTP bearer scheme per kind of credential (every one
is sent as `Authorization: Bearer <credential>`), and on each operation that needs one, a
`security` requirement listing the schemes its rule accepts (metering.auth.rules). Routes open to anyone
(/healthz, login) declare none. Swagger UI's Authorize button sends the key given to it on every
operation that declares the scheme."""

from collections.abc import Callable, Iterator
from typing import Any

import fastapi.routing
from fastapi import FastAPI

from metering.auth.rules import route_rules
from metering.auth.tokens import ACCESS_PREFIX, API_TOKEN_PREFIX, INGEST_PREFIX

# One HTTP bearer scheme per kind of credential (each is sent as `Authorization: Bearer ...`),
# so a generated client or Swagger UI's Authorize knows which it holds; each operation lists
# the schemes its rule accepts, any one of which is enough (OpenAPI's alternatives).
SCHEMES = {
    "adminKey": "The admin key (METERING_ADMIN_KEY).",
    "apiToken": f"A user's API token (`{API_TOKEN_PREFIX}...`), made by POST "
    "/v1/users/{user_id}/tokens.",
    "accessToken": f"A user's access token (`{ACCESS_PREFIX}...`), from POST /v1/auth/login or "
    "/v1/auth/refresh; it expires (`expires_in`) and is renewed with the refresh token, sent in "
    "the body of POST /v1/auth/refresh.",
    "ingestKey": f"A team's ingestion key (`{INGEST_PREFIX}...`), for POST /v1/events only.",
}
# The schemes each rule but `open` accepts (metering.auth.rules enforces the same).
RULE_SCHEMES = {
    "admin": ("adminKey",),
    "self": ("adminKey", "apiToken", "accessToken"),
    "user": ("apiToken", "accessToken"),
    "ingest": ("adminKey", "ingestKey", "apiToken", "accessToken"),
}
# Who may call a route of each rule but `open`, as its operation's description says it.
ACCEPTS = {
    "admin": "the admin key",
    "self": (
        "the admin key, or a user's API token or access token acting on itself (a user, token "
        "or team in the path must be its own; a list shows its own rows only)"
    ),
    "user": "a user's API token or access token (the admin key is refused)",
    "ingest": (
        "the admin key, a team's ingestion key (its team's usage), or a user's API token or "
        "access token (its own usage)"
    ),
}


def _routes(app: FastAPI) -> Iterator[Any]:
    """Every route, included routers flattened (FastAPI >= 0.16x keeps an included router as
    one entry of app.routes, with its dependencies on each route it yields)."""
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    yield from flatten(app.routes) if flatten else app.routes


def _secure(app: FastAPI, schema: dict[str, Any]) -> None:
    paths = schema.get("paths", {})
    for route in _routes(app):
        operations = paths.get(getattr(route, "path_format", None), {})
        rules = route_rules(route)
        if not operations or len(rules) != 1:
            continue
        rule = rules.pop()
        accepts = ACCEPTS.get(rule)
        for method in getattr(route, "methods", None) or ():
            operation = operations.get(method.lower())
            if operation is None or accepts is None:
                continue
            operation["security"] = [{name: []} for name in RULE_SCHEMES[rule]]
            line = f"Credential (`Authorization: Bearer`): {accepts}."
            description = operation.get("description", "")
            if line not in description:
                operation["description"] = f"{description}\n\n{line}".strip()
    schema.setdefault("components", {})["securitySchemes"] = {
        name: {"type": "http", "scheme": "bearer", "description": text}
        for name, text in SCHEMES.items()
    }


def declare_security(app: FastAPI) -> None:
    """Wraps app.openapi: the document it builds (once, then cached) declares the scheme and,
    on each operation, the credentials its route's rule accepts."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        _secure(app, schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
