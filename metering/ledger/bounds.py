"""Whether a signed amount (an adjustment) fits every rollup row it adds to: each row's `cost`
and `adjustments` sums stay within COUNTER_CEILING either way (a credit makes a row negative,
and a row is not bounded by the rows it is part of when amounts are signed, so every row is
checked, not only the widest).

Read in the transaction that then appends the event, after its team's budget is locked: every
adjustment locks its team's budget and every rollup row it adds to is its team's, so no other
adjustment can move them in between; settles and ingested usage only add what requests cost.
The increments not yet folded in (rollup_pending) count with the rows.
"""

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from metering.ledger.event import Event
from metering.ledger.rollup import PENDING, ROLLUPS, Rollup, project, row_for
from metering.money import COUNTER_CEILING, format_usd
from metering.timefmt import rfc3339

CHECKED = ("cost", "adjustments")


async def _sums(conn: AsyncConnection, rollup: Rollup, part: dict[str, Any]) -> list[int]:
    """The row's current `cost` and `adjustments`, with its pending increments."""
    table = rollup.table
    found = (
        await conn.execute(
            select(*(table.c[name] for name in CHECKED)).where(
                *(table.c[name] == part[name] for name in rollup.key)
            )
        )
    ).first()
    sums = [int(value) for value in found] if found is not None else [0] * len(CHECKED)
    pending = PENDING.table
    at = part[rollup.grain]
    length = timedelta(days=1) if rollup.grain == "day" else timedelta(hours=1)
    waiting = (
        await conn.execute(
            select(*(func.coalesce(func.sum(pending.c[name]), 0) for name in CHECKED)).where(
                pending.c.hour >= at,
                pending.c.hour < at + length,
                *(pending.c[name] == part[name] for name in rollup.keys),
            )
        )
    ).one()
    return [total + int(more) for total, more in zip(sums, waiting, strict=True)]


async def past_ceiling(conn: AsyncConnection, event: Event) -> str | None:
    """Why appending the event would take a rollup row's sums past COUNTER_CEILING, either
    way (a sum already past it may still be brought back); None when it fits."""
    row = row_for(event)
    for rollup in ROLLUPS:
        part = project(rollup, row)
        for name, total in zip(CHECKED, await _sums(conn, rollup, part), strict=True):
            after = total + part[name]
            if abs(after) <= COUNTER_CEILING or abs(after) <= abs(total):
                continue
            return (
                f"this amount would take the {name} of team {event.team_id}'s {rollup.grain} "
                f"from {rfc3339(part[rollup.grain])} in {rollup.table.name} from "
                f"{format_usd(total)} to {format_usd(after)} USD: past the "
                f"{format_usd(COUNTER_CEILING)} USD a sum keeps either way"
            )
    return None
