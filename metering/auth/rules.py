"""Who may call each route, declared as data.

Every route names exactly one rule, through the dependency it uses (each dependency in
metering.auth.principal carries its rule), or, for a route that takes no dependencies (a mount,
a static page), through `declare(route, rule)`. FastAPI's own documentation routes are open.
tests/auth/test_rules.py walks every route of the app: a route without a rule fails it.

  open    anyone; no credential is needed (health, login, the docs)
  admin   the admin key only; a user's credential gets 403
  self    the admin key, or a user's API/access token acting on itself: a path naming a user,
          token or team must name its own (403 otherwise); a list shows only its own rows
  user    a user's API/access token only (the proxy charges a user and a team); admin gets 403
"""

from collections.abc import Callable, Iterator

import fastapi.routing
from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from starlette.routing import BaseRoute

RULES = ("open", "admin", "self", "user")
# Path parameters by which a *self* route names what it acts on.
SUBJECT_PARAMS = ("user_id", "token_id", "team_id")


def rule(name: str) -> Callable:
    """Marks a dependency as the one that enforces rule `name`."""
    if name not in RULES:
        raise ValueError(f"unknown rule {name!r}: one of {', '.join(RULES)}")

    def mark(dependency: Callable) -> Callable:
        dependency.auth_rule = name  # type: ignore[attr-defined]
        return dependency

    return mark


def declare(route: BaseRoute, name: str) -> BaseRoute:
    """For routes without dependencies (mounts, static pages): say who may call them."""
    rule(name)  # validates the name
    route.auth_rule = name  # type: ignore[attr-defined]
    return route


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
