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
  ingest  the admin key, a team's ingestion key, or a user's API/access token reporting its own
          usage (POST /v1/events); an ingestion key gets 403 on every other route
"""

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastapi.dependencies.models import Dependant
from starlette.routing import BaseRoute

RULES = ("open", "admin", "self", "user", "ingest")
# Path parameters by which a *self* route names what it acts on (an end user is named within
# its team, whose id the same path carries).
SUBJECT_PARAMS = ("user_id", "token_id", "team_id", "end_user")
# Path parameters naming what the route itself finds its owner of, answering 404 to anyone
# else (a stored response: metering.responses.store.visible).
OWNED_PARAMS = ("response_id",)

Dependency = TypeVar("Dependency", bound=Callable[..., Any])


def rule(name: str) -> Callable[[Dependency], Dependency]:
    """Marks a dependency as the one that enforces rule `name`."""
    if name not in RULES:
        raise ValueError(f"unknown rule {name!r}: one of {', '.join(RULES)}")

    def mark(dependency: Dependency) -> Dependency:
        dependency.auth_rule = name  # type: ignore[attr-defined]
        return dependency

    return mark


def declare(route: BaseRoute, name: str) -> BaseRoute:
    """For routes without dependencies (mounts, static pages): say who may call them."""
    rule(name)  # validates the name
    route.auth_rule = name  # type: ignore[attr-defined]
    return route


def _calls(dependant: Dependant | None) -> Iterator[Callable[..., Any]]:
    for dependency in dependant.dependencies if dependant is not None else ():
        if dependency.call is not None:
            yield dependency.call
        yield from _calls(dependency)


def route_rules(route: Any) -> set[str]:
    """The rules a route declares: by `declare`, or through the dependencies it uses (its
    router's included). A well-formed route declares exactly one."""
    declared = getattr(getattr(route, "original_route", route), "auth_rule", None)
    if declared:
        return {declared}
    return {
        found
        for call in _calls(getattr(route, "dependant", None))
        if (found := getattr(call, "auth_rule", None))
    }
