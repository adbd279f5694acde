"""Schemathesis over the server's own /openapi.json with every check (`--checks all`) and its
coverage, fuzzing and stateful phases, as the admin, as a user's API token and as a team's
ingestion key, on SQLite and PostgreSQL: zero failures. No request gets a 5xx; every status and
body is the one its operation declares; a request its schema refuses is refused and one it takes
is taken, but for the 400s of the rules the document declares as data rules (tests/fuzz/hooks.py,
docs/development/fuzzing.md).

The real server on loopback with the simulated upstream behind it, and schemathesis's own
command (tests/fuzz/runner.py). Each backend and credential is a test of its own, so that the
parallel part's processes share them. A bounded budget (FUZZ_EXAMPLES examples an operation,
FUZZ_STEPS stateful steps) keeps CI's run short; `make fuzz` sets bigger ones."""

import os

import fastapi.routing
import pytest

from metering import migrate
from metering.app import create_app
from metering.auth.rules import route_rules
from metering.settings import Settings, parse_catalog
from metering.testing import metering_server
from tests.conftest import ADMIN_KEY, Api, catalog_for, database_url
from tests.fuzz import runner

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "3"))
STEPS = int(os.environ.get("FUZZ_STEPS", "10"))
# The roles a route's rule lets past the credential check (metering.auth.rules; a route with no
# rule is open). A credential is sent the operations it reaches: to it every other one answers
# the same 403, whatever the request (tests/auth/test_rules.py walks each route with each one).
REACHES = {
    "open": {"admin", "user", "ingest"},
    "admin": {"admin"},
    "self": {"admin", "user"},
    "user": {"user"},
    "ingest": {"admin", "user", "ingest"},
}


def reaching(settings: Settings, catalog, schema: dict) -> dict[str, set[str]]:
    """Role -> the operation ids it reaches past the credential check."""
    app = create_app(settings, catalog, run_jobs=False)
    flatten = getattr(fastapi.routing, "iter_route_contexts", None)
    found: dict[str, set[str]] = {role: set() for role in REACHES["open"]}
    for route in flatten(app.routes) if flatten else app.routes:
        rules = route_rules(route) or {"open"}
        roles = set().union(*(REACHES[rule] for rule in rules))
        operations = schema["paths"].get(getattr(route, "path_format", ""), {})
        for method in getattr(route, "methods", None) or ():
            operation = operations.get(method.lower())
            for role in roles if operation else ():
                found[role].add(operation["operationId"])
    return found


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def fuzzed(request, sim):
    """A server of the module's own (the fuzzer creates and deletes at random), a user's token
    and an ingestion key of the user's team, and the operations each credential reaches."""
    if request.param == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path_factory').mktemp('fuzz')}/m.db"
    else:
        url = database_url(request, "postgresql")
    migrate.upgrade(url)
    settings = Settings(database_url=url, admin_key=ADMIN_KEY, openapi_enabled=True, _env_file=None)
    catalog = parse_catalog(
        catalog_for(sim), environ={"SIM_EXASCALE_KEY": "k", "SIM_OPENAI_KEY": "k"}
    )
    server = metering_server(settings, catalog)
    api = Api(server.url, request.param, settings)
    team, _, token = api.principal(token_limit="5", user_limit="5", team_limit="5")
    ingest = api.ok("POST", f"/v1/teams/{team['id']}/ingest-keys", 201, json={"name": "fuzz"})
    keys = {"user": token["token"], "ingest": ingest["key"], "admin": ADMIN_KEY}
    yield api, keys, reaching(settings, catalog, runner.document(server.url))
    server.stop()


# The runs of each backend, each a test of its own (the parallel part's processes share
# them): the admin's fuzzing and stateful phases, and the user's and the ingestion key's (fewer
# operations) three phases. The ingestion key's operations link to none another, so its run has
# no stateful phase (runner.linked).
PLANS = [
    ("admin", "fuzzing,stateful"),
    ("user", runner.PHASES),
    ("ingest", runner.PHASES),
]
FULL = bool(os.environ.get("FUZZ_FULL"))


def _run(fuzzed, role: str, phases: str, tmp_path, only: set[str] | None = None) -> None:
    api, keys, reaches = fuzzed
    operations = sorted(reaches[role] if only is None else only)
    if only is None:
        # each role's own operations: the whole API for the admin, its own for the others
        assert len(operations) >= {"admin": 45, "user": 20, "ingest": 5}[role], operations
    done = runner.run(
        api.url, keys[role], operations, tmp_path, examples=EXAMPLES, steps=STEPS, phases=phases
    )
    report = done.stdout[-20000:] + done.stderr[-5000:]
    assert "Test cases:" in done.stdout, report  # it ran and summed up, not a usage error
    assert done.returncode == 0, report


@pytest.mark.parametrize(("role", "phases"), PLANS, ids=[f"{r}-{p}" for r, p in PLANS])
def test_openapi_fuzz(fuzzed, role, phases, tmp_path):
    _run(fuzzed, role, phases, tmp_path)


# The admin's coverage phase (every operation's edges, valid and invalid: most of a run's
# requests) on PostgreSQL, the stricter database; on SQLite too with FUZZ_FULL (`make fuzz`).
# In CI, of the operations only the admin reaches: the others' edges are the user's and the
# ingestion key's coverage runs (the same schema, the same checks); FUZZ_FULL covers all of
# them as the admin too. In two halves, so two of the parallel part's processes share it.
@pytest.mark.parametrize(
    "fuzzed",
    [pytest.param("postgresql", marks=pytest.mark.postgres), *(["sqlite"] if FULL else [])],
    indirect=True,
)
@pytest.mark.parametrize("half", [0, 1])
def test_openapi_fuzz_admin_coverage(fuzzed, half, tmp_path):
    _, _, reaches = fuzzed
    mine = reaches["admin"] if FULL else reaches["admin"] - reaches["user"] - reaches["ingest"]
    assert len(mine) >= 20, sorted(mine)  # teams, users, webhooks, reports, adjustments...
    _run(fuzzed, "admin", "coverage", tmp_path, only=set(sorted(mine)[half::2]))
