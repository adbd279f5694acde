"""Per-run ceilings: x-metering-run with x-metering-run-budget holds every request of a run
against the run's own budget (402, x-budget-scope: run, past it), and x-metering-max-cost
clamps a request's max_tokens or refuses it as a credit limit does."""

import asyncio
import threading
import uuid
from decimal import Decimal

import openai
import pytest
from sqlalchemy import select

from metering.budgets.runs import expire_runs
from metering.db import Database, utcnow
from metering.models import Run
from tests.budgets.conftest import pico, query

MESSAGES = [{"role": "user", "content": "count to three"}]


def run_headers(run_id: str, budget: str | None = None, **more) -> dict:
    headers = {"x-metering-run": run_id, **more}
    if budget is not None:
        headers["x-metering-run-budget"] = budget
    return headers


def call(client, headers: dict, **fields):
    """(status, headers) of one completion through the proxy."""
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="gpt-sim", messages=MESSAGES, extra_headers=headers, **fields
        )
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.headers
    return raw.http_response.status_code, raw.http_response.headers


def refusals(api, token_id: str, **params) -> list[dict]:
    found = api.ok("GET", "/v1/refusals", params={"token_id": token_id, **params})
    return found["data"]


def run_row(api, team_id: str, run_id: str):
    rows = query(
        api.settings.database_url,
        select(Run.credit_limit, Run.spent, Run.reserved).where(
            Run.team_id == team_id, Run.id == run_id
        ),
    )
    return rows[0] if rows else None


def test_a_run_of_20_concurrent_requests_never_passes_its_budget(api):
    team, _, token = api.principal()
    client = api.openai(token["token"])
    run_id, budget = f"run-{uuid.uuid4().hex[:8]}", "0.0002"
    answers: list[tuple[int, object]] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def one() -> None:
        start.wait()
        answer = call(client, run_headers(run_id, budget), max_tokens=100)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = sorted(status for status, _ in answers)
    assert set(statuses) == {200, 402}, statuses
    for status, headers in answers:
        if status == 402:
            assert headers["x-budget-scope"] == "run"
    events = api.events(token_id=token["id"])
    assert len(events) == statuses.count(200)
    assert {e["run_id"] for e in events} == {run_id}
    spent = sum(pico(e["cost"]) for e in events)
    assert 0 < spent <= pico(budget)
    row = run_row(api, team["id"], run_id)
    assert (row.credit_limit, row.spent, row.reserved) == (pico(budget), spent, 0)
    # Each 402 is a refusal of the run's budget, kept with the run's id; none is a budget alert.
    refused = refusals(api, token["id"])
    assert len(refused) == statuses.count(402)
    assert {(r["reason"], r["scope"], r["subject_id"]) for r in refused} == {
        ("budget", "run", run_id)
    }
    assert not [
        e
        for e in api.ok("GET", "/v1/alerts", params={"limit": 1000})["data"]
        if e["data"].get("subject_id") == run_id
    ]
    # The run goes on: its budget is the first request's, whatever a later one sends.
    status, headers = call(client, run_headers(run_id, "5"), max_tokens=100)
    if status == 402:
        assert headers["x-budget-scope"] == "run"
    assert run_row(api, team["id"], run_id).credit_limit == pico(budget)


def test_max_cost_clamps_max_tokens_or_refuses(api):
    _, _, token = api.principal()
    client = api.openai(token["token"])
    # No max_tokens: the allowance is lowered until the hold fits the ceiling.
    status, headers = call(client, {"x-metering-max-cost": "0.0001"})
    assert status == 200
    clamped = int(headers["x-max-tokens-clamped"])
    assert 1 <= clamped < 4096
    (event,) = api.events(token_id=token["id"])
    assert Decimal(event["cost"]) <= Decimal("0.0001")
    # A max_tokens whose hold is above the ceiling: refused, as a credit limit refuses it.
    status, headers = call(client, {"x-metering-max-cost": "0.0001"}, max_tokens=4000)
    assert status == 402 and headers["x-budget-scope"] == "request"
    # A ceiling below even the prompt: refused without max_tokens too.
    status, headers = call(client, {"x-metering-max-cost": "0.000000000001"})
    assert status == 402 and headers["x-budget-scope"] == "request"
    # A ceiling that covers the request changes nothing.
    status, headers = call(client, {"x-metering-max-cost": "1"}, max_tokens=50)
    assert status == 200 and "x-max-tokens-clamped" not in headers
    assert len(api.events(token_id=token["id"])) == 2
    refused = refusals(api, token["id"])
    assert [(r["reason"], r["scope"], r["http_status"]) for r in refused] == [
        ("budget", "request", 402)
    ] * 2
    assert refusals(api, token["id"], scope="request") == refused


def test_bad_ceiling_headers_are_400(api):
    _, _, token = api.principal()
    client = api.openai(token["token"])
    for headers in (
        {"x-metering-max-cost": "-1"},
        {"x-metering-max-cost": "0"},
        {"x-metering-max-cost": "ten dollars"},
        {"x-metering-max-cost": "0.1234567890123"},
        {"x-metering-run-budget": "1"},  # without a run
        run_headers("bad id with spaces", "1"),
        run_headers("x" * 101, "1"),
        run_headers(f"never-started-{uuid.uuid4().hex[:6]}"),  # no budget: unknown run
    ):
        status, _ = call(client, headers, max_tokens=10)
        assert status == 400, headers
    assert api.events(token_id=token["id"]) == []


def test_an_idle_run_is_forgotten(api):
    team, _, token = api.principal()
    client = api.openai(token["token"])
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    assert call(client, run_headers(run_id, "1"), max_tokens=10)[0] == 200
    assert call(client, run_headers(run_id), max_tokens=10)[0] == 200  # known: no budget needed

    async def expire() -> int:
        db = Database(api.settings.database_url, pool_size=1)
        try:
            return await expire_runs(db, idle_s=0)
        finally:
            await db.dispose()

    assert asyncio.run(expire()) >= 1
    assert run_row(api, team["id"], run_id) is None
    assert call(client, run_headers(run_id), max_tokens=10)[0] == 400
    assert call(client, run_headers(run_id, "1"), max_tokens=10)[0] == 200  # a new run
    assert run_row(api, team["id"], run_id).spent > 0


@pytest.mark.anyio
async def test_a_runs_hold_swept_and_settled_late_charges_the_run_its_real_cost(fresh_db):
    """The sweeper charges a run's expired hold in full (its event names the run); the
    request's late settle gives the run back the difference, as it does its budgets."""
    from dataclasses import replace

    from metering.budgets.reserve import reserve
    from metering.budgets.runs import RunKey
    from metering.budgets.runtime import BudgetRuntime
    from metering.budgets.settle_queue import settle
    from metering.jobs import expire_holds
    from metering.ledger.tables import LedgerEvent
    from tests.budgets.test_crash_recovery import _add_budgets, _event, _spec, _subjects

    db = Database(fresh_db, 2)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        run = RunKey(subjects["team"], "late-run", pico("0.01"), 3600)
        spec = replace(_spec(subjects), run=run)
        spec = replace(spec, billing=replace(spec.billing, run_id=run.run_id))
        held = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 1
        async with db.sessions() as session:
            row = (await session.execute(select(Run).where(Run.id == run.run_id))).scalar_one()
            assert (row.spent, row.reserved) == (held.amount, 0)
            placeholder = await session.get(LedgerEvent, held.hold_id)
            assert placeholder.run_id == run.run_id and placeholder.cost == held.amount
        late = _event(spec, 3, id=held.hold_id)
        assert late.run_id == run.run_id
        assert await settle(runtime.settles, late) is True
        async with db.sessions() as session:
            row = (await session.execute(select(Run).where(Run.id == run.run_id))).scalar_one()
            assert (row.spent, row.reserved) == (late.cost, 0)
    finally:
        await db.dispose()
