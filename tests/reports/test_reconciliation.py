"""Reconciliation: a generated provider export with planted differences (missing both ways, cost
and token mismatches) is compared with the ledger, and exactly the planted ones are found."""

import asyncio
import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from metering.db import Database
from metering.money import format_usd
from tests.reports.test_spend import hold_spec, ledger_event, reserve_and_settle

HEADER = "date,provider,model,prompt_tokens,completion_tokens,cost,upstream_id"


class Scenario:
    """Ledger events of a provider of this test's own on three days, and an export of them with
    planted differences. Rows are day/model groups; the expected status of each is known."""

    def __init__(self, api) -> None:
        self.api = api
        self.provider = f"prov-{uuid.uuid4().hex[:8]}"
        day = datetime(2025, 6, 1, tzinfo=UTC) + timedelta(days=uuid.uuid4().int % 200)
        self.days = [day + timedelta(days=i) for i in range(4)]  # the 4th is not in the file
        self.export: list[list[str]] = []
        self.rows: dict[tuple[str, str], str] = {}  # (day, model) -> expected status
        self.requests: dict[str, str] = {}  # upstream id -> expected status
        team, user, token = api.principal()
        self.who = (team["id"], user["id"], token["id"])

    def route(self, model: str):
        return ("recon-model", self.provider, model, 1_000_000, 500_000, 4_000_000)

    def event(self, day: int, model: str, prompt: int, completion: int, **fields) -> dict:
        spec = hold_spec(*self.who, self.route(model))
        created = self.days[day] + timedelta(hours=3, seconds=len(self.requests) + 1)
        return spec, ledger_event(spec, created, prompt, completion, **fields)

    def line(self, event: dict, **changes) -> None:
        row = {
            "date": event["created_at"].date().isoformat(),
            "provider": self.provider,
            "model": event["upstream_model"],
            "prompt_tokens": event["prompt_tokens"],
            "completion_tokens": event["completion_tokens"],
            "cost": format_usd(event["cost"]),
            "upstream_id": event["upstream_id"] or "",
        }
        row.update(changes)
        self.export.append([str(row[c]) for c in HEADER.split(",")])

    def csv(self) -> bytes:
        return ("\n".join([HEADER, *(",".join(r) for r in self.export)]) + "\n").encode()

    def build(self) -> "Scenario":
        pending = []

        def add(day, model, prompt, completion, status=None, **fields):
            upstream_id = fields.pop("upstream_id", f"chatcmpl-{uuid.uuid4().hex[:16]}")
            spec, event = self.event(day, model, prompt, completion, upstream_id=upstream_id)
            event.update(fields)
            pending.append((spec, event))
            if status and upstream_id:
                self.requests[upstream_id] = status
            return event

        # Day 0, up/m1: all equal (one cost off by 1e-5 relative, inside the tolerance), one
        # estimated event, one unbilled failed attempt (no tokens, no cost): matched.
        for i in range(4):
            self.line(add(0, "up/m1", 1000 + i, 200 + i, "matched"))
        e = add(0, "up/m1", 5000, 1000, "matched")
        self.line(e, cost=str(Decimal(format_usd(e["cost"])) * Decimal("1.00001")))
        self.line(add(0, "up/m1", 700, 70, "matched", usage_source="estimated"))
        add(0, "up/m1", 0, 0, upstream_id=None, status="upstream_error", cost=0, http_status=500)
        self.rows[("0", "up/m1")] = "matched"
        # Day 0, up/m2: one request's cost 1% higher at the provider; plus an unsettled event
        # (no upstream id): differs.
        for _ in range(3):
            self.line(add(0, "up/m2", 2000, 300, "matched"))
        e = add(0, "up/m2", 2000, 300, "differs")
        self.line(e, cost=str(Decimal(format_usd(e["cost"])) * Decimal("1.01")))
        add(0, "up/m2", 0, 0, upstream_id=None, usage_source="unsettled", cost=9_000_000)
        self.rows[("0", "up/m2")] = "differs"
        # Day 1, up/m1: the provider counted 500 more completion tokens on one request: differs.
        for _ in range(2):
            self.line(add(1, "up/m1", 1500, 100, "matched"))
        e = add(1, "up/m1", 1500, 100, "differs")
        self.line(e, completion_tokens=600)
        self.rows[("1", "up/m1")] = "differs"
        # Day 1, up/m2: not in the export at all: missing_in_provider (and each request).
        for _ in range(3):
            add(1, "up/m2", 900, 90, "missing_in_provider")
        self.rows[("1", "up/m2")] = "missing_in_provider"
        # Day 2, up/m3: only the provider has it: missing_in_ledger.
        for _ in range(2):
            upstream_id = f"ghost-{uuid.uuid4().hex[:10]}"
            self.requests[upstream_id] = "missing_in_ledger"
            self.export.append(
                [
                    self.days[2].date().isoformat(),
                    self.provider,
                    "up/m3",
                    "100",
                    "10",
                    "0.00014",
                    upstream_id,
                ]
            )
        self.rows[("2", "up/m3")] = "missing_in_ledger"
        # Day 3 is not in the file: its events are not compared.
        add(3, "up/m1", 100, 10)

        async def settle_all() -> None:
            db = Database(self.api.settings.database_url, pool_size=2)
            try:
                for spec, event in pending:
                    await reserve_and_settle(db, spec, event)
            finally:
                await db.dispose()

        asyncio.run(settle_all())
        self.rows = {
            (self.days[int(day)].date().isoformat(), model): status
            for (day, model), status in self.rows.items()
        }
        return self


@pytest.fixture
def scenario(api) -> Scenario:
    return Scenario(api).build()


def reconcile(api, scenario, body: bytes | None = None, expect=201, **params) -> dict:
    response = api.request(
        "POST",
        "/v1/reconciliations",
        params={"provider": scenario.provider, **params},
        content=scenario.csv() if body is None else body,
        headers={"content-type": "text/csv"},
    )
    assert response.status_code == expect, response.text
    return response.json()


def assert_finds_exactly_the_planted(result: dict, scenario: Scenario) -> None:
    assert result["provider"] == scenario.provider
    assert {(r["day"], r["model"]): r["status"] for r in result["rows"]} == scenario.rows
    assert result["summary"] == {
        "matched": 1,
        "differs": 2,
        "missing_in_ledger": 1,
        "missing_in_provider": 1,
    }
    assert {r["upstream_id"]: r["status"] for r in result["requests"]} == scenario.requests
    assert result["request_summary"] == {
        "matched": 11,
        "differs": 2,
        "missing_in_ledger": 2,
        "missing_in_provider": 3,
    }


def test_an_export_with_planted_differences_finds_exactly_them(api, scenario):
    result = reconcile(api, scenario)
    assert_finds_exactly_the_planted(result, scenario)
    assert result["tolerance"] == "0.001"
    assert result["id"].startswith("rec_")
    rows = {(r["day"], r["model"]): r for r in result["rows"]}
    day0, day1, day2 = (d.date().isoformat() for d in scenario.days[:3])
    tokens = rows[(day1, "up/m1")]
    assert tokens["difference"]["completion_tokens"] == 500
    assert tokens["difference"]["prompt_tokens"] == 0
    assert tokens["ledger"]["completion_tokens"] == 300
    assert tokens["provider_side"]["completion_tokens"] == 800
    missing = rows[(day2, "up/m3")]
    assert missing["ledger"] is None
    side = missing["provider_side"]
    assert (side["requests"], side["prompt_tokens"], side["completion_tokens"]) == (2, 200, 20)
    assert Decimal(side["cost"]) == Decimal("0.00028")
    assert missing["difference"]["completion_tokens"] == 20  # a missing side counts as zero
    gone = rows[(day1, "up/m2")]
    assert gone["provider_side"] is None
    assert gone["ledger"]["requests"] == 3
    # Ledger cost: 900 x 1.00 + 90 x 4.00 USD per 1M tokens, three times.
    assert Decimal(gone["ledger"]["cost"]) == Decimal("0.00378")
    # The estimated and unsettled events are called out where they are; the unbilled attempt
    # is in no one's export and is left out.
    matched = rows[(day0, "up/m1")]
    assert (matched["estimated_events"], matched["unsettled_events"]) == (1, 0)
    assert matched["ledger"]["requests"] == 6
    differs = rows[(day0, "up/m2")]
    assert (differs["estimated_events"], differs["unsettled_events"]) == (0, 1)
    assert Decimal(differs["difference"]["cost"]) == Decimal(
        differs["provider_side"]["cost"]
    ) - Decimal(differs["ledger"]["cost"])
    assert (result["estimated_events"], result["unsettled_events"]) == (1, 1)
    assert "estimated" in result["note"] and "unsettled" in result["note"]
    assert scenario.days[3].date().isoformat() not in {r["day"] for r in result["rows"]}


def test_a_stored_reconciliation_is_returned_again(api, scenario):
    result = reconcile(api, scenario)
    assert api.ok("GET", f"/v1/reconciliations/{result['id']}") == result
    missing = api.request("GET", "/v1/reconciliations/rec_nope")
    assert missing.status_code == 404


def test_the_export_may_come_as_a_multipart_file(api, scenario):
    response = api.request(
        "POST",
        "/v1/reconciliations",
        params={"provider": scenario.provider},
        files={"file": ("export.csv", scenario.csv(), "text/csv")},
    )
    assert response.status_code == 201, response.text
    assert_finds_exactly_the_planted(response.json(), scenario)


def test_a_wider_tolerance_accepts_the_small_cost_difference(api, scenario):
    result = reconcile(api, scenario, tolerance="0.02")
    day0 = scenario.days[0].date().isoformat()
    statuses = {(r["day"], r["model"]): r["status"] for r in result["rows"]}
    # up/m2 still differs by its unsettled event's cost; the request itself now matches.
    assert statuses[(day0, "up/m1")] == "matched"
    assert result["request_summary"]["differs"] == 1


@pytest.mark.parametrize(
    ("body", "line"),
    [
        (HEADER + "\n2025-01-01,{p},m,10,5,0.001,a\n2025-01-01,{p},m,ten,5,0.001,b\n", 3),
        (HEADER + "\n2025-13-01,{p},m,10,5,0.001,a\n", 2),
        (HEADER + "\n2025-01-01,{p},m,10,5,-1,a\n", 2),
        (HEADER + "\n2025-01-01,{p},m,10,5\n", 2),
        (HEADER + "\n2025-01-01,{p},m,10,5,0.1,a\n\n2025-01-01,other,m,1,1,0.1,c\n", 4),
        ("date,provider,model,prompt_tokens,cost\n2025-01-01,{p},m,10,0.001\n", 1),
        (HEADER + '\n2025-01-01,{p},m,10,5,0.001,"a\n', 2),
    ],
)
def test_a_malformed_export_is_400_naming_the_line(api, scenario, body, line):
    text = body.replace("{p}", scenario.provider).encode()
    error = reconcile(api, scenario, text, expect=400)["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(f"line {line}:"), error["message"]


def test_reconciliations_are_for_the_admin_only(api, scenario):
    _, _, token = api.principal()
    response = api.request(
        "POST",
        "/v1/reconciliations",
        key=token["token"],
        params={"provider": scenario.provider},
        content=scenario.csv(),
    )
    assert response.status_code == 403


def test_metering_reconcile_reads_a_file(api, scenario, tmp_path):
    export = tmp_path / "export.csv"
    export.write_bytes(scenario.csv())
    env = {**os.environ, "METERING_DATABASE_URL": api.settings.database_url}
    command = [sys.executable, "-m", "metering.cli", "reconcile", str(export)]
    done = subprocess.run(
        [*command, "--provider", scenario.provider],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert_finds_exactly_the_planted(result, scenario)
    assert api.ok("GET", f"/v1/reconciliations/{result['id']}") == result
    export.write_text(HEADER + "\n2025-01-01,x,m,1,1,abc,z\n")
    bad = subprocess.run(
        [*command, "--provider", "x"], env=env, cwd=tmp_path, capture_output=True, timeout=60
    )
    assert bad.returncode == 2
    assert b"line 2: cost" in bad.stderr


def test_a_reconciliation_that_differs_is_an_alert(api, scenario):
    result = reconcile(api, scenario)
    found = api.ok(
        "GET", "/v1/alerts", params={"type": "reconciliation.differs", "subject_id": result["id"]}
    )["data"]
    assert len(found) == 1
    data = found[0]["data"]
    assert data["scope"] == "reconciliation" and data["provider"] == scenario.provider
    assert (data["differs"], data["missing_in_ledger"], data["missing_in_provider"]) == (
        2 + 2,
        1 + 2,
        1 + 3,
    )
