"""Holds left by a replica that died are charged once, by whichever replica sweeps first; closed
windows are recorded once. A killed `metering serve` and the jobs called directly."""

import asyncio
import threading
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import func, select

from metering.budgets.reserve import HoldSpec, reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle import settle_in
from metering.budgets.settle_queue import settle
from metering.budgets.views import new_budget
from metering.clock import using
from metering.db import Database, utcnow
from metering.jobs import close_windows, expire_holds, sweep_interval_s
from metering.ledger.charge import Allowance, Usage
from metering.ledger.event import Event
from metering.ledger.outcome import Attribution, Outcome, event_for
from metering.ledger.tables import LedgerEvent
from metering.models import Budget, BudgetWindow, Hold
from metering.money import usd_to_pico
from metering.timefmt import parse_rfc3339
from tests.budgets.conftest import (
    budget,
    chat,
    chat_body,
    holds_of,
    marker,
    pico,
    sim_records,
    usd,
    wait_for,
)

STREAMS = 10
COMPLETED = 2


def _stream_until_cut(url: str, key: str, body: bytes, started: threading.Event) -> None:
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream(
                "POST",
                f"{url}/v1/chat/completions",
                content=body,
                headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            ) as response,
        ):
            for _ in response.iter_raw():
                started.set()
    except httpx.HTTPError:
        pass  # the replica was killed under it


@pytest.mark.postgres
def test_killed_replica_holds_are_charged_by_postgres_survivor(fresh_pg, serve, sim):
    ttl = 2
    first = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = first.api()
    team, user, token = admin.principal(token_limit="1", user_limit="1", team_limit="1")
    key, tag = token["token"], marker()

    for i in range(COMPLETED):
        done = chat(admin, key, f"crash {tag} done {i} sim:tokens=5", max_tokens=5)
        assert done.status_code == 200, done.text

    threads = []
    for i in range(STREAMS):
        body = chat_body(
            f"crash {tag} stream {i} sim:delay_ms=200 sim:chunks=30 sim:tokens=60", stream=True
        )
        started = threading.Event()
        thread = threading.Thread(
            target=_stream_until_cut, args=(first.url, key, body, started), daemon=True
        )
        thread.start()
        threads.append((thread, started))
    for _, started in threads:
        assert started.wait(10), "a stream did not start"
    # Every stream is under way at the upstream, and holds its credit.
    wait_for(
        lambda: (
            len([r for r in sim_records(sim, tag) if r["delivered_chunks"] >= 1])
            == COMPLETED + STREAMS
        ),
        message="all requests at the upstream",
    )
    holds = {row.id: row.amount for row in holds_of(fresh_pg, token["id"])}
    assert len(holds) == STREAMS
    first.kill()
    killed_at = utcnow()
    for thread, _ in threads:
        thread.join(10)
    # Nobody charged them yet (the dead replica's sweeper had no time, 2 s TTL).
    assert len(holds_of(fresh_pg, token["id"])) == STREAMS

    second = serve(fresh_pg, METERING_HOLD_TTL_S=str(ttl))
    admin = second.api()
    wait_for(
        lambda: not holds_of(fresh_pg, token["id"]),
        timeout=ttl + 4 * sweep_interval_s(ttl) + 5,
        interval=0.2,
        message="the survivor charging the expired holds",
    )

    events = admin.events(token_id=token["id"])
    received = sim_records(sim, tag)
    assert len(received) == COMPLETED + STREAMS
    assert len(events) == len(received)  # one event per request the upstream received
    assert len({e["id"] for e in events}) == len(events)
    unsettled = {e["id"]: e for e in events if e["usage_source"] == "unsettled"}
    assert set(unsettled) == set(holds)
    for hold_id, event in unsettled.items():
        assert pico(event["cost"]) == holds[hold_id]  # the whole hold
        assert event["stream"] is True
        assert parse_rfc3339(event["created_at"]) >= killed_at
    settled = [e for e in events if e["id"] not in holds]
    assert len(settled) == COMPLETED
    assert all(e["usage_source"] == "reported" and e["status"] == "ok" for e in settled)

    total = sum(usd(e["cost"]) for e in events)
    for scope, subject in (("token", token["id"]), ("user", user["id"]), ("team", team["id"])):
        status = budget(admin, scope, subject)
        assert usd(status["reserved"]) == 0, status
        assert usd(status["spent"]) == total, status
        assert usd(status["remaining"]) == Decimal(1) - total
    # The survivor serves the same budgets.
    assert chat(admin, key, f"after {tag}", max_tokens=5).status_code == 200


# --- the jobs, called directly ------------------------------------------------------------


def _subjects() -> dict[str, str]:
    suffix = uuid.uuid4().hex[:12]
    return {"token": f"tok_{suffix}", "user": f"user_{suffix}", "team": f"team_{suffix}"}


def _spec(subjects: dict[str, str], max_tokens: int = 50) -> HoldSpec:
    billing = Attribution(
        id=f"req_{uuid.uuid4().hex}",
        token_id=subjects["token"],
        user_id=subjects["user"],
        team_id=subjects["team"],
        model="gpt-sim",
        provider="sim-openai",
        upstream_model="sim/gpt",
        stream=False,
        input_price=150_000,
        cached_price=75_000,
        output_price=600_000,
        prompt_bound=100,
    )
    return HoldSpec(
        billing,
        prompt_cost=billing.prompt_cost(),
        token_cost=billing.output_price,
        max_tokens=max_tokens,
        model_max_output=4096,
    )


async def _add_budgets(db: Database, subjects: dict[str, str], limit: str, interval: str, at):
    async with db.transaction() as session:
        for scope, subject in subjects.items():
            session.add(new_budget(subject, scope, usd_to_pico(Decimal(limit)), interval, at))


async def _budgets(db: Database, subjects: dict[str, str]) -> dict[str, Budget]:
    async with db.sessions() as session:
        rows = await session.scalars(
            select(Budget).where(Budget.subject_id.in_(list(subjects.values())))
        )
        return {row.scope: row for row in rows}


async def _count(db: Database, model, *where) -> int:
    async with db.sessions() as session:
        return await session.scalar(select(func.count()).select_from(model).where(*where))


@pytest.mark.anyio
async def test_expire_holds_charges_each_hold_once(fresh_db):
    # Three "replicas": three engines on one database, sweeping at the same moment.
    replicas = [Database(fresh_db, 4) for _ in range(3)]
    db = replicas[0]
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        expired = [await reserve(runtime, _spec(subjects), ttl_s=0) for _ in range(5)]
        live = await reserve(runtime, _spec(subjects), ttl_s=3600)
        amounts = {r.hold_id: r.amount for r in expired}
        held = sum(amounts.values()) + live.amount
        assert {b.reserved for b in (await _budgets(db, subjects)).values()} == {held}

        results = await asyncio.gather(*(expire_holds(r) for r in replicas))
        assert sum(results) == len(expired)
        assert await asyncio.gather(*(expire_holds(r) for r in replicas)) == [0, 0, 0]

        async with db.sessions() as session:
            events = list(await session.scalars(select(LedgerEvent)))
        assert {e.id: e.cost for e in events} == amounts
        assert {e.usage_source for e in events} == {"unsettled"}
        assert {e.status for e in events} == {"unsettled"}
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == sum(amounts.values())
            assert row.reserved == live.amount
        assert await _count(db, Hold) == 1  # the live one is left alone

        # A late settle of a charged hold replaces its unsettled charge: still one event.
        late = _event(_spec(subjects), 3, id=expired[0].hold_id)
        assert await settle(runtime.settles, late) is True
        assert await settle(runtime.settles, replace(late)) is False
        assert await _count(db, LedgerEvent) == len(expired)
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == sum(amounts.values()) - amounts[late.id] + late.cost
    finally:
        for replica in replicas:
            await replica.dispose()


@pytest.mark.anyio
async def test_an_expired_holds_unsettled_event_keeps_its_end_user_and_tags(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        spec = _spec(subjects)
        tags = '{"feature":"search","tenant":"acme \\"eu\\""}'
        spec = replace(spec, billing=replace(spec.billing, end_user="customer-42", tags=tags))
        bare = await reserve(runtime, _spec(subjects), ttl_s=0)  # none: null and {}
        held = await reserve(runtime, spec, ttl_s=0)
        assert await expire_holds(db) == 2

        async with db.sessions() as session:
            events = {e.id: e for e in await session.scalars(select(LedgerEvent))}
        assert events[held.hold_id].status == "unsettled"
        assert events[held.hold_id].end_user == "customer-42"
        assert events[held.hold_id].tags == tags
        assert (events[bare.hold_id].end_user, events[bare.hold_id].tags) == (None, "{}")
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_close_windows_records_a_closed_window_once(fresh_db):
    replicas = [Database(fresh_db, 4) for _ in range(3)]
    db = replicas[0]
    try:
        subjects = _subjects()
        # 1m windows, the 6th current with 30 s to go: a slow machine cannot cross a boundary.
        created = utcnow() - timedelta(minutes=5.5)
        await _add_budgets(db, subjects, "1", "1m", created)
        never = {"token": f"tok_{uuid.uuid4().hex[:12]}"}
        await _add_budgets(db, never, "1", "never", created)
        async with db.transaction() as session:
            await session.execute(
                Budget.__table__.update()
                .where(Budget.subject_id.in_([*subjects.values(), never["token"]]))
                .values(spent=1234)
            )

        await asyncio.gather(*(close_windows(r) for r in replicas))
        assert await close_windows(db) == 0

        async with db.sessions() as session:
            windows = list(await session.scalars(select(BudgetWindow)))
        assert sorted(w.subject_id for w in windows) == sorted(subjects.values())
        for window in windows:
            assert window.window_start == created
            assert window.window_end == created + timedelta(minutes=1)
            assert window.spent == 1234
            assert window.credit_limit == usd_to_pico(Decimal(1))
        for row in (await _budgets(db, subjects)).values():
            assert row.spent == 0
            assert row.window_start == created + timedelta(minutes=5)
        assert (await _budgets(db, never))["token"].spent == 1234
    finally:
        for replica in replicas:
            await replica.dispose()


@pytest.mark.anyio
async def test_expired_hold_after_settle_is_not_charged(fresh_db):
    db = Database(fresh_db, 4)
    runtime = BudgetRuntime(db)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "daily", utcnow())
        spec = _spec(subjects)
        await reserve(runtime, spec, ttl_s=0)
        event = _event(spec, 7)
        assert event.cost == 10 * 150_000 + 7 * 600_000
        assert await settle(runtime.settles, event) is True
        assert await expire_holds(db) == 0
        for row in (await _budgets(db, subjects)).values():
            assert (row.spent, row.reserved) == (event.cost, 0)
        assert await _count(db, LedgerEvent) == 1
    finally:
        await db.dispose()


def _event(spec: HoldSpec, completion_tokens: int, **overrides) -> Event:
    """A complete ledger event for the hold, as the proxy writes it (prompt of 10 tokens)."""
    usage = Usage(
        prompt_tokens=10, completion_tokens=completion_tokens, total_tokens=10 + completion_tokens
    )
    event = event_for(
        spec.billing,
        Outcome(http_status=200, usage=usage),
        started_at=utcnow(),
        latency_ms=5,
        allowance=Allowance.of(spec.billing, None),
        prompt_tokens=lambda: 0,
        text_tokens=len,
    )
    return replace(event, **overrides)


class StoppedClock:
    """The wall clock stopped at one moment (durations still measured in real time)."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.mark.anyio
async def test_roll_keeps_a_settle_committed_while_it_waits(fresh_db):
    """A window closed (by the job, on another replica) while a settle for that window is in
    flight: the closed window's total includes the settle's cost, none of it is lost."""

    settler, closer = Database(fresh_db, 2), Database(fresh_db, 2)
    try:
        subjects = _subjects()
        created = utcnow() - timedelta(seconds=1.5)  # 1s windows: the first has ended
        # The job and the settle read a clock stopped inside the second window: however long the
        # machine takes, the window closed is the first and the one opened the second.
        with using(StoppedClock(created + timedelta(seconds=1.5))):
            await _add_budgets(settler, subjects, "1", "1s", created)
            spec = _spec(subjects)
            amount = spec.amount(50)
            async with settler.transaction() as session:
                session.add(
                    Hold(
                        id=spec.hold_id,
                        token_id=spec.billing.token_id,
                        user_id=spec.billing.user_id,
                        team_id=spec.billing.team_id,
                        amount=amount,
                        model=spec.billing.model,
                        provider=spec.billing.provider,
                        upstream_model=spec.billing.upstream_model,
                        stream=False,
                        input_price=spec.billing.input_price,
                        cached_price=spec.billing.cached_price,
                        output_price=spec.billing.output_price,
                        created_at=created,
                        expires_at=created + timedelta(hours=1),
                    )
                )
                await session.execute(
                    Budget.__table__.update()
                    .where(Budget.subject_id.in_(list(subjects.values())))
                    .values(reserved=amount)
                )
            # The request finished inside the first window; its settle is not committed yet.
            event = _event(spec, 11, created_at=created + timedelta(seconds=0.5))
            session = settler.sessions()
            transaction = await session.begin()
            assert await settle_in(session, event) is True
            job = asyncio.create_task(close_windows(closer))
            await asyncio.sleep(0.5)  # the job is now waiting for the settle's row locks
            await transaction.commit()
            await session.close()
            await asyncio.wait_for(job, 30)

            async with closer.sessions() as s:
                windows = {w.subject_id: w for w in await s.scalars(select(BudgetWindow))}
            assert set(windows) == set(subjects.values())
            for window in windows.values():
                assert window.window_start == created
                assert window.spent == event.cost > 0
            for row in (await _budgets(closer, subjects)).values():
                assert (row.spent, row.reserved) == (0, 0)
                assert row.window_start == created + timedelta(seconds=1)
    finally:
        await settler.dispose()
        await closer.dispose()
