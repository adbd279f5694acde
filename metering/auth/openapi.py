"""The credentials in /openapi.json: one HTTP bearer scheme (every credential is sent as
`Authorization: Bearer <credential>`), and on each operation that needs one, a `security`
requirement and the credentials its rule accepts (metering.auth.rules). Routes open to anyone
(/healthz, login) declare none. Swagger UI's Authorize button sends the key given to it on every
operation that declares the scheme."""

from collections.abc import Callable, Iterator
from typing import Any

import fastapi.routing
from fastapi import FastAPI

from metering.auth.rules import route_rules
from metering.auth.tokens import ACCESS_PREFIX, API_TOKEN_PREFIX, INGEST_PREFIX

SCHEME = "bearer"
BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": (
        "Every credential is sent as `Authorization: Bearer <credential>`: the admin key "
        f"(METERING_ADMIN_KEY), a user's API token (`{API_TOKEN_PREFIX}...`), a user's access "
        f"token (`{ACCESS_PREFIX}...`, from POST /v1/auth/login), or a team's ingestion key "
        f"(`{INGEST_PREFIX}...`, for POST /v1/events only). Each operation says which it takes."
    ),
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
        accepts = ACCEPTS.get(rules.pop())
        for method in getattr(route, "methods", None) or ():
            operation = operations.get(method.lower())
            if operation is None or accepts is None:
                continue
            operation["security"] = [{SCHEME: []}]
            line = f"Credential (`Authorization: Bearer`): {accepts}."
            description = operation.get("description", "")
            if line not in description:
                operation["description"] = f"{description}\n\n{line}".strip()
    schema.setdefault("components", {}).setdefault("securitySchemes", {})[SCHEME] = BEARER


def declare_security(app: FastAPI) -> None:
    """Wraps app.openapi: the document it builds (once, then cached) declares the scheme and,
    on each operation, the credentials its route's rule accepts."""
    build: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        schema = build()
        _secure(app, schema)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
