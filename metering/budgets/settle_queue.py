"""Settles in groups: a process's settles go through one queue (metering.budgets.groups), and
the ones that arrive while the previous group is written form the next group, written in one
transaction (metering.budgets.settle.settle_group) or, on PostgreSQL, in one statement
(metering.budgets.settle_pg) sent through asyncpg itself. Each caller returns when its own event
is committed.

A settle whose window may have ended since its hold was taken, or with no reservation to vouch
for its windows, is written alone. A group that fails (say one bad row) is retried one settle
at a time, so one request's failure never costs the others their events. The one-statement path
serves the settles whose holds this process wrote and knows whole (no rate claim, no run); a
group whose charges pass an alert threshold is aborted by the statement itself and written by
the general path, which records the alert in the charge's transaction.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from metering.budgets import settle_pg
from metering.budgets.groups import GroupWriter, answer
from metering.budgets.reserve import Reservation, hold_json
from metering.budgets.settle import hold_additions, settle_group, settle_one
from metering.db import AttrRecord, Database
from metering.errors import LedgerUnavailable
from metering.ledger.event import UNSETTLED, Event

log = logging.getLogger("metering.budgets")


class _Crossed(Exception):
    """The one-statement settle passed a threshold and was aborted: the general path charges
    it and records the alert in one transaction."""


def expected_hold(event: Event, reservation: Reservation) -> settle_pg.Expected:
    claim = reservation.claim
    leases = {}
    if claim is not None:
        leases = {lease.scope: lease.id for lease in claim.leases if lease.id is not None}
    return settle_pg.Expected(
        event.id,
        event.token_id,
        event.user_id,
        event.team_id,
        reservation.amount,
        claim is not None,
        leases.get("token"),
        leases.get("user"),
        leases.get("team"),
    )


async def _settle_group_pg(
    db: Database,
    items: list[tuple[Event, Reservation]],
    new_holds: list[dict[str, Any]] | None = None,
) -> list[Any]:
    """settle_group in one statement (metering.budgets.settle_pg) through asyncpg itself, for
    settles whose holds carry no rate claim and no run: True for each settle it committed,
    None for each it left to be settled alone (hold swept, or not as its reservation wrote it).
    Raises _Crossed, with nothing written, when a budget would pass a threshold. `new_holds`:
    hold rows the same statement inserts (all of them, or none if it fails)."""
    events, holds, adds = [], [], []
    for event, reservation in items:
        hold = expected_hold(event, reservation)
        capped = event.capped(hold.amount)
        events.append(capped)
        holds.append(hold)
        adds += [(hold.id, *added) for added in hold_additions(hold, capped.cost)]
    params = settle_pg.parameters(events, holds, adds)
    statement = settle_pg.STATEMENT
    if new_holds:
        statement = settle_pg.with_holds(tuple(new_holds[0]))
        params["new_holds"] = hold_json(new_holds)
    try:
        async with db.raw() as conn:
            row = await conn.fetchrow(
                statement.sql, *statement.args(params), record_class=AttrRecord
            )
    except asyncpg.PostgresError as exc:
        if exc.sqlstate == settle_pg.ABORTED:
            raise _Crossed() from None
        raise
    ok = set(row.ok or ())
    if missed := [event.id for event in events if event.id not in ok]:
        await _not_taken(db, missed)
    return [True if event.id in ok else None for event in events]


async def _not_taken(db: Database, ids: list[str]) -> None:
    """Holds the one-statement settle did not take: swept while their requests ran (not found
    now), or found but not as their reservations wrote them, which is a bug, logged. Only a
    diagnostic, after the group's statement committed: it never fails the group."""
    try:
        async with db.raw() as conn:
            found = await conn.fetchval(settle_pg.FOUND, ids)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        log.warning("could not look for holds the settle did not take: %s", exc)
        return
    if found:
        log.error(
            "settled holds were not the ones written (%s); settling them by the general path",
            ", ".join(sorted(found)),
        )


_HOLD = object()  # marks a hold in the settle queue (PostgreSQL)

HoldBatch = list[tuple[dict[str, Any], asyncio.Future[Any]]]


class SettleQueue:
    """A process's settles, written in groups (metering.budgets.groups): each caller returns
    when its own event is committed. A group that fails (say one bad row) is retried one
    settle at a time, so one request's failure never costs the others their events.

    On PostgreSQL the holds of leased requests join the same queue (`hold`): one statement per
    group inserts the holds and settles the settles that waited together, so a busy process
    sends one statement per group where it sent one per kind. A group with holds and no
    settles is the holds' own INSERT; a combined statement that fails (a hold refused, a
    threshold passed) keeps nothing, and its holds and settles are written apart, as they are
    when some settle of the group must take the general path."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.groups = GroupWriter(
            self._write, lambda: LedgerUnavailable("settle interrupted; retry")
        )
        self.one_statement = 0  # settles committed by the one-statement path (PostgreSQL)
        self.grouped = 0  # settles committed in groups of two or more
        self.retried = 0  # groups that failed and were retried one settle at a time
        self.carried = 0  # holds inserted by a settle group's statement (PostgreSQL)
        self.split = 0  # statements of settles and holds that failed and were written apart

    async def settle(self, event: Event, reservation: Reservation | None) -> bool:
        if (
            reservation is None
            or event.status == UNSETTLED
            or not reservation.window_unchanged(event.created_at)
        ):
            # A window to roll first, or no reservation to vouch for the windows: alone.
            return await settle_one(self.db, event, reservation)
        settled: bool = await self.groups.submit((event, reservation))
        return settled

    async def hold(
        self, row: dict[str, Any], apart: Callable[[HoldBatch], Awaitable[None]]
    ) -> None:
        """Insert a hold (PostgreSQL) with the next group; `apart(batch)` writes holds on their
        own (a group of holds alone, or after a combined statement failed) and answers them."""
        await self.groups.submit((_HOLD, row, apart))

    async def _write(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        holds: HoldBatch = []
        settles = []
        apart: Any = None  # the holds' writer, set with the first hold
        for item, future in batch:
            if item[0] is _HOLD:
                holds.append((item[1], future))
                apart = item[2]  # every hold writer of this database writes holds alike
            else:
                settles.append((item, future))
        if not holds:
            await self._settles(settles)
        elif not settles:
            await apart(holds)
        elif not all(r.plain for (_, r), _ in settles):
            await asyncio.gather(self._settles(settles), apart(holds))
        else:
            await self._combined(settles, holds, apart)

    async def _combined(
        self,
        settles: list[Any],
        holds: HoldBatch,
        apart: Callable[[HoldBatch], Awaitable[None]],
    ) -> None:
        """The settles and the holds in one statement; if it fails, nothing of it is kept,
        and both are written apart (the settles by the general path if they passed a
        threshold)."""
        items = [item for item, _ in settles]
        try:
            results = await _settle_group_pg(self.db, items, [row for row, _ in holds])
        except _Crossed:
            self.split += 1
            await asyncio.gather(self._answer_general(settles), apart(holds))
            return
        except Exception:
            self.split += 1
            await asyncio.gather(self._settles(settles), apart(holds))
            return
        for _, future in holds:
            answer(future)
        self.carried += len(holds)
        self._count(results, len(settles))
        await self._answer(settles, results)

    async def _answer_general(self, batch: list[Any]) -> None:
        await self._answer(batch, await self._general([item for item, _ in batch]))

    def _count(self, results: list[Any], size: int) -> None:
        settled = sum(1 for result in results if result)
        self.one_statement += settled
        if size > 1:
            self.grouped += settled

    async def _settles(self, batch: list[Any]) -> None:
        items = [item for item, _ in batch]
        if self.db.dialect == "postgresql" and all(r.plain for _, r in items):
            try:
                results = await _settle_group_pg(self.db, items)
            except _Crossed:
                results = await self._general(items)
            except Exception:
                self.retried += 1
                results = [None] * len(batch)  # one at a time below: the good ones commit
            else:
                self._count(results, len(batch))
        else:
            results = await self._general(items)
        await self._answer(batch, results)

    async def _general(self, items: list[tuple[Event, Reservation]]) -> list[bool | None]:
        results: list[bool | None] = [None] * len(items)
        if len(items) > 1:
            try:
                results = await settle_group(self.db, items)
            except Exception:
                self.retried += 1
                results = [None] * len(items)  # one at a time below: the good ones commit
            else:
                self.grouped += sum(1 for result in results if result)
        return results

    async def _answer(self, batch: list[Any], results: list[bool | None]) -> None:
        """Answer the settles written; those not (a group that failed, a hold not found)
        are written one at a time."""
        alone = []
        for (item, future), result in zip(batch, results, strict=True):
            if result is None:
                alone.append((item, future))
            else:
                answer(future, result)
        if not alone:
            return
        # Side by side, each in its own transaction: a database that stopped answering costs
        # one timeout, not one per settle.
        ends = await asyncio.gather(
            *(settle_one(self.db, event, reservation) for (event, reservation), _ in alone),
            return_exceptions=True,
        )
        for (_, future), end in zip(alone, ends, strict=True):
            if isinstance(end, BaseException):
                answer(future, error=end)
            else:
                answer(future, end)


async def settle(queue: SettleQueue, event: Event, reservation: Reservation | None = None) -> bool:
    """Turn a hold into its ledger event (the event's id is the hold's); False when it was
    already settled (or expired). Settles that arrive together are written in one
    transaction (`queue`, the process's: BudgetRuntime.settles); this returns once the event is
    committed."""
    if reservation is None or reservation.claim is None:
        return await queue.settle(event, reservation)
    claim = reservation.claim
    settled = None
    try:
        settled = await queue.settle(event, reservation)
        return settled
    finally:
        # Charged from its hold: the lease lost exactly the cost (at most the hold: the hold's
        # amount is the reservation's); otherwise (not settled here, or its hold swept first)
        # the whole hold.
        charged = settled and not claim.swept
        claim.end(cost=event.capped(reservation.amount).cost if charged else None)
