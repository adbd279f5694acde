"""On PostgreSQL the holds of leased requests join the settle queue: one statement inserts the
holds and settles the settles that waited together. A hold it cannot insert (its lease returned
under the process) or a settle that passes a threshold keeps nothing of that statement; the
holds and the settles are then written apart, each as it would be alone."""

import asyncio

import pytest

from metering import migrate
from metering.budgets.leases import give_back
from metering.budgets.reserve import reserve
from metering.budgets.runtime import BudgetRuntime
from metering.budgets.settle_queue import settle
from metering.db import Database, utcnow
from metering.ledger.tables import LedgerEvent
from metering.models import Hold
from tests.budgets.conftest import fresh_pg  # noqa: F401
from tests.budgets.test_crash_recovery import (
    _add_budgets,
    _budgets,
    _count,
    _event,
    _spec,
    _subjects,
)
from tests.budgets.test_group_settle import _alerts, _rollup
from tests.budgets.writes import Writes


def _runtime(db: Database) -> BudgetRuntime:
    return BudgetRuntime(db, lease_share=8, hold_ttl_s=3600, trusted=lambda: True)


async def _spent(db: Database, subjects: dict) -> set[tuple[int, int]]:
    return {(row.spent, row.reserved) for row in (await _budgets(db, subjects)).values()}


@pytest.mark.anyio
async def test_holds_admitted_while_settles_wait_are_inserted_by_the_settles_statement(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 4)
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        specs = [_spec(subjects) for _ in range(6)]
        with Writes(db) as seen:
            first = [await reserve(runtime, spec, 3600, book) for spec in specs[:3]]
        assert all(r.claim is not None for r in first)  # against the lease, in memory
        # Each hold alone: no settle was waiting.
        assert seen.events == [] and len(seen.holds_alone) == 3
        events = [
            _event(spec, 7 + i, id=r.hold_id)
            for i, (spec, r) in enumerate(zip(specs, first, strict=False))
        ]
        # Three settles and three new holds submitted in one turn of the loop: the first
        # settle's statement may start alone, the rest wait together.
        with Writes(db) as seen:
            done = await asyncio.gather(
                *(settle(runtime.settles, e, r) for e, r in zip(events, first, strict=True)),
                *(reserve(runtime, spec, 3600, book) for spec in specs[3:]),
            )
        assert done[:3] == [True] * 3
        later = done[3:]
        assert all(r.claim is not None for r in later)
        # Every new hold rode with settles, in statements alone that all committed.
        assert seen.holds_alone == [] and any(w.holds for w in seen.events)
        assert all(w.alone and w.committed for w in seen.events)
        assert await _count(db, Hold, Hold.id.in_([r.hold_id for r in later])) == 3
        assert book.admitted == 6
        more = [_event(spec, 3, id=r.hold_id) for spec, r in zip(specs[3:], later, strict=True)]
        for event, reservation in zip(more, later, strict=True):
            assert await settle(runtime.settles, event, reservation) is True
        assert await _count(db, Hold, Hold.token_id == subjects["token"]) == 0
        costs = sum(e.cost for e in events + more)
        assert await book.return_idle(idle_s=0) == 3
        assert await _spent(db, subjects) == {(costs, 0)}
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == subjects["token"]) == 6
        assert await _rollup(db, subjects["token"]) == (6, costs)
    finally:
        await db.dispose()


@pytest.mark.anyio
async def test_a_hold_refused_in_a_combined_statement_fails_alone_and_the_settles_commit(fresh_pg):  # noqa: F811
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 4)
    other = Database(fresh_pg, 2)  # another replica
    try:
        subjects = _subjects()
        await _add_budgets(db, subjects, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        # Two requests on the database path, one against a fresh lease (then settled).
        plain = [_spec(subjects) for _ in range(2)]
        waiting = [await reserve(runtime, spec, 3600) for spec in plain]
        assert all(r.claim is None for r in waiting)
        leased_spec = _spec(subjects)
        leased = await reserve(runtime, leased_spec, 3600, book)
        assert leased.claim is not None
        first = _event(leased_spec, 4, id=leased.hold_id)
        assert await settle(runtime.settles, first, leased) is True
        # The token's lease is returned by another replica while this process still
        # trusts it (as when it stalled past the lease's expiry).
        lease = book.leases[subjects["token"]]
        assert await give_back(other, lease.id, lease.subject_id) is True

        events = [_event(spec, 6, id=r.hold_id) for spec, r in zip(plain, waiting, strict=True)]
        refused_spec = _spec(subjects)
        with Writes(db) as seen:
            done = await asyncio.gather(
                *(settle(runtime.settles, e, r) for e, r in zip(events, waiting, strict=True)),
                reserve(runtime, refused_spec, 3600, book),
            )
        assert done[:2] == [True, True]
        fallback = done[2]
        # The hold naming the returned lease failed alone; the request took the database
        # path and was reserved there.
        assert fallback.claim is None
        # Tried together in one statement, which kept nothing; the settles written apart.
        assert [w.committed for w in seen.events if w.holds] == [False]
        assert [w.committed for w in seen.events if not w.holds] == [True]
        assert subjects["token"] not in book.leases  # the lease is dropped
        last = _event(refused_spec, 2, id=fallback.hold_id)
        assert await settle(runtime.settles, last, fallback) is True
        await book.return_idle(idle_s=0)
        costs = sum(e.cost for e in [first, *events, last])
        assert await _spent(db, subjects) == {(costs, 0)}
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == subjects["token"]) == 4
        assert await _count(db, Hold, Hold.token_id == subjects["token"]) == 0
        assert await _rollup(db, subjects["token"]) == (4, costs)
    finally:
        await other.dispose()
        await db.dispose()


@pytest.mark.anyio
async def test_a_threshold_passed_in_a_combined_statement_keeps_the_holds_and_records_the_alert(
    fresh_pg,  # noqa: F811
):
    migrate.upgrade(fresh_pg)

    db = Database(fresh_pg, 4)
    try:
        near, far = _subjects(), _subjects()
        # 0.0002 USD: four holds of 50 tokens fit; four events of 40 tokens pass 50%.
        await _add_budgets(db, near, "0.0002", "never", utcnow())
        await _add_budgets(db, far, "1", "never", utcnow())
        runtime = _runtime(db)
        book = runtime.leases
        specs = [_spec(near) for _ in range(4)]
        reservations = [await reserve(runtime, spec, 3600) for spec in specs]
        events = [
            _event(spec, 40, id=r.hold_id) for spec, r in zip(specs, reservations, strict=True)
        ]
        far_specs = [_spec(far) for _ in range(3)]
        far_first = await reserve(runtime, far_specs[0], 3600, book)  # takes the leases
        assert far_first.claim is not None
        with Writes(db) as seen:
            done = await asyncio.gather(
                *(settle(runtime.settles, e, r) for e, r in zip(events, reservations, strict=True)),
                *(reserve(runtime, spec, 3600, book) for spec in far_specs[1:]),
            )
        assert done[:4] == [True] * 4
        far_later = done[4:]
        assert all(r.claim is not None for r in far_later)  # admitted, holds written
        assert await _count(db, Hold, Hold.id.in_([r.hold_id for r in far_later])) == 2
        # The combined statement was aborted (nothing of it kept), then written apart.
        assert [w.committed for w in seen.events if w.holds] == [False]
        assert seen.events[-1].committed and not seen.events[-1].holds
        total = sum(e.cost for e in events)
        assert await _spent(db, near) == {(total, 0)}
        assert await _alerts(db, near) == sorted(
            ("budget.threshold_crossed", subject) for subject in near.values()
        )
        far_events = [
            _event(spec, 5, id=r.hold_id)
            for spec, r in zip(far_specs, [far_first, *far_later], strict=True)
        ]
        for event, reservation in zip(far_events, [far_first, *far_later], strict=True):
            assert await settle(runtime.settles, event, reservation) is True
        await book.return_idle(idle_s=0)
        assert await _spent(db, far) == {(sum(e.cost for e in far_events), 0)}
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == near["token"]) == 4
        assert await _count(db, LedgerEvent, LedgerEvent.token_id == far["token"]) == 3
    finally:
        await db.dispose()
