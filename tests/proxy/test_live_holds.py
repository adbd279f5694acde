"""A request keeps its hold for as long as it runs, whatever METERING_HOLD_TTL_S says: before the
first byte, while a non-streaming answer is made, while NIM is polled. Only the holds of a
process that died are swept."""

import threading
import time
import uuid
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import event, select

from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.views import new_budget
from metering.db import Database, utcnow
from metering.jobs import expire_holds, sweep_interval_s
from metering.models import Budget, Hold
from metering.proxy.live import BATCH, LiveHolds
from tests.budgets.conftest import fresh_db, fresh_pg, fresh_sqlite  # noqa: F401 - fixtures
from tests.proxy.conftest import hold_spec, provider_entry, serving, sim_record

TTL_S = 2
WAIT_MS = 3 * TTL_S * 1000  # the upstream's first byte comes three hold TTLs late
# While the upstream waits, a hold the sweeper could take would be gone by then.
LOOK_AFTER_S = TTL_S + 2 * sweep_interval_s(TTL_S)
PRICES = {"gpt-slow": ("0.15", "0.60"), "nim-slow": ("0.32", "1.25")}


def slow_catalog(sim) -> dict:
    providers = {
        "slow-openai": provider_entry(sim.base_url("openai"), "openai", timeout_s=30),
        "slow-nim": provider_entry(
            sim.base_url("nim"), "nim", timeout_s=30, poll_interval_s=1, poll_timeout_s=60
        ),
    }
    models = [
        {
            "name": name,
            "provider": provider,
            "upstream_model": upstream,
            "input_usd_per_mtok": PRICES[name][0],
            "output_usd_per_mtok": PRICES[name][1],
            "max_output_tokens": 4096,
        }
        for name, provider, upstream in (
            ("gpt-slow", "slow-openai", "sim/gpt"),
            ("nim-slow", "slow-nim", "minimaxai/minimax-m2.5"),
        )
    ]
    return {"providers": providers, "models": models}


@pytest.fixture(scope="module")
def proxy(api, sim):
    assert sweep_interval_s(TTL_S) == 1.0  # the sweeper runs several times while we wait
    with serving(api, slow_catalog(sim), hold_ttl_s=TTL_S) as own:
        yield own


def cost(model: str, prompt: int, completion: int) -> Decimal:
    price_in, price_out = (Decimal(p) for p in PRICES[model])
    return (prompt * price_in + completion * price_out) / Decimal(1_000_000)


def in_flight(proxy, sim, token: dict, marker: str, send):
    """Run send() in a thread; once the upstream has the request and the hold has outlived its
    TTL, check nothing was charged yet and the hold is still reserved. Returns send()'s result."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", send()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not any(marker in str(r["received"]) for r in sim.log()):
        assert time.monotonic() < deadline, "the request did not reach the upstream"
        time.sleep(0.05)
    # The hold outlives its TTL while the sweeper runs, and is looked at all along.
    watched_until = time.monotonic() + LOOK_AFTER_S
    while True:
        assert proxy.events(token_id=token["id"]) == []  # not swept as unsettled
        budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
        assert Decimal(budget["reserved"]) > 0
        if time.monotonic() >= watched_until:
            break
        time.sleep(0.25)
    thread.join(60)
    return result["value"]


def assert_settled_as_reported(proxy, token: dict, record: dict, model: str, stream: bool):
    events = proxy.events(token_id=token["id"])
    assert len(events) == 1
    event = events[0]
    assert (event["status"], event["usage_source"]) == ("ok", "reported")
    assert event["stream"] is stream
    usage = record["usage"]
    assert (event["prompt_tokens"], event["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert Decimal(event["cost"]) == cost(model, usage["prompt_tokens"], usage["completion_tokens"])
    budget = proxy.ok("GET", f"/v1/tokens/{token['id']}/budget")
    assert Decimal(budget["reserved"]) == 0
    assert Decimal(budget["spent"]) == Decimal(event["cost"])


def test_stream_whose_first_byte_comes_after_the_hold_ttl_is_billed_as_reported(proxy, sim):
    _, _, token = proxy.principal(token_limit="1")
    marker = f"late {uuid.uuid4().hex}"
    body = {
        "model": "gpt-slow",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"{marker} sim:tokens=9 sim:wait_ms={WAIT_MS}"}],
    }
    response = in_flight(
        proxy,
        sim,
        token,
        marker,
        lambda: httpx.post(
            f"{proxy.url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {token['token']}"},
            timeout=60,
        ),
    )
    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")
    upstream_id = response.text.split('"id": "', 1)[1].split('"', 1)[0]
    record = sim_record(sim, upstream_id)
    assert record["usage"]["completion_tokens"] == 9
    assert_settled_as_reported(proxy, token, record, "gpt-slow", stream=True)


def test_non_streaming_answer_slower_than_the_hold_ttl_is_billed_as_reported(proxy, sim):
    _, _, token = proxy.principal(token_limit="1")
    client = proxy.openai(token["token"], timeout=60)
    marker = f"slow {uuid.uuid4().hex}"
    completion = in_flight(
        proxy,
        sim,
        token,
        marker,
        lambda: client.chat.completions.create(
            model="gpt-slow",
            messages=[{"role": "user", "content": f"{marker} sim:tokens=11 sim:wait_ms={WAIT_MS}"}],
        ),
    )
    assert completion.usage.completion_tokens == 11
    record = sim_record(sim, completion.id)
    assert_settled_as_reported(proxy, token, record, "gpt-slow", stream=False)


def test_nim_polled_longer_than_the_hold_ttl_is_billed_as_reported(proxy, sim):
    _, _, token = proxy.principal(token_limit="1")
    client = proxy.openai(token["token"], timeout=60)
    polls = 3 * TTL_S  # one second apart
    marker = f"polled {uuid.uuid4().hex}"
    completion = in_flight(
        proxy,
        sim,
        token,
        marker,
        lambda: client.chat.completions.create(
            model="nim-slow",
            messages=[{"role": "user", "content": f"{marker} sim:tokens=7 sim:pending={polls}"}],
        ),
    )
    assert completion.usage.completion_tokens == 7
    record = sim_record(sim, completion.id)
    assert_settled_as_reported(proxy, token, record, "nim-slow", stream=False)


# --- the registry, on the database directly -----------------------------------------------


@pytest.mark.anyio
async def test_live_holds_are_extended_in_one_statement_and_never_swept(fresh_db):  # noqa: F811
    db = Database(fresh_db, 4)
    try:
        suffix = uuid.uuid4().hex[:12]
        subjects = {
            "token": f"tok_{suffix}",
            "user": f"user_{suffix}",
            "team": f"team_{suffix}",
        }
        async with db.transaction() as session:
            for scope, subject in subjects.items():
                session.add(new_budget(subject, scope, None, "never", utcnow()))
        # Every hold has already expired; all but one belong to requests still running.
        runtime = BudgetRuntime(db)
        held = [await reserve(runtime, hold_spec(subjects), ttl_s=0) for _ in range(BATCH + 2)]
        live = LiveHolds()
        for reservation in held[1:]:
            live.add(reservation.hold_id)
        updates = []

        def count(conn, cursor, statement, *args) -> None:
            if statement.lstrip().upper().startswith("UPDATE HOLDS"):
                updates.append(statement)

        event.listen(db.engine.sync_engine, "before_cursor_execute", count)
        assert await live.refresh(db, ttl_s=TTL_S) == BATCH + 1
        event.remove(db.engine.sync_engine, "before_cursor_execute", count)
        assert len(updates) == 2  # one per batch of BATCH holds

        assert await expire_holds(db) == 1  # only the dead request's hold
        async with db.sessions() as session:
            left = set(await session.scalars(select(Hold.id)))
        assert left == {r.hold_id for r in held[1:]}
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_holds_in_doubt_are_released_and_nothing_is_charged(fresh_db):  # noqa: F811
    # A hold committed whose answer was lost (the connection cut mid-commit), and one never
    # written: both in doubt for requests answered 503. The first is released, its credit
    # back; the second is not there; nothing is charged, nothing is left to sweep.
    db = Database(fresh_db, 4)
    try:
        suffix = uuid.uuid4().hex[:12]
        subjects = {"token": f"tok_{suffix}", "user": f"user_{suffix}", "team": f"team_{suffix}"}
        async with db.transaction() as session:
            for scope, subject in subjects.items():
                session.add(new_budget(subject, scope, 10**12, "never", utcnow()))
        written = await reserve(BudgetRuntime(db), hold_spec(subjects), ttl_s=0)
        async with db.sessions() as session:
            reserved = set(await session.scalars(select(Budget.reserved)))
        assert reserved == {written.amount}
        live = LiveHolds()
        live.doubt(written.hold_id, rates_too=True)
        live.doubt(hold_spec(subjects).hold_id, rates_too=True)
        assert live.doubtful == 2
        assert await live.release_doubtful(db) == 1
        assert live.doubtful == 0
        async with db.sessions() as session:
            assert list(await session.scalars(select(Hold.id))) == []
            rows = list(await session.execute(select(Budget.spent, Budget.reserved)))
        assert [tuple(row) for row in rows] == [(0, 0)] * 3
        assert await expire_holds(db) == 0  # nothing for the sweeper to charge
    finally:
        await db.dispose()
