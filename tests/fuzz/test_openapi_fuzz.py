"""Schemathesis over the server's own /openapi.json, as the admin, as a user and as a team's
ingestion key: no request it
generates gets a 5xx, every status it gets is one the route declares, and every response
matches the schema declared for its status.

The real server on loopback, on SQLite and PostgreSQL, with the simulated upstream behind it.
A bounded number of examples per operation keeps the run to a minute or two."""

import fastapi.routing
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from metering import migrate
from metering.app import create_app
from metering.auth.rules import route_rules
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for, database_url

EXAMPLES = 10
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
# The operations with no invalid request to generate (every value of their parameters is
# valid; no parameters, no body), found by the first run that tries: a case is generated from
# the schema alone, so none of them has one for another role or backend either. The runs after
# it skip them instead of spending a hundred rejected attempts each (most of a run's time).
NOTHING_INVALID: set[str] = set()
# The roles a route's rule lets past the credential check (metering.auth.rules; a route with no
# rule is open). Invalid requests are generated for the roles that reach the route's own checks;
# to the others every request is the same 403 (tests/auth/test_rules.py walks each route with
# each credential), so they get the valid ones only.
REACHES = {
    "open": {"admin", "user", "ingest"},
    "admin": {"admin"},
    "self": {"admin", "user"},
    "user": {"user"},
    "ingest": {"admin", "user", "ingest"},
}


def reaching(settings: Settings, catalog) -> dict[tuple[str, str], set[str]]:
    """(METHOD, path) -> the roles that reach the operation past its credential check."""
    app = create_app(settings, catalog, run_jobs=False)
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    found: dict[tuple[str, str], set[str]] = {}
    for route in flatten(app.routes) if flatten else app.routes:
        rules = route_rules(route) or {"open"}
        roles = set().union(*(REACHES[rule] for rule in rules))
        for method in getattr(route, "methods", None) or ():
            found[(method.upper(), getattr(route, "path_format", ""))] = roles
    return found


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def fuzzed(request, sim):
    """A server of the module's own (the fuzzer creates and deletes at random), its admin API,
    a user's token and an ingestion key of the user's team."""
    if request.param == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path_factory').mktemp('fuzz')}/m.db"
    else:
        url = database_url(request, "postgresql")
    migrate.upgrade(url)
    settings_ = Settings(
        database_url=url, admin_key=ADMIN_KEY, openapi_enabled=True, _env_file=None
    )
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings_, catalog)
    api = Api(server.url, request.param, settings_)
    team, _, token = api.principal(token_limit="5", user_limit="5", team_limit="5")
    ingest = api.ok("POST", f"/v1/teams/{team['id']}/ingest-keys", 201, json={"name": "fuzz"})
    keys = {"user": token["token"], "ingest": ingest["key"], "admin": ADMIN_KEY}
    yield api, keys, reaching(settings_, catalog)
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    api, _, _ = fuzzed
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json")


def _failures(operation, mode: GenerationMode, api: Api, key: str) -> list[str]:
    """Runs EXAMPLES generated cases of one operation; what failed, as reproducible commands."""
    if mode is GenerationMode.NEGATIVE and operation.label in NOTHING_INVALID:
        return []
    headers = {"authorization": f"Bearer {key}"}
    found: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report, do not minimise
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        try:
            case.call_and_validate(base_url=api.url, headers=headers, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:
            command = case.as_curl_command(headers=headers)
            found.append(f"{operation.label} ({mode.value}): {exc}\n  {command}")

    try:
        run()
    except Unsatisfiable:
        # An operation without parameters or body has no invalid request to generate.
        assert mode is GenerationMode.NEGATIVE, operation.label
        NOTHING_INVALID.add(operation.label)
    return found


# The roles fuzzed on each backend. The database is where the backends differ (what a column
# refuses, how a constraint fails), so PostgreSQL, the stricter, gets every role; SQLite the
# admin, who reaches every operation but the user's own.
ROLES = {"postgresql": ("admin", "user", "ingest"), "sqlite": ("admin",)}


# Nothing is excluded: the admin key cannot be revoked through the API, the fuzzer never holds
# a refresh token to log out with, and the user's token id is never guessed by a generated path.
# A role is sent only the operations it reaches past the credential check, valid and invalid
# requests: to it every other operation answers the same 403, whatever the request
# (tests/auth/test_rules.py walks each route with each credential). The roles run in one test
# per backend: one process builds each operation's strategies once (most of a first run's time)
# and the roles after it reuse them.
def test_openapi_fuzz(api_schema, fuzzed):
    api, keys, reaches = fuzzed
    failures = []
    operations = 0
    for role in ROLES[api.backend]:
        reached = 0
        for result in api_schema.get_all_operations():
            operation = result.ok()
            operations += role == "admin"
            if role not in reaches[(operation.method.upper(), operation.path)]:
                continue
            reached += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                found = _failures(operation, mode, api, keys[role])
                failures += [f"as {role}: {failure}" for failure in found]
        assert reached >= 5, role  # each role's own operations, valid and invalid requests
    assert operations >= 25  # the whole API was fuzzed, not an empty schema
    assert failures == [], "\n".join(failures[:10])
