"""Schemathesis's own command (`st run`, pinned in requirements-test.lock) against a running
server: every check (`--checks all`), the coverage, fuzzing and stateful phases, one credential,
the operations that credential reaches. Used by tests/fuzz/test_openapi_fuzz.py (CI's bounded
run) and, with a bigger budget, by `make fuzz`.

The configuration is written from the server's own document: the operations whose 400 declares
data rules (metering.errors.DATA_RULES) have positive_data_acceptance take their 400, and the
hooks' check (tests/fuzz/hooks.py) narrows that to the declared rules."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
ST = Path(sys.executable).with_name("st")
DATA_RULES = "x-data-rules"
PHASES = "coverage,fuzzing,stateful"
# positive_data_acceptance's own default, and 400 for the operations with data rules.
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]


def document(url: str) -> dict:
    return httpx.get(f"{url}/openapi.json", timeout=30).raise_for_status().json()


def with_data_rules(schema: dict) -> list[str]:
    """The operation ids whose 400 declares data rules."""
    return sorted(
        operation["operationId"]
        for operations in schema["paths"].values()
        for operation in operations.values()
        if operation.get("responses", {}).get("400", {}).get(DATA_RULES)
    )


def linked(schema: dict, operation_ids: list[str]) -> bool:
    """Whether a response of one of the operations links to another of them (the stateful
    phase has a sequence to follow)."""
    ids = set(operation_ids)
    for operations in schema["paths"].values():
        for operation in operations.values():
            if operation["operationId"] not in ids:
                continue
            for response in operation.get("responses", {}).values():
                if any(link["operationId"] in ids for link in response.get("links", {}).values()):
                    return True
    return False


def config(schema: dict, *, examples: int, steps: int) -> str:
    """schemathesis.toml for a run against `schema`'s server."""
    ids = json.dumps(with_data_rules(schema))
    accepted = json.dumps([*ACCEPTED, "400"])
    return f"""\
# Written by tests/fuzz/runner.py from the server's /openapi.json.
seed = 20261204
suppress-health-check = ["all"]

# no crash files kept in the checkout: a failure prints its curl command
[cache]
enabled = false

[generation]
max-examples = {examples}
database = "none"

[phases.stateful]
max-steps = {steps}

[[operations]]
include-operation-id = {ids}
checks.positive_data_acceptance.expected-statuses = {accepted}

# DELETE /v1/tokens/{{token_id}} revokes: the token's own reads answer it still, revoked.
[[operations]]
include-path-regex = "^/v1/tokens/[{{]token_id[}}]"
include-method = "GET"
checks.use_after_free.enabled = false
"""


def run(
    url: str,
    key: str,
    operation_ids: list[str],
    workdir: Path,
    *,
    examples: int,
    steps: int,
    workers: int = 1,
    phases: str = PHASES,
) -> subprocess.CompletedProcess:
    """One `st run` as `key` over `operation_ids`; its exit status 0 when nothing failed."""
    schema = document(url)
    if not linked(schema, operation_ids):  # nothing to chain: the stateful phase has no links
        phases = ",".join(phase for phase in phases.split(",") if phase != "stateful")
    toml = config(schema, examples=examples, steps=steps)
    (workdir / "schemathesis.toml").write_text(toml)
    command = [
        str(ST),
        "--config-file",
        str(workdir / "schemathesis.toml"),
        "--no-color",
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {key}",
        "--checks",
        "all",
        "--phases",
        phases,
        "--workers",
        str(workers),
        "--no-shrink",
        "--output-truncate",
        "false",
        "--warnings",
        "off",
    ]
    for operation_id in operation_ids:
        command += ["--include-operation-id", operation_id]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz.hooks"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
